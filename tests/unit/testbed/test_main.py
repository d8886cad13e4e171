"""``python -m testbed``'s command line (--device-data and the device count it implies) and its round
line (server-evaluated, federated, and without figures)."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

import testbed.__main__ as cli
from testbed.follow import format_round
from testbed.config_check import CheckResult, check


@pytest.fixture(autouse=True)
def check_in_this_process(monkeypatch):
    """The launcher's configuration check, run here instead of in its child process (the same
    function, without a torch import per call); test_the_launcher_never_imports_torch runs the
    child."""
    monkeypatch.setattr(cli, "check_in_child", lambda request: CheckResult.model_validate_json(
        check(request).model_dump_json()))


def test_cli_counts_the_devices_of_device_data_paths(tmp_path, monkeypatch):
    for name in ("a", "b"):
        np.savez(tmp_path / f"{name}.npz", x=np.zeros((2, 3)), y=np.zeros(2, dtype=int))
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("d", "e"):
        np.savez(folder / f"{name}.npz", x=np.zeros((2, 3)), y=np.zeros(2, dtype=int))
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump({"algorithm": "fedavg", "model": "logreg",
                                           "data": {"dataset": "local", "num_classes": 2, "input_shape": [1, 1, 3]}}))
    seen = {}

    class Stop(Exception):
        pass

    def fake_testbed(config, run_dir, **kwargs):
        seen.update(num_devices=config.data.num_devices, device_data=kwargs["device_data"])
        raise Stop

    monkeypatch.setattr(cli, "Testbed", fake_testbed)
    paths = [str(tmp_path / "a.npz"), str(folder)]
    args = ["--config", str(config), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(Stop):
        cli.main([*args, *(a for p in paths for a in ("--device-data", p))])
    assert seen == {"num_devices": 3, "device_data": paths}
    with pytest.raises(Stop):
        cli.main([*args, "--device-data", paths[0], "--devices", "5"])
    assert seen["num_devices"] == 5

def _testbed_of(argv: list[str], tmp_path, monkeypatch) -> tuple:
    """The run configuration and the other Testbed arguments ``python -m testbed ARGV`` would
    start (the testbed is not started)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_testbed(config, run_dir, **kwargs):
        seen.update(config=config, kwargs=kwargs)
        raise Stop

    monkeypatch.setattr(cli, "Testbed", fake_testbed)
    with pytest.raises(Stop):
        cli.main([*argv, "--run-dir", str(tmp_path / "run")])
    return seen["config"], seen["kwargs"]


def _config_of(argv: list[str], tmp_path, monkeypatch):
    """The run configuration ``python -m testbed ARGV`` would start."""
    return _testbed_of(argv, tmp_path, monkeypatch)[0]


def test_enrolment_defaults_to_the_shared_secret_and_credentials_is_passed_on(tmp_path, monkeypatch):
    assert _testbed_of([], tmp_path, monkeypatch)[1]["enrolment"] == "secret"
    assert _testbed_of(["--enrolment", "credentials"], tmp_path, monkeypatch)[1]["enrolment"] == "credentials"
    with pytest.raises(SystemExit):
        cli.main(["--enrolment", "keys"])


def test_data_args_go_to_the_testbed_with_device_data_only(tmp_path, monkeypatch, capsys):
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump({"algorithm": "fedavg", "model": "logreg",
                                      "data": {"dataset": "local", "num_classes": 2, "input_shape": [1, 1, 3]}}))
    argv = ["--config", str(config), "--device-data", "pkg.mod:load", "--data-arg", "root=/d", "--data-arg", "n=2"]
    assert _testbed_of(argv, tmp_path, monkeypatch)[1]["data_args"] == ["root=/d", "n=2"]
    with pytest.raises(SystemExit):
        cli.main(["--data-arg", "root=/d"])
    assert "--data-arg is for the functions of --device-data" in capsys.readouterr().err


def test_a_test_file_that_federated_evaluation_leaves_unread_is_warned_of_once(tmp_path, monkeypatch, capsys):
    # evaluation.mode: federated with data.test_file used to ignore the file without a word.
    np.savez(tmp_path / "test.npz", x=np.zeros((2, 1, 1, 3)), y=np.zeros(2, dtype=int))
    data = {"dataset": "local", "num_classes": 2, "input_shape": [1, 1, 3], "test_file": str(tmp_path / "test.npz")}
    for mode, warned in (("federated", 1), ("server", 0)):
        config = tmp_path / f"{mode}.yaml"
        config.write_text(yaml.safe_dump({"algorithm": "fedavg", "model": "logreg", "data": data,
                                          "evaluation": {"mode": mode}}))
        _testbed_of(["--config", str(config), "--device-data", "pkg.mod:load"], tmp_path, monkeypatch)
        lines = [line for line in capsys.readouterr().out.splitlines() if "test.npz" in line]
        assert len(lines) == warned, lines
        if warned:
            assert lines[0].startswith(f"warning: data.test_file '{tmp_path / 'test.npz'}' is ignored: evaluation.mode "
                                       "is federated"), lines


def test_paper_scale_is_one_flag_and_other_flags_win(tmp_path, monkeypatch):
    default = _config_of([], tmp_path, monkeypatch)
    assert (default.algorithm, default.data.num_devices, default.per_round, default.rounds) == ("s2fl", 10, 10, 20)
    paper = _config_of(["--paper-scale"], tmp_path, monkeypatch)
    assert (paper.data.num_devices, paper.per_round, paper.rounds) == (100, 10, 30)
    assert paper.devices.profiles == default.devices.profiles   # the same emulated 5:3:2 mix
    mixed = _config_of(["--paper-scale", "--rounds", "5", "--set", "devices_per_round=20"], tmp_path, monkeypatch)
    assert (mixed.data.num_devices, mixed.per_round, mixed.rounds) == (100, 20, 5)


STATUS = {"rounds_total": 2}


def test_the_round_line_marks_federated_figures_and_shows_missing_ones_as_na(round_record):
    assert "acc  50.00%  loss 1.250" in format_round(round_record(), STATUS)
    assert "acc(fed)  50.00%  loss 1.250" in format_round(round_record(evaluated_devices=3), STATUS)
    line = format_round(round_record(evaluated_devices=0, test_accuracy=None, test_loss=None), STATUS)
    assert "acc(fed) n/a  loss n/a" in line


LAUNCH_WITHOUT_SERVICES = """
import sys
import testbed.__main__ as cli

class Stop(Exception):
    pass

def fake_testbed(config, run_dir, **kwargs):
    print(config.algorithm, config.rounds, kwargs["main_servers"], kwargs["torch_device"])
    raise Stop

cli.Testbed = fake_testbed
try:
    cli.main(sys.argv[1:])
except Stop:
    pass
print("torch imported:", "torch" in sys.modules)
"""


def test_the_launcher_never_imports_torch(tmp_path):
    # The whole command line up to starting the services, the configuration check in its child
    # included: the launcher process ends without torch, and gets the checked config, the Main
    # Server count of the algorithm's split mode (FedAvg: none) and the torch device the child
    # resolved ``auto`` to.
    import subprocess
    import sys

    from shared.torch_device import resolve_torch_device
    from testbed.processes import service_env

    result = subprocess.run([sys.executable, "-c", LAUNCH_WITHOUT_SERVICES, "--algorithm", "fedavg", "--rounds", "3",
                             "--torch-device", "auto", "--run-dir", str(tmp_path / "run")],
                            env=service_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == [f"fedavg 3 0 {resolve_torch_device('auto')}",
                                               "torch imported: False"], result.stdout
