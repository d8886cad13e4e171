"""Real shaped links for the local testbed: each device agent in its own network namespace, its link
to the servers shaped with tbf to its kind's rate (``python -m testbed --real-links``,
docs/real-links.md).

Layout of one testbed's network:

- a bridge in the root namespace carrying the **service address**, ``.1`` of a private /24 in
  10.0.0.0/8 that overlaps no address or route of this machine (the servers listen there only);
- per agent a network namespace and a veth pair: the agent's end (``eth0``, address ``.2``,
  ``.3``, ...) in the namespace, the other end a port of the bridge;
- tbf on both ends: the namespace end's egress is the device's upload, the bridge port's egress
  its download, each at the device's rate in bytes/s (the testbed passes its kind's rate times
  ``devices.time_scale``).

Names carry their owner: ``sfl<pid in hex>-<seq><role><index>`` (role ``b`` the bridge, ``v`` a
bridge port, ``n`` a namespace; ``seq`` tells apart the networks one process holds at once), at
most 15 characters as Linux wants for interface names. Two testbeds (pytest-xdist workers) never
share names, and a leftover whose process is gone (a testbed killed with SIGKILL) is recognised
by its name and removed by the next real-links start or by ``python -m testbed.links clean``.

Shaping choices (:func:`tbf_args`): a message's first ``burst`` bytes pass at once (the bucket
fills while the link is idle), so the burst is kept at 2 ms of the rate (at least a few full
frames, which tbf needs to pass a frame at all): a message gets through at most 2 ms early, and
the qdisc wakes at most about 500 times a second per link. The queue limit is large (1 s of the
rate, at least 8 MiB): a frame dropped at the bridge port is a real loss, repaired by a TCP
retransmission after 200 ms or more, which would be measured as transfer time; the sending socket's
own queue (TCP Small Queues) keeps what waits in the qdisc far below that limit. tbf counts whole
frames, headers included, so the rate it is given is the device's rate times
:data:`WIRE_BYTES_PER_PAYLOAD`: the bytes of a message, not of its frames, arrive at the device's
rate, as the emulated transfer (``bytes / rate``) assumes. The kernel may lack netem (so no
latency here): a round-trip delay is the agents' ``--request-delay-ms``, added per request.

The agents cannot be forked from the testbed's warm starter: a forked child would have to enter
its namespace itself, and Python 3.11 has no ``os.setns``; they are started with
``ip netns exec <namespace> <python> -m device_agent ...`` (:meth:`LinksNetwork.exec_prefix`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.errors import TestbedError

#: Linux's longest interface name (IFNAMSIZ less the terminating zero).
MAX_IFNAME = 15
#: The namespace end of every agent's veth pair (a name only has to be unique inside its namespace).
AGENT_IFNAME = "eth0"
#: Agents per network: the /24 holds the bridge at .1 and agents at .2 to .254.
MAX_AGENTS = 253
#: Frame bytes per message byte of a full TCP segment: 1514 (a 1500-byte MTU frame with its
#: Ethernet header, which tbf counts) per 1448 bytes of payload (IP, TCP and timestamp option headers).
WIRE_BYTES_PER_PAYLOAD = 1514 / 1448
#: tbf's bucket: this many seconds of the rate, and at least a few full frames.
BURST_S = 0.002
MIN_BURST = 4 * 1514
#: tbf's queue: this many seconds of the rate, and at least MIN_LIMIT bytes.
LIMIT_S = 1.0
MIN_LIMIT = 8 << 20
#: Where the /24s are looked for (10.0.0.0/8 minus what this machine already uses).
SUBNET_SPACE = ipaddress.IPv4Network("10.0.0.0/8")
#: Held while a testbed cleans leftovers and picks and claims its /24, so two starting at once pick two.
LOCK_PATH = Path("/run/sfl-testbed-links.lock")

_NAME = re.compile(r"^sfl(?P<pid>[0-9a-f]+)-(?P<seq>\d+)(?P<role>[bvn])(?P<index>\d*)$")
_HELD: set[int] = set()   # the seqs this process's networks hold
_HELD_LOCK = threading.Lock()


@dataclass(frozen=True)
class AgentLink:
    """One agent's end of the network: its namespace, its bridge port, its address and rate."""

    namespace: str
    port: str          # the veth end on the bridge, in the root namespace
    address: str       # the agent's address inside its namespace
    rate: float        # bytes/s, both ways


