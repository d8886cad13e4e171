"""``--slice INDEX/COUNT``: one agent of COUNT takes its contiguous block of ``--shards``."""
from __future__ import annotations

import pytest

from device_agent.slices import agent_shards, host_ordinal, parse_slice, shard_slice


@pytest.mark.parametrize("count", range(1, 13))
@pytest.mark.parametrize("shards", [list(range(10)), [3, 9, 4, 0, 7], list(range(1))])
def test_the_blocks_of_count_agents_hold_every_shard_once_in_order(shards, count):
    blocks = [shard_slice(shards, i, count) for i in range(count)]
    assert [s for block in blocks for s in block] == shards
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_the_larger_blocks_come_first():
    assert [shard_slice(range(10), i, 3) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [shard_slice(range(10), i, 4) for i in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert shard_slice(range(10), 0, 1) == list(range(10))
    assert shard_slice([5, 1, 8], 1, 2) == [8]


@pytest.mark.parametrize("host,ordinal", [("device-agents-0", 0), ("device-agents-12", 12),
                                          ("device-agents-3.device-agents.s2fl.svc.cluster.local", 3),
                                          ("a-07", 7), ("device-agents", None), ("agent3", None), ("-3", None),
                                          ("device-agents-", None), ("node-1a", None), ("", None)])
def test_the_ordinal_is_the_host_names_trailing_number(host, ordinal):
    assert host_ordinal(host) == ordinal


def test_a_slice_parses_with_a_given_or_automatic_index():
    assert parse_slice("1/3") == (1, 3)
    assert parse_slice(" 0/1 ") == (0, 1)
    assert parse_slice("auto/4", hostname="device-agents-2") == (2, 4)


@pytest.mark.parametrize("text", ["3", "1/", "/3", "a/3", "1/b", "-1/3", "1/-3", "1/0", "1.0/3", "1/3/5", "", "²/3"])
def test_a_malformed_slice_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match=r"^bad --slice .*INDEX/COUNT") as error:
        parse_slice(text, hostname="device-agents-0")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text,host", [("3/3", "x"), ("7/3", "x"), ("auto/2", "device-agents-2")])
def test_an_index_not_below_count_is_refused(text, host):
    with pytest.raises(ValueError, match=r"INDEX \d+ is not below COUNT \d+ \(agents 0 to \d+\)$"):
        parse_slice(text, hostname=host)


def test_an_automatic_index_needs_an_ordinal_in_the_host_name():
    with pytest.raises(ValueError, match=r"^--slice auto/3: the host name 'laptop' ends in no -<ordinal>"):
        parse_slice("auto/3", hostname="laptop")


def test_an_agent_with_no_shard_of_its_own_is_refused():
    assert agent_shards([0, 1, 2], "2/3", hostname="x") == [2]
    with pytest.raises(ValueError, match=r"^--slice 3/4: agent 3 of 4 gets none of the 3 shards \(more agents"):
        agent_shards([0, 1, 2], "3/4", hostname="x")


def test_the_agent_hosts_its_slice_of_the_shards(agent_cli):
    assert agent_cli.built_with(["--shards", "0-9", "--slice", "1/3"])["shards"] == [4, 5, 6]
    assert agent_cli.built_with(["--shards", "0-9"])["shards"] == list(range(10))


def test_the_slice_comes_from_the_environment_and_auto_from_the_host_name(agent_cli, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "device-agents-1")
    monkeypatch.setenv("SFL_SLICE", "auto/2")
    assert agent_cli.built_with(["--shards", "0-9"])["shards"] == [5, 6, 7, 8, 9]
    assert agent_cli.built_with(["--shards", "0-9", "--slice", "0/2"])["shards"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("argv,message", [
    (["--shards", "0-9", "--slice", "2/2"], "--slice 2/2: INDEX 2 is not below COUNT 2 (agents 0 to 1)"),
    (["--shards", "0-1", "--slice", "2/3"], "--slice 2/3: agent 2 of 3 gets none of the 2 shards"),
    (["--shards", "0-9", "--slice", "two/3"], "bad --slice 'two/3'"),
])
def test_a_bad_slice_is_a_usage_error(agent_cli, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        agent_cli.built_with(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("error:") == 1 and err.endswith("\n")


def test_a_slice_is_not_for_data_devices(agent_cli, capsys, tmp_path):
    import numpy as np

    np.savez(tmp_path / "site.npz", x=np.zeros((4, 2), dtype=np.float32), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(SystemExit) as exit_:
        agent_cli.built_with(["--data", str(tmp_path / "site.npz"), "--slice", "0/2"])
    assert exit_.value.code == 2 and "--slice takes a block of --shards" in capsys.readouterr().err


def test_an_indexed_jobs_completion_index_is_the_automatic_index():
    """A Kubernetes Indexed Job's pod: its JOB_COMPLETION_INDEX, whatever its host name."""
    job = {"JOB_COMPLETION_INDEX": "1"}
    assert parse_slice("auto/2", hostname="device-agents-1-x7k2p", environ=job) == (1, 2)
    assert agent_shards(list(range(10)), "auto/2", hostname="laptop", environ=job) == [5, 6, 7, 8, 9]
    assert parse_slice("0/2", hostname="x", environ=job) == (0, 2)   # a given INDEX is kept
    with pytest.raises(ValueError, match="INDEX 2 is not below COUNT 2"):
        parse_slice("auto/2", hostname="x", environ={"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ValueError, match="is not an index"):
        parse_slice("auto/2", hostname="x", environ={"JOB_COMPLETION_INDEX": "one"})
