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
    _issue(tmp_path, "--devices", "cam-a,cam-b", "--one-file", "cams", "--serial", "3")
    assert _scope(tmp_path / "out" / "cams.credential") == "cam-a,cam-b@3"


@pytest.mark.parametrize("args, message", [
    (["--devices", "a/3"], "--devices: bad device ids ['a/3']"),
    (["--shards", "0-2", "--prefix", "x y"], "--prefix 'x y'"),
    (["--shards", "2-0"], "--shards: bad shard list '2-0'"),
    (["--devices", "a", "--one-file", "../a"], "--one-file '../a'"),
    (["--devices", "a", "--serial", "0"], "--serial must be between 1 and 999999999, got 0"),
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


def test_revoke_appends_each_id_once_and_refuses_what_is_no_credential(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SFL_ENROLMENT_KEY", raising=False)
    _issue(tmp_path, "--shards", "4")
    listed = tmp_path / "revoked.txt"
    main(["credentials", "revoke", "--list", str(listed), str(tmp_path / "out" / "dev-004.credential"), "cam-a@2"])
    main(["credentials", "revoke", "--list", str(listed), "dev/4"])
    assert listed.read_text() == "dev/4\ncam-a@2\n"
    out = capsys.readouterr().out
    assert "revoked: dev/4 (devices dev-004 (shard 4))" in out and "already revoked: dev/4" in out
    for item, message in (("dev 4", "'dev 4': neither a credential file nor a credential id"),
                          (str(tmp_path), "neither a credential file nor a credential id")):
        with pytest.raises(SystemExit):
            main(["credentials", "revoke", "--list", str(listed), item])
        assert message in " ".join(capsys.readouterr().err.split())   # argparse wraps the line
    listed.write_text("dev/4\nnot a scope\n")
    with pytest.raises(SystemExit):
        main(["credentials", "revoke", "--list", str(listed), "dev/5"])
    assert "line 2" in capsys.readouterr().err and listed.read_text() == "dev/4\nnot a scope\n"