@dataclass(frozen=True)
class LinkPlan:
    """Everything one testbed's network is made of (:func:`plan_links`)."""

    bridge: str
    subnet: ipaddress.IPv4Network
    agents: tuple[AgentLink, ...]

    @property
    def service_address(self) -> str:
        """The bridge's address, where the servers listen."""
        return str(self.subnet.network_address + 1)


def link_names(pid: int, seq: int, count: int) -> tuple[str, list[tuple[str, str]]]:
    """The bridge's name and each agent's (namespace, bridge port) names for network ``seq`` of
    process ``pid``; TestbedError when they would not fit in an interface name."""
    if count > MAX_AGENTS:
        raise TestbedError(f"real links: at most {MAX_AGENTS} devices (one /24), got {count}")
    base = f"sfl{pid:x}-{seq}"
    bridge = base + "b"
    agents = [(f"{base}n{i}", f"{base}v{i}") for i in range(count)]
    longest = max([bridge, *(port for _, port in agents)], key=len)
    if len(longest) > MAX_IFNAME:
        raise TestbedError(f"real links: interface name {longest!r} is longer than {MAX_IFNAME} characters")
    return bridge, agents


def pick_subnet(taken: Iterable[ipaddress.IPv4Network], start: int) -> ipaddress.IPv4Network:
    """The first /24 of :data:`SUBNET_SPACE`, from the ``start``-th on (wrapping), that overlaps
    none of ``taken``; TestbedError when there is none."""
    taken = list(taken)
    count = SUBNET_SPACE.num_addresses // 256
    first = int(SUBNET_SPACE.network_address)
    for i in range(count):
        candidate = ipaddress.IPv4Network((first + ((start + i) % count) * 256, 24))
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise TestbedError(f"real links: every /24 of {SUBNET_SPACE} overlaps an address or route of this machine")


def plan_links(bridge: str, agents: Sequence[tuple[str, str]], subnet: ipaddress.IPv4Network,
               rates: Sequence[float]) -> LinkPlan:
    """The plan of a network with the names of :func:`link_names`, one agent per rate."""
    hosts = subnet.network_address
    return LinkPlan(bridge, subnet, tuple(AgentLink(ns, port, str(hosts + 2 + i), rate)
                                          for i, ((ns, port), rate) in enumerate(zip(agents, rates, strict=True))))


def tbf_args(rate: float) -> list[str]:
    """``tc qdisc ... root`` arguments shaping to ``rate`` bytes/s of message payload (the
    module's docstring says why the burst is small and the limit large)."""
    if not rate > 0:
        raise TestbedError(f"real links: a link's rate must be > 0 bytes/s, got {rate}")
    wire = rate * WIRE_BYTES_PER_PAYLOAD
    burst = max(MIN_BURST, round(wire * BURST_S))
    limit = max(MIN_LIMIT, round(wire * LIMIT_S))
    return ["tbf", "rate", f"{round(wire * 8)}bit", "burst", str(burst), "limit", str(limit)]


