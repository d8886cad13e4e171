"""The agent's --data devices: flag parsing, device ids, and bad data stopping before registration."""
from __future__ import annotations

import numpy as np
import pytest

from device_agent.agent import Agent, local_device_ids, parse_data_args
from device_agent.device import Device
from shared.data import DataSpec
from shared.data.local import DataError, LocalSource
from shared.models import build_model, model_fingerprint
from shared.schemas import RegisterRequest, RegisterResponse, RunInfo

LOCAL = DataSpec(dataset="local", num_classes=3, input_shape=[1, 2, 2], num_devices=2)  # images: the zoo models take [C, H, W]


def _npz(path, n: int = 6) -> str:
    np.savez(path, x=np.ones((n, 2, 2), dtype=np.float32), y=np.arange(n) % 3)
    return str(path)


def test_data_flags_make_one_device_per_source(agent_cli, tmp_path):
    one = _npz(tmp_path / "site a.npz")
    folder = tmp_path / "more"
    folder.mkdir()
    _npz(folder / "b.npz")
    _npz(folder / "c.npz")
    kwargs = agent_cli.built_with(["--data", one, "--data", str(folder), "--data-arg", "k=v=w", "--prefix", "lab"])
    assert [s.name for s in kwargs["sources"]] == ["site a", "b", "c"]
    assert kwargs["shards"] == [] and kwargs["data_args"] == {"k": "v=w"}
    assert local_device_ids(kwargs["sources"], "lab") == ["lab-site_a", "lab-b", "lab-c"]


def test_shards_stay_the_default_without_data(agent_cli):
    kwargs = agent_cli.built_with([])
    assert kwargs["shards"] == [0] and kwargs["sources"] == []


