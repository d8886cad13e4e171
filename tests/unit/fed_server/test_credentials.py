"""``python -m fed_server credentials issue``: the files it writes verify at a Fed Server holding the key."""
from __future__ import annotations

import pytest

from fed_server.__main__ import main
from shared.auth import Auth

KEY = "enrolment-key"


def _issue(tmp_path, *args: str) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    main(["credentials", "issue", "--key-file", str(tmp_path / "key"), "--out", str(tmp_path / "out"), *args])


def _scope(path) -> str:
    enrolment = Auth(b"service", enrolment_key=KEY.encode()).check_enrolment(
        {"x-enrolment-secret": path.read_text().strip()})
    return str(enrolment.scope)


def test_one_file_per_device_or_one_for_an_agent_hosting_them_all(tmp_path, monkeypatch):
    monkeypatch.delenv("SFL_ENROLMENT_KEY", raising=False)
    _issue(tmp_path, "--shards", "0-2,5", "--prefix", "edge")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"edge-00{s}.credential" for s in (0, 1, 2, 5)]
    assert _scope(tmp_path / "out" / "edge-005.credential") == "edge/5"
    _issue(tmp_path, "--shards", "0-2,5", "--prefix", "edge", "--one-file", "agent-0")
    assert _scope(tmp_path / "out" / "agent-0.credential") == "edge/0-2,edge/5"
    _issue(tmp_path, "--devices", "cam-a,cam-b", "--one-file", "cams")
    assert _scope(tmp_path / "out" / "cams.credential") == "cam-a,cam-b"


@pytest.mark.parametrize("args, message", [
    (["--devices", "a/3"], "--devices: bad device ids ['a/3']"),
    (["--shards", "0-2", "--prefix", "x y"], "--prefix 'x y'"),
    (["--shards", "2-0"], "--shards: bad shard list '2-0'"),
    (["--devices", "a", "--one-file", "../a"], "--one-file '../a'"),
])
def test_bad_flags_are_refused_before_anything_is_written(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        _issue(tmp_path, *args)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_key_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SFL_ENROLMENT_KEY", raising=False)
    monkeypatch.delenv("SFL_ENROLMENT_KEY_FILE", raising=False)
    with pytest.raises(SystemExit):
        main(["credentials", "issue", "--devices", "a", "--out", str(tmp_path / "out")])
    assert "no enrolment key" in capsys.readouterr().err
