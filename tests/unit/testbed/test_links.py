"""The real-links network's pure parts (names, subnet, shaping, commands, refusals) and how the
testbed wires it: which agents start where, with what, and the network removed at the end. Nothing
here makes a namespace (tests/integration/test_real_links.py does)."""
from __future__ import annotations

import ipaddress
import os
from types import SimpleNamespace

import pytest

import testbed.__main__ as cli
import testbed.links as links
import testbed.runner as runner
from shared.config import RunConfig
from shared.profiles import RATES
from testbed.links import (MAX_AGENTS, MAX_IFNAME, WIRE_BYTES_PER_PAYLOAD, LinksNetwork, agent_commands, host_problem,
                           leftovers, link_names, owner_of, pick_subnet, plan_links, rate_commands, removal_commands,
                           tbf_args)
from testbed.config_check import CheckResult, check
from testbed.processes import ProcessGroup
from testbed.runner import Testbed, TestbedError

MAX_PID = 4194303   # the kernel's largest pid_max less one


def test_names_carry_their_owner_and_fit_an_interface_name():
    bridge, agents = link_names(MAX_PID, 9, MAX_AGENTS)
    assert all(len(name) <= MAX_IFNAME for name in [bridge, *(port for _, port in agents)])
    names = [bridge, *(n for pair in agents for n in pair)]
    assert len(set(names)) == len(names)
    assert {owner_of(name) for name in names} == {(MAX_PID, 9)}
    assert owner_of("eth0") is None and owner_of("sflx-0b") is None
    # Two testbeds (two processes, or two networks of one) never share a name.
    assert not set(names) & {n for pair in link_names(MAX_PID - 1, 9, 3)[1] for n in pair}
    assert link_names(MAX_PID, 8, 1)[0] != bridge


def test_too_many_devices_or_too_long_names_are_refused():
    with pytest.raises(TestbedError, match=f"at most {MAX_AGENTS} devices"):
        link_names(1, 0, MAX_AGENTS + 1)
    with pytest.raises(TestbedError, match="longer than 15 characters"):
        link_names(MAX_PID, 10, MAX_AGENTS)


def test_leftovers_are_the_networks_of_processes_that_are_gone():
    names = ["sfl1f-0b", "sfl1f-0v0", "sfl1f-0n0", "sfl2a-1b", "eth0", "sflbr"]
    assert leftovers(names, alive=lambda pid: pid == 0x2a) == ["sfl1f-0b", "sfl1f-0v0", "sfl1f-0n0"]
    assert leftovers(names, alive=lambda pid: pid == os.getpid()) == names[:4]


def test_the_subnet_overlaps_nothing_the_machine_uses():
    taken = [ipaddress.IPv4Network("10.88.0.0/16"), ipaddress.IPv4Network("10.89.0.0/24")]
    start = 88 * 256   # 10.88.0.0/24, the first of the taken /16
    assert pick_subnet(taken, start) == ipaddress.IPv4Network("10.89.1.0/24")
    assert pick_subnet([], 65535) == ipaddress.IPv4Network("10.255.255.0/24")
    assert pick_subnet([ipaddress.IPv4Network("10.255.255.0/24")], 65535) == ipaddress.IPv4Network("10.0.0.0/24")
    with pytest.raises(TestbedError, match="every /24 of 10.0.0.0/8 overlaps"):
        pick_subnet([ipaddress.IPv4Network("10.0.0.0/8")], 0)


def test_plan_puts_the_service_address_on_the_bridge_and_the_agents_after_it():
    bridge, agents = link_names(0x1f, 0, 3)
    plan = plan_links(bridge, agents, ipaddress.IPv4Network("10.7.8.0/24"), [1e6, 2e6, 5e6])
    assert plan.service_address == "10.7.8.1"
    assert [(a.namespace, a.port, a.address, a.rate) for a in plan.agents] == [
        ("sfl1f-0n0", "sfl1f-0v0", "10.7.8.2", 1e6), ("sfl1f-0n1", "sfl1f-0v1", "10.7.8.3", 2e6),
        ("sfl1f-0n2", "sfl1f-0v2", "10.7.8.4", 5e6)]


def test_tbf_shapes_the_payload_rate_with_a_small_burst_and_a_deep_queue():
    args = tbf_args(20e6)
    assert args[:2] == ["tbf", "rate"]
    values = dict(zip(args[1::2], args[2::2]))
    assert values["rate"] == f"{round(20e6 * WIRE_BYTES_PER_PAYLOAD * 8)}bit"
    assert int(values["burst"]) == round(20e6 * WIRE_BYTES_PER_PAYLOAD * 0.002)   # 2 ms of the rate
    assert int(values["limit"]) == round(20e6 * WIRE_BYTES_PER_PAYLOAD)          # 1 s of it
    slow = dict(zip(tbf_args(1e5)[1::2], tbf_args(1e5)[2::2]))
    assert int(slow["burst"]) == 4 * 1514 and int(slow["limit"]) == 8 << 20       # the floors
    for rate in (0, -1.0, float("nan")):
        with pytest.raises(TestbedError, match="rate must be > 0"):
            tbf_args(rate)