@pytest.mark.parametrize("argv, message", [
    (["--data", "x.npz", "--shards", "0-3"], "--data and --shards are exclusive"),
    (["--data-arg", "a=1"], "--data-arg and --device-id are for --data devices"),
    (["--data", "pkg.mod:load", "--data-arg", "no-equals"], "bad --data-arg 'no-equals'"),
    (["--data", "pkg.mod:load", "--data", "other.mod:load"], "the same device id"),
    (["--data", "pkg.mod:load", "--data", "other.mod:get", "--device-id", "me"], "--device-id names one device"),
])
def test_bad_data_flags_are_usage_errors(agent_cli, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        agent_cli.built_with(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unreadable_data_value_is_a_device_of_its_own_not_a_usage_error(agent_cli, tmp_path):
    good = _npz(tmp_path / "good.npz")
    kwargs = agent_cli.built_with(["--data", "/no/such/site.npz", "--data", good])
    assert [(s.name, s.refused) for s in kwargs["sources"]] == [
        ("site", "/no/such/site.npz: data file or folder not found (nor an import path package.module:function)"),
        ("good", None)]


def test_a_device_folder_that_loops_leaves_the_agents_other_devices(agent_cli, tmp_path):
    """``bad``'s class folder ``1`` links back to ``bad``: the agent is built with both devices
    (the loop stopped it at start, before links were checked), and ``bad``'s load refuses the link."""
    good = _npz(tmp_path / "good.npz")
    bad = tmp_path / "bad"
    (bad / "0").mkdir(parents=True)
    (bad / "1").symlink_to(".")
    kwargs = agent_cli.built_with(["--data", good, "--data", str(bad)])
    assert [s.name for s in kwargs["sources"]] == ["good", "bad"]
    with pytest.raises(DataError, match=f"^{bad / '1'}: a symbolic link that loops"):
        kwargs["sources"][1].load(LOCAL)


def test_parse_data_args_and_ids():
    assert parse_data_args(["a=1", "b="]) == {"a": "1", "b": ""}
    with pytest.raises(ValueError, match="given twice"):
        parse_data_args(["a=1", "a=2"])
    src = [LocalSource("x" * 80, "f.npz")]
    assert local_device_ids(src, "dev") == [("dev-" + "x" * 80)[:64]]
    assert local_device_ids(src, "dev", "edge-7") == ["edge-7"]
    with pytest.raises(ValueError, match="not allowed"):
        local_device_ids(src, "dev", "bad id")


class FakeFed:
    """Serves a run's info and records registrations."""

    def __init__(self, spec: DataSpec) -> None:
        num_classes, input_shape = spec.num_classes or 10, spec.input_shape or [1, 28, 28]
        model = build_model("logreg", num_classes, tuple(input_shape))
        self.info = RunInfo(run_id="r", algorithm="fedavg", model="logreg", num_classes=num_classes,
                            input_shape=input_shape, data=spec, seed=0, fingerprint=model_fingerprint(model, spec))
        self.registrations: list[RegisterRequest] = []

    def run_info(self) -> RunInfo:
        return self.info

    def register(self, req: RegisterRequest) -> RegisterResponse:
        self.registrations.append(req)
        return RegisterResponse(run_id="r", device_id=req.device_id, shard=len(self.registrations) - 1)


def _device(fed: FakeFed, shard: int | None, source: LocalSource | None) -> Device:
    return Device("dev-x", shard, fed, lambda url, token: None, kind=None, source=source)  # type: ignore[arg-type]


def test_local_device_loads_its_file_and_registers_without_a_shard(tmp_path):
    fed = FakeFed(LOCAL)
    device = _device(fed, None, LocalSource("a", _npz(tmp_path / "a.npz", n=7)))
    assert not device.ready_to_register
    device.setup(register=False)
    assert device.ready_to_register and fed.registrations == []   # its agent registers it, with this
    device.register()
    assert [(r.shard, r.num_samples) for r in fed.registrations] == [(None, 7)]
    assert device.data is not None and device.data.label_counts().tolist() == [3, 2, 2]


def test_bad_data_stops_before_registering(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((3, 2, 2)), y=np.array([0, 1, 5]))
    fed = FakeFed(LOCAL)
    with pytest.raises(DataError, match=r"bad.npz: field 'y' has labels 0..5, outside 0..2"):
        _device(fed, None, LocalSource("bad", str(bad))).setup()
    assert fed.registrations == []


def test_data_and_run_kind_must_match(tmp_path):
    with pytest.raises(DataError, match="needs a run with data.dataset: local"):
        _device(FakeFed(DataSpec(max_samples=100)), None, LocalSource("a", _npz(tmp_path / "a.npz"))).setup()
    with pytest.raises(DataError, match="start the agent with --data PATH instead of --shards"):
        _device(FakeFed(LOCAL), 0, None).setup()


def test_agent_reports_bad_data_in_one_line(tmp_path, caplog):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"")
    agent = Agent("http://127.0.0.1:9", [], None, sources=[LocalSource("bad", str(bad))])
    fed = FakeFed(LOCAL)
    agent.devices[0].fed = fed  # type: ignore[assignment]
    assert agent.run() == 2
    lines = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in lines] == [f"dev-bad: not registered: {bad}: data file is empty"]
    assert lines[0].exc_info is None and fed.registrations == []


def test_a_refused_data_value_stops_its_device_before_the_run_is_waited_for(caplog):
    """Nothing answers at the Fed Server's address: the agent would wait for the run, but its only
    device's data was refused when it was listed, so it stops at once, in one line."""
    refused = LocalSource("site", "/no/such/site.npz", refused="/no/such/site.npz: data file or folder not found")
    agent = Agent("http://127.0.0.1:9", [], None, sources=[refused])
    assert agent.run() == 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "dev-site: not registered: /no/such/site.npz: data file or folder not found"]


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", None), ("0", 0), ("3", 3)])
def test_the_compute_slots_flag_is_auto_or_a_whole_number(monkeypatch, agent_cli, value, expected):
    """``--compute-slots``: auto (the default) lets the Agent choose; a count is passed as is."""
    monkeypatch.delenv("SFL_COMPUTE_SLOTS", raising=False)
    argv = ["--fed-server-url", "http://127.0.0.1:9", "--shards", "0"] + ([] if value is None else ["--compute-slots", value])
    assert agent_cli.built_with(argv)["compute_slots"] == expected


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_compute_slots_value_is_refused_naming_the_flag(agent_cli, capsys, value):
    with pytest.raises(SystemExit):
        agent_cli.built_with(["--fed-server-url", "http://127.0.0.1:9", "--compute-slots", value])
    assert "--compute-slots" in capsys.readouterr().err