def bridge_commands(plan: LinkPlan) -> list[list[str]]:
    """Commands making the bridge with the service address."""
    return [["ip", "link", "add", plan.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{plan.service_address}/{plan.subnet.prefixlen}", "dev", plan.bridge],
            ["ip", "link", "set", plan.bridge, "up"]]


def agent_commands(plan: LinkPlan, link: AgentLink) -> list[list[str]]:
    """Commands making one agent's namespace, its veth pair on the bridge and the shaping of
    both directions (the first one, the namespace, is the one that fails where namespaces cannot be made)."""
    ns = link.namespace
    return [["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "link", "add", link.port, "type", "veth", "peer", "name", AGENT_IFNAME, "netns", ns],
            ["ip", "link", "set", link.port, "master", plan.bridge],
            ["ip", "-n", ns, "addr", "add", f"{link.address}/{plan.subnet.prefixlen}", "dev", AGENT_IFNAME],
            *rate_commands(link, link.rate),
            ["ip", "link", "set", link.port, "up"],
            ["ip", "-n", ns, "link", "set", AGENT_IFNAME, "up"]]


def rate_commands(link: AgentLink, rate: float) -> list[list[str]]:
    """Commands reshaping both directions of one agent's link to ``rate`` bytes/s (the qdiscs
    :func:`agent_commands` made, replaced in place: the link stays up, a message in flight goes on
    at the new rate)."""
    shaping = tbf_args(rate)
    return [["tc", "qdisc", "replace", "dev", link.port, "root", *shaping],                   # download
            ["tc", "-n", link.namespace, "qdisc", "replace", "dev", AGENT_IFNAME, "root", *shaping]]   # upload


def removal_commands(links: Iterable[str], namespaces: Iterable[str]) -> list[list[str]]:
    """Commands removing testbed links (bridge ports first: a veth end takes its peer along; the
    bridges once they have no ports) and namespaces."""
    ordered = sorted(links, key=lambda name: name.endswith("b"))   # the bridges' role letter ends their names
    return [*(["ip", "link", "del", name] for name in ordered), *(["ip", "netns", "del", ns] for ns in namespaces)]


def owner_of(name: str) -> tuple[int, int] | None:
    """(pid, seq) of the testbed network a link or namespace name belongs to; None for other names."""
    match = _NAME.match(name)
    return (int(match["pid"], 16), int(match["seq"])) if match else None


def leftovers(names: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """The names of testbed networks whose process is no longer alive."""
    return [name for name in names if (owner := owner_of(name)) is not None and not alive(owner[0])]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine's process table)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_problem(platform: str, euid: int, which: Callable[[str], str | None]) -> str | None:
    """Why real links cannot be made on this host (one line), or None."""
    if platform != "linux":
        return f"real links need Linux network namespaces; this is {platform}"
    if euid != 0:
        return "real links create network namespaces and shape links with tc: run the testbed as root"
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        return f"real links need iproute2's ip and tc on PATH; missing: {', '.join(missing)}"
    return None


def problem_here() -> str | None:
    """:func:`host_problem` of this machine and process."""
    return host_problem(sys.platform, os.geteuid() if hasattr(os, "geteuid") else -1, shutil.which)


def check_host() -> None:
    """TestbedError with :func:`host_problem`'s line when real links cannot be made here."""
    problem = problem_here()
    if problem:
        raise TestbedError(problem)


def _run(command: Sequence[str]) -> str:
    """Run one ``ip``/``tc`` command; its output, or TestbedError with its first error line."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[0]
        raise TestbedError(_failure(command, reason))
    return done.stdout


def _failure(command: Sequence[str], reason: str) -> str:
    """The one line saying that ``command`` failed and why (a namespace that cannot be made by name)."""
    what = (f"could not create network namespace {command[3]}" if list(command[:3]) == ["ip", "netns", "add"]
            else f"`{' '.join(command)}` failed")
    return f"real links: {what}: {reason}"


def _quietly(commands: Iterable[Sequence[str]]) -> None:
    """Run each command, whatever the others did (removal: some of it may already be gone)."""
    for command in commands:
        subprocess.run(list(command), capture_output=True, timeout=30)


def existing_names() -> tuple[list[str], list[str]]:
    """(interfaces, namespaces) on this machine now."""
    links = [entry["ifname"] for entry in json.loads(_run(["ip", "-j", "link", "show"]) or "[]")]
    namespaces = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]
    return links, namespaces


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to (a /24 must clash with none)."""
    nets = []
    for entry in json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]"):
        for info in entry.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]) or "[]"):
        if route.get("dst") not in (None, "default"):
            nets.append(ipaddress.IPv4Network(route["dst"], strict=False))
    return nets