def test_each_agent_is_shaped_both_ways_and_removal_takes_ports_before_bridges():
    bridge, agents = link_names(0x1f, 0, 1)
    plan = plan_links(bridge, agents, ipaddress.IPv4Network("10.7.8.0/24"), [2e6])
    commands = agent_commands(plan, plan.agents[0])
    assert commands[0] == ["ip", "netns", "add", "sfl1f-0n0"]
    shaping = tbf_args(2e6)
    assert ["tc", "qdisc", "replace", "dev", "sfl1f-0v0", "root", *shaping] in commands              # download
    assert ["tc", "-n", "sfl1f-0n0", "qdisc", "replace", "dev", "eth0", "root", *shaping] in commands  # upload
    assert ["ip", "link", "set", "sfl1f-0v0", "master", "sfl1f-0b"] in commands
    assert ["ip", "-n", "sfl1f-0n0", "addr", "add", "10.7.8.2/24", "dev", "eth0"] in commands
    assert removal_commands(["sfl1f-0b", "sfl1f-0v0", "sfl1f-0v1"], ["sfl1f-0n0"]) == [
        ["ip", "link", "del", "sfl1f-0v0"], ["ip", "link", "del", "sfl1f-0v1"], ["ip", "link", "del", "sfl1f-0b"],
        ["ip", "netns", "del", "sfl1f-0n0"]]


def test_hosts_that_cannot_make_real_links_are_refused_in_one_line():
    found = {"ip": "/usr/sbin/ip", "tc": "/usr/sbin/tc"}.get
    assert host_problem("linux", 0, found) is None
    assert host_problem("darwin", 0, found) == "real links need Linux network namespaces; this is darwin"
    assert "run the testbed as root" in host_problem("linux", 1000, found)
    assert host_problem("linux", 0, {"ip": "/usr/sbin/ip"}.get).endswith("missing: tc")
    assert host_problem("linux", 0, lambda tool: None).endswith("missing: ip, tc")


def test_a_failed_command_is_one_line_naming_what_could_not_be_made():
    with pytest.raises(TestbedError, match=r"^real links: `false` failed: exit code 1$"):
        links._run(["false"])
    assert links._failure(["ip", "netns", "add", "sfl1f-0n0"], "Operation not permitted") == (
        "real links: could not create network namespace sfl1f-0n0: Operation not permitted")


# --- the testbed's wiring ----------------------------------------------------------------------


def _alive() -> SimpleNamespace:
    """A child that stays up, as far as the testbed asks."""
    return SimpleNamespace(returncode=None, poll=lambda: None, wait=lambda timeout=None: 0, send_signal=lambda sig: None)


def _config(**devices) -> RunConfig:
    return RunConfig.model_validate({"algorithm": "s2fl", "data": {"num_devices": 4},
                                     "devices": {"profiles": ["low", "mid", "high"], "time_scale": 20.0, **devices}})


@pytest.fixture
def started(monkeypatch):
    """Every child a testbed starts, as (prefix, module, args) by name, none of them run; the real-links
    network planned on 10.7.8.0/24 but not made, and whether it was removed."""
    children: dict[str, tuple[list[str], str, list[str]]] = {}
    removed: list[bool] = []

    def spawn(group, name, module, args, env):
        children[name] = ([], module, list(args))
        return _alive()

    def exec_(group, name, module, args, env, prefix):
        children[name] = (list(prefix), module, list(args))
        return _alive()

    def create(network):
        bridge, agents = link_names(os.getpid(), 0, len(network.rates))
        network.plan = plan_links(bridge, agents, ipaddress.IPv4Network("10.7.8.0/24"), network.rates)
        return network.plan

    monkeypatch.setattr(ProcessGroup, "_spawn", spawn)
    monkeypatch.setattr(ProcessGroup, "_exec", exec_)
    monkeypatch.setattr(LinksNetwork, "create", create)
    monkeypatch.setattr(LinksNetwork, "remove", lambda network: removed.append(True))
    monkeypatch.setattr(runner, "check_host", lambda: None)
    monkeypatch.setattr(runner, "wait_healthy", lambda *args, **kwargs: None)
    ports = iter(range(20000, 20100))
    monkeypatch.setattr(runner, "free_port", lambda host: next(ports))
    return children, removed


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_real_links_start_one_agent_per_device_in_its_namespace_on_its_shaped_link(tmp_path, started):
    children, removed = started
    testbed = Testbed(_config(), tmp_path, agents=2, main_servers=1, real_links=True, rtt_ms=5)
    assert testbed.network is not None
    assert testbed.network.rates == [RATES["low"] * 20, RATES["mid"] * 20, RATES["high"] * 20, RATES["low"] * 20]
    testbed.start()
    testbed.stop(agent_grace_s=0)
    assert removed == [True]
    for server in ("fed_server", "main_server"):
        prefix, _, args = children[server]
        assert prefix == [] and _flag(args, "--host") == "10.7.8.1"
    assert testbed.fed_url == "http://10.7.8.1:20000" and testbed.main_urls == ["http://10.7.8.1:20001"]
    for i, kind in enumerate(["low", "mid", "high", "low"]):
        prefix, module, args = children[f"agent-{i}"]
        assert prefix == ["ip", "netns", "exec", f"sfl{os.getpid():x}-0n{i}"] and module == "device_agent"
        assert (_flag(args, "--shards"), _flag(args, "--kinds"), _flag(args, "--links")) == (str(i), kind, "real")
        assert _flag(args, "--request-delay-ms") == "5" and _flag(args, "--fed-server-url") == testbed.fed_url
    assert "agent-4" not in children


