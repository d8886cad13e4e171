"""Which run a start takes up in a runs folder (fed_server/runs_root.py), on real run directories."""
from __future__ import annotations

import re

import pytest

from fed_server.run_dir import RunDirectory
from fed_server.runs_root import RUN_ID_PATTERN, RunRefused, RunsRoot
from shared.run_config import load_run_config

CONFIG = load_run_config({"algorithm": "fedavg", "rounds": 3})
OTHER = load_run_config({"algorithm": "fedavg", "rounds": 3, "train": {"lr": 0.5}})


def _run(root: RunsRoot, run_id: str, *, checkpoint: bool = False, over: bool = False, config=CONFIG,
         current: bool = True) -> None:
    """A run directory as a Fed Server leaves it: its config, and a checkpoint and summary if asked."""
    run = RunDirectory(root.path / run_id)
    run.write_config(config, run_id)
    if checkpoint:
        run.checkpoint_path.write_bytes(b"a checkpoint")
    if over:
        run.write_summary({"finished": True})
    if current:
        (root.path / "current").write_text(run_id + "\n")


def test_an_empty_folder_begins_a_new_run_named_by_its_time_and_algorithm(tmp_path):
    root = RunsRoot(tmp_path / "runs")
    choice = root.choose(CONFIG)
    assert not choice.resume and choice.path == root.path / choice.run_id
    assert re.fullmatch(r"\d{8}-\d{6}-fedavg-[0-9a-f]{4}", choice.run_id) and re.fullmatch(RUN_ID_PATTERN, choice.run_id)
    assert choice.why == f"new run {choice.run_id}"
    root.take(choice)
    assert (root.path / "current").read_text() == choice.run_id + "\n"


def test_the_unfinished_current_run_is_resumed_and_an_over_one_gives_way_to_a_new_run(tmp_path):
    root = RunsRoot(tmp_path)
    _run(root, "a", checkpoint=True)
    choice = root.choose(CONFIG)
    assert (choice.run_id, choice.resume, choice.why) == ("a", True, "resuming run a: it is unfinished")
    _run(root, "a", checkpoint=True, over=True)
    choice = root.choose(CONFIG)
    assert not choice.resume and choice.run_id != "a" and choice.why == f"new run {choice.run_id}: the last run, a, is over"
    # An over run with another configuration is no obstacle: it is not resumed.
    assert not root.choose(OTHER).resume


def test_a_current_file_naming_no_run_directory_is_none(tmp_path):
    root = RunsRoot(tmp_path)
    (tmp_path / "current").write_text("gone\n")
    assert root.current() is None and not root.choose(CONFIG).resume


def test_another_configuration_against_the_unfinished_run_is_refused_with_what_to_do(tmp_path):
    root = RunsRoot(tmp_path)
    _run(root, "a", checkpoint=True)
    with pytest.raises(RunRefused) as refused:
        root.choose(OTHER)
    message = str(refused.value)
    assert "\n" not in message
    assert f"run a in {tmp_path / 'a'} is unfinished and was started with another configuration (train.lr differ" in message
    assert f"start with its configuration ({tmp_path / 'a' / 'config.yaml'})" in message
    assert "--new-run (SFL_NEW_RUN=1)" in message
    # Nothing trained yet (no checkpoint): the run starts over under the new configuration.
    _run(root, "b")
    assert root.choose(OTHER).run_id == "b"


def test_new_run_leaves_the_unfinished_run_and_resume_takes_up_a_given_one(tmp_path):
    root = RunsRoot(tmp_path)
    _run(root, "old", checkpoint=True, over=True, current=False)
    _run(root, "a", checkpoint=True)
    choice = root.choose(OTHER, new_run=True)
    assert not choice.resume and choice.why == f"new run {choice.run_id} (--new-run); the unfinished run a stays in {tmp_path / 'a'}"
    assert root.choose(CONFIG, resume="old") == root.choose(CONFIG, resume="old")
    assert root.choose(CONFIG, resume="old").resume and root.choose(CONFIG, resume="old").path == tmp_path / "old"
    with pytest.raises(RunRefused, match=r"run old in .* is finished and was started with another configuration .*"
                                         r"without --resume old to begin a new run"):
        root.choose(OTHER, resume="old")
    with pytest.raises(RunRefused, match=r"no run nope in .* to resume \(runs there: a, old\)"):
        root.choose(CONFIG, resume="nope")


def test_a_given_run_id_names_a_new_run_or_the_current_unfinished_one(tmp_path):
    root = RunsRoot(tmp_path)
    assert root.choose(CONFIG, run_id="exp-1").run_id == "exp-1"
    _run(root, "exp-1", checkpoint=True)
    assert root.choose(CONFIG, run_id="exp-1").resume   # the same start again, after a crash
    choice = root.choose(CONFIG, run_id="exp-2")
    assert (choice.run_id, choice.resume) == ("exp-2", False)
    assert choice.why == f"new run exp-2 (--run-id); the unfinished run exp-1 stays in {tmp_path / 'exp-1'}"
    _run(root, "exp-1", checkpoint=True, over=True)
    with pytest.raises(RunRefused, match="run exp-1 exists in .*: resume it with --resume exp-1, or give another --run-id"):
        root.choose(CONFIG, run_id="exp-1")


@pytest.mark.parametrize("flags", [{"resume": "a", "new_run": True}, {"resume": "a", "run_id": "b"}])
def test_resume_and_a_new_run_exclude_each_other(tmp_path, flags):
    with pytest.raises(RunRefused, match="give one of them"):
        RunsRoot(tmp_path).choose(CONFIG, **flags)


@pytest.mark.parametrize("bad", ["..", ".hidden", "a/b", "", "x" * 65, "-a"])
def test_a_run_id_must_be_a_plain_directory_name(tmp_path, bad):
    with pytest.raises(RunRefused, match="bad run id"):
        RunsRoot(tmp_path).choose(CONFIG, run_id=bad)
    with pytest.raises(RunRefused, match="bad run id"):
        RunsRoot(tmp_path).choose(CONFIG, resume=bad)