def clean_leftovers() -> list[str]:
    """Remove the networks of testbeds that no longer run, and stop (SIGTERM) their agents still
    running in their namespaces (a namespace lasts as long as a process in it); the names removed."""
    links, namespaces = existing_names()
    stale_links, stale_namespaces = leftovers(links, process_alive), leftovers(namespaces, process_alive)
    for namespace in stale_namespaces:
        for pid in _run(["ip", "netns", "pids", namespace]).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
    _quietly(removal_commands(stale_links, stale_namespaces))
    return stale_links + stale_namespaces


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Held by one testbed at a time on this machine while it claims its names and /24."""
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LinksNetwork:
    """One testbed's real-links network (module docstring): :meth:`create` makes it, :meth:`remove`
    takes it all down again and may be called any number of times, after a partial creation too.
    Used as a context manager, it is removed on leaving the block however that happens."""

    def __init__(self, rates: Sequence[float]) -> None:
        """``rates``: one agent per entry, its link shaped to that many bytes/s both ways."""
        if not rates:
            raise TestbedError("real links: no agents to connect")
        for rate in rates:
            tbf_args(rate)   # a bad rate is refused before anything is made
        self.rates = list(rates)
        self.plan: LinkPlan | None = None
        self._seq: int | None = None

    def create(self) -> LinkPlan:
        """Check the host, remove dead testbeds' leftovers, claim names and a /24 and make it all."""
        check_host()
        try:
            with _machine_lock():
                clean_leftovers()
                links, namespaces = existing_names()
                self._seq = _claim_seq({owner[1] for name in links + namespaces
                                        if (owner := owner_of(name)) and owner[0] == os.getpid()})
                bridge, agents = link_names(os.getpid(), self._seq, len(self.rates))
                subnet = pick_subnet(used_networks(), random.randrange(1 << 16))
                self.plan = plan_links(bridge, agents, subnet, self.rates)
                for command in bridge_commands(self.plan):
                    _run(command)
            for link in self.plan.agents:
                for command in agent_commands(self.plan, link):
                    _run(command)
        except BaseException:
            self.remove()
            raise
        return self.plan

    @property
    def service_address(self) -> str:
        """Where the servers listen (once created)."""
        assert self.plan is not None, "the network is not created"
        return self.plan.service_address

    def exec_prefix(self, index: int) -> list[str]:
        """The command prefix running a program inside agent ``index``'s namespace."""
        assert self.plan is not None, "the network is not created"
        return ["ip", "netns", "exec", self.plan.agents[index].namespace]

    def set_rate(self, index: int, rate: float) -> None:
        """Reshape agent ``index``'s link, both ways, to ``rate`` bytes/s while the run goes on: a
        link that slows down or recovers mid-run (tests/integration/test_link_drop.py)."""
        assert self.plan is not None, "the network is not created"
        link = self.plan.agents[index]
        for command in rate_commands(link, rate):
            _run(command)
        agents = list(self.plan.agents)
        agents[index] = dataclasses.replace(link, rate=rate)
        self.plan = dataclasses.replace(self.plan, agents=tuple(agents))

    def remove(self) -> None:
        """Remove every link and namespace of this network (what is already gone is skipped)."""
        plan, self.plan = self.plan, None
        if plan is not None:
            _quietly(removal_commands([*(a.port for a in plan.agents), plan.bridge],
                                      [a.namespace for a in plan.agents]))
        if self._seq is not None:
            with _HELD_LOCK:
                _HELD.discard(self._seq)
            self._seq = None

    def __enter__(self) -> "LinksNetwork":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _claim_seq(on_machine: set[int]) -> int:
    """The lowest network number neither held by this process nor left on the machine under its pid."""
    with _HELD_LOCK:
        seq = 0
        while seq in _HELD or seq in on_machine:
            seq += 1
        _HELD.add(seq)
        return seq


def main(argv: list[str] | None = None) -> None:
    """``python -m testbed.links list|clean``: show or remove testbed networks left by testbeds that no
    longer run (killed with SIGKILL: a testbed that ends any other way removes its own)."""
    parser = argparse.ArgumentParser(
        prog="python -m testbed.links",
        description="The real-links networks of the local testbed (docs/real-links.md): list every one on this "
                    "machine, or clean those whose testbed no longer runs (names sfl<pid>-...).")
    parser.add_argument("action", choices=["list", "clean"])
    args = parser.parse_args(argv)
    try:
        check_host()
        if args.action == "clean":
            with _machine_lock():
                removed = clean_leftovers()
            print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing left over")
            return
        links, namespaces = existing_names()
        for name in links + namespaces:
            if (owner := owner_of(name)) is not None:
                state = "running" if process_alive(owner[0]) else "left over"
                print(f"{name}  pid {owner[0]}  {state}")
    except TestbedError as exc:
        parser.exit(1, f"{exc}\n")


if __name__ == "__main__":
    main()