def test_the_emulated_twin_has_the_same_agents_on_loopback_started_afresh(tmp_path, started):
    children, removed = started
    testbed = Testbed(_config(), tmp_path, main_servers=1, agent_per_device=True, rtt_ms=5)
    assert testbed.network is None and testbed.fed_url.startswith("http://127.0.0.1:")
    testbed.start()
    testbed.stop(agent_grace_s=0)
    assert removed == []
    for i, kind in enumerate(["low", "mid", "high", "low"]):
        prefix, _, args = children[f"agent-{i}"]
        assert prefix == [] and (_flag(args, "--shards"), _flag(args, "--kinds")) == (str(i), kind)
        assert _flag(args, "--links") is None and _flag(args, "--request-delay-ms") == "5"
    # The default layout is unchanged: shared agents, every kind, no request delay.
    shared = Testbed(_config(), tmp_path / "shared", agents=2, main_servers=1)
    shared.start()
    shared.stop(agent_grace_s=0)
    args = children["agent-0"][2]
    assert (_flag(args, "--shards"), _flag(args, "--kinds"), _flag(args, "--request-delay-ms")) == (
        "0-1", "low,mid,high", None)


def test_the_network_is_removed_when_the_start_fails(tmp_path, started):
    _, removed = started
    testbed = Testbed(_config(), tmp_path, main_servers=1, real_links=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt   # Ctrl-C, or SIGTERM turned into it, while the agents start

    testbed.start_agent = interrupted
    with pytest.raises(KeyboardInterrupt):
        with testbed:
            pass
    assert removed == [True]


@pytest.mark.parametrize("config, kwargs, message", [
    (_config(time_scale="auto"), {}, "must be a number here, not auto"),
    (_config(profiles=[]), {}, "devices.profiles must name kinds"),
    (RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]}}),
     {"device_data": ["a.npz"]}, "not --device-data"),
    (_config(), {"rtt_ms": -1.0}, "rtt -1.0 ms"),
])
def test_real_links_refuse_what_they_cannot_shape_in_one_line(tmp_path, config, kwargs, message):
    with pytest.raises(TestbedError, match=message):
        Testbed(config, tmp_path, main_servers=1, real_links=True, **kwargs)


def test_the_command_line_passes_the_layout_and_refuses_shared_agents_with_it(tmp_path, monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def fake_testbed(config, run_dir, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(cli, "Testbed", fake_testbed)
    monkeypatch.setattr(cli, "check_in_child", lambda request: CheckResult.model_validate_json(
        check(request).model_dump_json()))
    with pytest.raises(Stop):
        cli.main(["--real-links", "--rtt-ms", "3", "--set", "devices.time_scale=2", "--run-dir", str(tmp_path)])
    assert (seen["real_links"], seen["agent_per_device"], seen["rtt_ms"]) == (True, False, 3.0)
    with pytest.raises(Stop):
        cli.main(["--agent-per-device", "--run-dir", str(tmp_path)])
    assert (seen["real_links"], seen["agent_per_device"], seen["rtt_ms"]) == (False, True, 0.0)
    for flag in ("--real-links", "--agent-per-device"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([flag, "--agents", "2"])
        assert exit_.value.code == 2


def test_a_link_is_reshaped_both_ways_in_place_and_the_plan_says_its_new_rate(monkeypatch):
    bridge, agents = link_names(0x1f, 0, 2)
    plan = plan_links(bridge, agents, ipaddress.IPv4Network("10.7.8.0/24"), [2e6, 4e6])
    shaping = tbf_args(2e5)
    assert rate_commands(plan.agents[0], 2e5) == [
        ["tc", "qdisc", "replace", "dev", "sfl1f-0v0", "root", *shaping],
        ["tc", "-n", "sfl1f-0n0", "qdisc", "replace", "dev", "eth0", "root", *shaping]]
    assert all(command in agent_commands(plan, plan.agents[1]) for command in rate_commands(plan.agents[1], 4e6))
    ran = []
    monkeypatch.setattr(links, "_run", ran.append)
    network = LinksNetwork([2e6, 4e6])
    network.plan = plan
    network.set_rate(0, 2e5)
    assert ran == rate_commands(plan.agents[0], 2e5)
    assert [a.rate for a in network.plan.agents] == [2e5, 4e6]
    with pytest.raises(TestbedError, match="rate must be > 0"):
        network.set_rate(1, 0.0)
    assert [a.rate for a in network.plan.agents] == [2e5, 4e6]
