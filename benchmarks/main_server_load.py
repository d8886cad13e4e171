"""(c) Main Server step latency and throughput with 10, 50 and 100 virtual devices.

A real Main Server process (one torch thread, as in the testbed) is driven directly over HTTP, as
the Fed Server and the devices would: a RoundPlan for the cnn with every participant cut at split
point 2 (server portion = fc1 + head), balanced grouping with group size 5, then every virtual
device joins concurrently and sends ``steps`` steps of activations ``[32, 64, 7, 7]`` (401 KB
float32) with labels, each waiting for its dfx (the group's per-step barrier) before the next.

The virtual devices are coroutines in the benchmark process, each with its own keep-alive
connection (:class:`DeviceConnection`, as each real device has its own); on a 2-core machine this load
generator competes with the server for CPU, so the figures are a lower bound of what the Main
Server alone can do. Each row records the CPU seconds of both sides (``client_cpu_s``,
``server_cpu_s``, of which ``server_event_loop_cpu_s`` on the servers' event-loop threads), the
servers' minor page faults a step (``server_minor_faults_per_step``, the event loops' part beside
it: on these VMs a fault costs several microseconds, mostly the host backing the page) and the
throughput against the compute limits (:func:`_against_limits`). Latency = send to decoded answer as a device
sees it (includes waiting at the barrier for the group's other members); steps/s = device steps
answered per second of wall time; MB/s = request + response body bytes per second.
The finished groups' uploads go to a stand-in for the Fed Server (``benchmarks/bare_http.py``, its
own process on the load generator's cores), which reads each one and acknowledges it, so that an
upload costs the Main Server one delivered POST, as in a run (sent to a closed port, each would
fail and be retried with backoff, partly into the next population's steps).

Replicas (``replicas`` > 1, docs/deployment.md "Main Server replicas"): that many Main Server
processes; the benchmark forms the groups from the label counts and spreads them over the
replicas as the Fed Server does (``form_round_groups``, ``groups_per_replica``), posts each replica its
plan with its groups, and each virtual device talks to its group's replica. With one replica the
Main Server groups the joins itself, as in a one-replica run.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from benchmarks.fedavg_overhead import fields_cpu_seconds, stat_fields
from main_server.group_trainer import GroupTrainer, MemberBatch
from shared.machine import proc_status_kib
from shared.config import TrainConfig
from shared.models import build_model
from shared.portions import portion_state
from shared.http_client import HEADERS
from fed_server.replica_planning import groups_per_replica
from shared.algorithms.grouping import BalancedGrouping, form_round_groups, candidates_from_counts
from shared.schemas import JoinRequest, Participant, PlannedGroup, RoundPlan, StepRequest, WireTensor
from shared.wire import Body, decode_tensor, encode_state, encode_tensor, pack_body, packb, unpackb
from testbed.processes import ProcessGroup, free_port, wait_healthy

SPLIT = 2
BATCH = 32
NUM_CLASSES = 10
GROUP_SIZE = 5


def gpu_name(torch_device: str) -> str | None:
    """The GPU's name for a ``cuda[:N]`` device (as the benchmark process sees it), else None."""
    if not torch_device.startswith("cuda"):
        return None
    return torch.cuda.get_device_name(torch.device(torch_device))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _plans(urls: list[str], run_id: str, round_id: int, ids: list[str], steps: int,
           label_counts: dict[str, list[int]]) -> tuple[dict[str, RoundPlan], dict[str, str]]:
    """Each replica's plan, and each device's replica: one replica groups the joins itself; several
    get the groups formed and spread the Fed Server's way (``fed_server.replica_planning.ReplicaPlanning.plans``)."""
    model = build_model("cnn", NUM_CLASSES, (1, 28, 28), seed=0)
    weights = encode_state(portion_state(model, SPLIT, len(model.blocks)))

    def plan(members: list[str], groups: list[PlannedGroup] | None) -> RoundPlan:
        return RoundPlan(
            run_id=run_id, round_id=round_id, round_index=round_id, model="cnn", num_classes=NUM_CLASSES, input_shape=[1, 28, 28], seed=0,
            participants=[Participant(device_id=d, split_point=SPLIT, num_samples=BATCH * steps) for d in members],
            server_weights=weights, train=TrainConfig(lr=0.05, batch_size=BATCH), grouping="balanced",
            group_size=GROUP_SIZE, group_loss="per_member", join_deadline_s=300.0, step_deadline_s=300.0, groups=groups)
    if len(urls) == 1:
        return {urls[0]: plan(ids, None)}, {d: urls[0] for d in ids}
    groups = form_round_groups(BalancedGrouping(), candidates_from_counts(label_counts, SPLIT), GROUP_SIZE, 0, round_id)
    # Every device has the same sample count here, so a group's load is its size.
    spread = [(url, mine) for url, mine in zip(urls, groups_per_replica(groups, [len(g) for g in groups], len(urls)))
              if mine]
    plans = {url: plan(sorted(m for members in mine.values() for m in members),
                       [PlannedGroup(group_id=g, members=members) for g, members in mine.items()])
             for url, mine in spread}
    return plans, {m: url for url, mine in spread for members in mine.values() for m in members}


@dataclass(frozen=True)
class ServerCounters:
    """A Main Server's counters at one moment, from one read of ``/proc/<pid>/stat`` and one of its
    main thread's: CPU seconds (user + system) and minor page faults, of the whole process and of
    the main thread, uvicorn's event loop, which parses, checks and answers every request (the
    training workers are other threads). A page fault is a page the kernel mapped in on first
    touch, a few microseconds of the server's CPU that its allocator's reuse of freed memory
    would have saved. All 0 when the process is gone."""

    cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    faults: int = 0
    loop_faults: int = 0

    @classmethod
    def read(cls, pid: int) -> ServerCounters:
        process, loop = stat_fields(pid), stat_fields(pid, thread=True)
        if process is None or loop is None:
            return cls()
        return cls(fields_cpu_seconds(process), fields_cpu_seconds(loop), int(process[7]), int(loop[7]))


class CpuMeter:
    """CPU seconds used from its creation to :meth:`read` by this process (the load generator) and
    by the processes ``pids`` (the Main Servers), to tell the client's share of the cores from
    the servers', and the servers' event loops' part of theirs; and the servers' page faults."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.client0 = time.process_time()
        self.start = [ServerCounters.read(pid) for pid in pids]

    def _since_start(self) -> list[tuple[ServerCounters, ServerCounters]]:
        return [(ServerCounters.read(pid), start) for pid, start in zip(self.pids, self.start)]

    def faults(self) -> tuple[int, int]:
        """(the Main Servers' minor page faults summed, their event loops' part) since creation."""
        pairs = self._since_start()
        return (sum(now.faults - start.faults for now, start in pairs),
                sum(now.loop_faults - start.loop_faults for now, start in pairs))

    def read(self) -> tuple[float, float, float]:
        """(client CPU seconds, Main Servers' CPU seconds summed, their event loops' part) since creation."""
        pairs = self._since_start()
        return (time.process_time() - self.client0, sum(now.cpu_s - start.cpu_s for now, start in pairs),
                sum(now.loop_cpu_s - start.loop_cpu_s for now, start in pairs))


def _latency_figures(latencies: dict[int, list[float]]) -> dict:
    """Percentiles of every step's latency, and of the steps after each device's first apart.

    A device's first step of the round waits for its whole group to send theirs, and 100 devices
    that joined together send their first steps at once, so the first steps queue behind each
    other: their latency is the round's start-up, not the steady state. Both figures are kept
    (no data is dropped); ``first_step_*`` shows the start-up alone.
    """
    every = [v for values in latencies.values() for v in values]
    later = [v for step, values in latencies.items() if step > 0 for v in values]
    out = {f"latency_p{q}_ms": 1e3 * _percentile(every, q) for q in (50, 95, 99)}
    out["latency_max_ms"] = 1e3 * max(every)
    out["latency_p99_over_p50"] = out["latency_p99_ms"] / out["latency_p50_ms"]
    out.update({f"later_steps_latency_p{q}_ms": 1e3 * _percentile(later, q) for q in (50, 95, 99)})
    out["later_steps_latency_p99_over_p50"] = out["later_steps_latency_p99_ms"] / out["later_steps_latency_p50_ms"]
    out["first_step_latency_p50_ms"] = 1e3 * _percentile(latencies[0], 50)
    out["first_step_latency_max_ms"] = 1e3 * max(latencies[0])
    return out


def group_step_inputs(torch_device: str = "cpu") -> tuple[GroupTrainer, list[MemberBatch]]:
    """A group's trainer of the cnn's server portion (split 2) and GROUP_SIZE members' batches:
    one group step of (c), to run in-process."""
    model = build_model("cnn", NUM_CLASSES, (1, 28, 28), seed=0)
    trainer = GroupTrainer(model, SPLIT, portion_state(model, SPLIT, len(model.blocks)), lr=0.05,
                           device=torch.device(torch_device))
    gen = torch.Generator().manual_seed(0)
    batches = [MemberBatch(f"m{i}", SPLIT, torch.randn(BATCH, 64, 7, 7, generator=gen),
                           torch.randint(0, NUM_CLASSES, (BATCH,), generator=gen)) for i in range(GROUP_SIZE)]
    return trainer, batches


def measure_group_step_s(torch_device: str, repeats: int = 30) -> float:
    """Median seconds of one group step (``GroupTrainer.step`` of GROUP_SIZE members' batches) in
    this process, on this machine, with this process's torch threads: the Main Server's pure
    compute per group step, without HTTP, decoding or contention, for the compute limit.

    On the CPU it is the thread's CPU time (one torch thread computes in the calling thread), so
    other jobs taking the cores do not inflate it (wall time gave 23 and 42 ms a minute apart at a
    load average of 5 to 10); on a GPU, the wall time of the synchronized step.
    """
    trainer, batches = group_step_inputs(torch_device)
    on_cpu = torch_device == "cpu"
    clock = time.thread_time if on_cpu else time.perf_counter
    times = []
    for i in range(repeats + 5):   # the first few warm the allocator up
        t0 = clock()
        trainer.step(batches)
        if not on_cpu and torch_device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 5:
            times.append(clock() - t0)
    return float(np.median(times))


class _AnswerReader(asyncio.BufferedProtocol):
    """The reading side of a :class:`DeviceConnection`: the event loop receives each answer's head
    into a small buffer and its body straight into a buffer of its Content-Length (``recv_into``),
    with no copy in between (asyncio's StreamReader appended every chunk to its buffer and
    ``readexactly`` copied the body out of it again: two copies of 401 KB a step)."""

    HEAD_BYTES = 4096

    def __init__(self) -> None:
        self.head = bytearray(self.HEAD_BYTES)
        self.head_len = 0
        self.answer: tuple[int, dict[str, str]] | None = None
        self.body = bytearray()
        self.body_len = 0
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def expect(self) -> asyncio.Future:
        """A future for the next answer: (status, lower-case headers, body)."""
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.answer is None:
            return memoryview(self.head)[self.head_len:]
        return memoryview(self.body)[self.body_len:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.answer is not None:
            self.body_len += nbytes
        else:
            self.head_len += nbytes
            end = self.head.find(b"\r\n\r\n", 0, self.head_len)
            if end < 0:
                if self.head_len == len(self.head):
                    self._fail(RuntimeError(f"an answer head longer than {self.HEAD_BYTES} bytes"))
                return
            status_line, *lines = self.head[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "content-length" not in headers:
                self._fail(RuntimeError(f"an answer without a Content-Length ({status_line})"))
                return
            self.answer = int(status_line.split(" ", 2)[1]), headers
            self.body = bytearray(int(headers["content-length"]))
            early = self.head[end + 4:self.head_len]   # the body's start came with the head
            if len(early) > len(self.body):
                self._fail(RuntimeError("more bytes than the answer's Content-Length"))
                return
            self.body[:len(early)] = early
            self.body_len, self.head_len = len(early), 0
        if self.body_len == len(self.body) and self.waiter is not None and not self.waiter.done():
            (status, headers), body = self.answer, self.body
            self.answer, self.body, self.body_len = None, bytearray(), 0
            self.waiter.set_result((status, headers, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("the Main Server closed the connection"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class DeviceConnection:
    """One virtual device's keep-alive HTTP/1.1 connection to its Main Server: each request's head
    and msgpack body are written as they are, and the answer is read by its Content-Length
    (:class:`_AnswerReader`).

    The load generator shares the cores with the server, so its own cost per step is taken from
    the server's figure. One pooled httpx client for all devices cost it 20 ms of CPU a step at 100
    devices (httpcore scans every pooled connection and queued request on each request's state
    change); an httpx client per device still 4.7 ms (h11 parses and buffers the 401 KB bodies in
    Python), three quarters of what the Main Server spent on the step (measured 2026-11-24;
    benchmarks/README.md, "(c) Main Server step latency and throughput"). This speaks only what the Main Server answers (uvicorn sends a Content-Length
    with every response) and fails loudly on anything else.
    """

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"{url}: the benchmark speaks plain http to a host:port")
        self.host, self.port = parts.hostname, parts.port
        self.transport: asyncio.Transport | None = None
        self.reader: _AnswerReader | None = None

    async def post(self, path: str, body: Body) -> tuple[int, bytearray]:
        """POST a msgpack ``body`` (:func:`shared.wire.pack_body`'s pieces, as a device's client
        sends it) to ``path``; (status, answer body)."""
        if self.transport is None or self.transport.is_closing():
            self.transport, self.reader = await asyncio.get_running_loop().create_connection(
                _AnswerReader, self.host, self.port)
        assert self.reader is not None
        answer = self.reader.expect()
        fields = {"host": f"{self.host}:{self.port}", **HEADERS, "content-length": str(len(body))}
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        # Piece by piece: the transport sends each at once (what the socket does not take it
        # buffers until it can), where writelines would join them first, copying the activation
        # (Python 3.11). The answer comes after the whole body, so waiting for it waits for the send.
        self.transport.write(head.encode("latin-1"))
        for piece in body:
            self.transport.write(piece)
        status, headers, content = await answer
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, content

    async def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = self.reader = None


async def _drive(urls: list[str], pids: list[int], run_id: str, round_id: int, devices: int, steps: int,
                 seed: int) -> dict:
    ids = [f"vdev-{i:03d}" for i in range(devices)]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    fx = {d: torch.randn(BATCH, 64, 7, 7, generator=gen) for d in ids}
    labels = {d: torch.randint(0, NUM_CLASSES, (BATCH,), generator=gen) for d in ids}
    label_counts = {d: ((rng.dirichlet([0.5] * NUM_CLASSES) * BATCH * steps).astype(int) + 1).tolist() for d in ids}
    plans, replica_of = _plans(urls, run_id, round_id, ids, steps, label_counts)
    async with httpx.AsyncClient(headers=HEADERS, timeout=600.0) as fed:
        for url, plan in plans.items():
            resp = await fed.post(f"{url}/v1/rounds", content=packb(plan.model_dump()))
            resp.raise_for_status()
    # One connection per virtual device, as each real device holds its own (DeviceConnection).
    connections = {d: DeviceConnection(replica_of[d]) for d in ids}
    try:
        async def join(d: str) -> None:
            body = JoinRequest(device_id=d, label_counts=label_counts[d], num_steps=steps).model_dump()
            status, content = await connections[d].post(f"/v1/rounds/{round_id}/join", pack_body(body))
            if status != 200:
                raise RuntimeError(f"{d} join: HTTP {status}: {content[:300]!r}")

        t_join = time.perf_counter()
        await asyncio.gather(*(join(d) for d in ids))
        join_s = time.perf_counter() - t_join

        latencies: dict[int, list[float]] = {step: [] for step in range(steps)}
        server_s: list[float] = []
        moved = [0]

        async def device(d: str) -> None:
            fx_wire = WireTensor(**encode_tensor(fx[d]))
            labels_wire = WireTensor(**encode_tensor(labels[d]))
            for step in range(steps):
                t0 = time.perf_counter()
                body = pack_body(StepRequest(device_id=d, step=step, fx=fx_wire, labels=labels_wire).model_dump())
                status, content = await connections[d].post(f"/v1/rounds/{round_id}/step", body)
                if status != 200:
                    raise RuntimeError(f"{d} step {step}: HTTP {status}: {content[:300]!r}")
                answer = unpackb(content)
                decode_tensor(answer["dfx"], expect_shape=(BATCH, 64, 7, 7))
                latencies[step].append(time.perf_counter() - t0)
                server_s.append(float(answer["server_s"]))
                moved[0] += len(body) + len(content)

        cpu = CpuMeter(pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(device(d) for d in ids))
        wall = time.perf_counter() - t0
        client_cpu_s, server_cpu_s, loop_cpu_s = cpu.read()
        server_faults, loop_faults = cpu.faults()
    finally:
        await asyncio.gather(*(c.close() for c in connections.values()))
    total_steps = devices * steps
    return {
        "devices": devices, "replicas": len(plans), "groups": -(-devices // GROUP_SIZE), "steps_per_device": steps,
        "device_steps": total_steps, "wall_s": wall, "join_all_s": join_s, **_latency_figures(latencies),
        "client_cpu_s": client_cpu_s, "server_cpu_s": server_cpu_s, "server_event_loop_cpu_s": loop_cpu_s,
        "client_cpu_ms_per_step": 1e3 * client_cpu_s / total_steps,
        "server_cpu_ms_per_step": 1e3 * server_cpu_s / total_steps,
        "server_event_loop_cpu_ms_per_step": 1e3 * loop_cpu_s / total_steps,
        "server_minor_faults_per_step": server_faults / total_steps,
        "server_event_loop_minor_faults_per_step": loop_faults / total_steps,
        "server_step_p50_ms": 1e3 * _percentile(server_s, 50),
        "device_steps_per_s": total_steps / wall, "group_steps_per_s": -(-devices // GROUP_SIZE) * steps / wall,
        "MB_per_s": moved[0] / wall / 1e6, "MB_moved": moved[0] / 1e6,
    }


def _against_limits(row: dict, group_step_s: float, cores: int, client_cores: int) -> dict:
    """A row's throughput against the Main Server's compute limit (benchmark (c); goal: at least 0.80): each
    of the server's ``cores`` trains group steps back to back, ``cores * GROUP_SIZE /
    group_step_s`` device steps a second, with the group step timed in-process (pure compute).
    The CPU shares are the Main Servers' CPU seconds over the wall time times their cores, and the
    load generator's over the wall time times its cores (the same cores when they share them).
    """
    limit = cores * GROUP_SIZE / group_step_s
    return {
        "compute_limit_steps_per_s": limit, "fraction_of_compute_limit": row["device_steps_per_s"] / limit,
        "server_cpu_share_of_cores": row["server_cpu_s"] / (row["wall_s"] * cores),
        "client_cpu_share_of_cores": row["client_cpu_s"] / (row["wall_s"] * client_cores),
    }


def split_cores(server_cores: int | None) -> tuple[set[int], set[int]]:
    """The cores the Main Servers run on and the cores the load generator runs on.

    None: both share every usable core, the load generator's CPU taken from the server's limit.
    N: the first N usable cores for the Main Servers and the rest for the load generator, as when
    the devices are machines of their own; the limit then counts the N cores. At least one core
    must be left to each side."""
    usable = sorted(os.sched_getaffinity(0))
    if server_cores is None:
        return set(usable), set(usable)
    if not 1 <= server_cores < len(usable):
        raise ValueError(f"--server-cores must leave at least one of the {len(usable)} usable cores to each side "
                         f"(1 to {len(usable) - 1}), got {server_cores}")
    return set(usable[:server_cores]), set(usable[server_cores:])


def run(quick: bool, log: Callable[[str], None] = print, torch_device: str = "cpu",
        replica_counts: tuple[int, ...] = (1,), server_cores: int | None = None) -> dict:
    """Drive Main Server processes (computing on ``torch_device``, their ``--torch-device``) with
    each population in turn, once per replica count in ``replica_counts`` (the devices' groups
    spread over that many processes); the figures and the setup, device included, as a
    JSON-friendly dict. Populations: 10, 50, 100 devices for one replica; 100 for more.
    ``server_cores``: see :func:`split_cores` (None: server and load generator share the cores)."""
    steps = 5 if quick else 20
    server_set, client_set = split_cores(server_cores)
    cores = len(server_set)
    own_affinity = os.sched_getaffinity(0)
    group_step_s = float("nan")
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-main-"))
    group = ProcessGroup(root / "logs")
    rows = []
    peak = None
    try:
        ports: list[int] = []
        while len(ports) < 1 + max(replica_counts):   # the last one is the Fed Server stand-in's
            port = free_port()
            if port not in ports:
                ports.append(port)
        fed_port = ports.pop()
        fed_url = f"http://127.0.0.1:{fed_port}"
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        # A child inherits the affinity of the thread that starts it: the Main Servers get their
        # cores from birth (so their own count of usable cores, and their training workers, say
        # the same), then this process moves to the load generator's cores.
        os.sched_setaffinity(0, server_set)
        mains = [group.start(f"main_server-{i}", "main_server", [
            "--fed-server-url", fed_url, "--port", str(port), "--log-level", "WARNING",
            "--torch-device", torch_device]) for i, port in enumerate(ports)]
        os.sched_setaffinity(0, client_set)
        fed = group.start("fed_server_stand_in", "benchmarks.bare_http", ["--port", str(fed_port)])
        for url, service in [*zip(urls, mains), (fed_url, fed)]:
            wait_healthy(url, service, timeout=120)
        pids = [main.process.pid for main in mains]
        step_before = measure_group_step_s(torch_device)
        log(f"  one group step in-process ({GROUP_SIZE} x {BATCH} samples, one torch thread): "
            f"{1e3 * step_before:.1f} ms")
        round_id = 0
        for replicas in replica_counts:
            populations = [10] if quick else ([10, 50, 100] if replicas == 1 else [100])
            for n in populations:
                round_id += 1   # a new round at every replica: each replaces the one before
                load = os.getloadavg()[0]
                row = asyncio.run(_drive(urls[:replicas], pids[:replicas], "bench", round_id, n, steps, seed=round_id))
                row.update(load_average_1min=[load, os.getloadavg()[0]])
                rows.append(row)
                log(f"  main server x{replicas} {n:>3} devices: p50 {row['latency_p50_ms']:7.1f} ms, "
                    f"p95 {row['latency_p95_ms']:7.1f} ms, p99 {row['latency_p99_ms']:7.1f} ms, "
                    f"{row['device_steps_per_s']:6.1f} steps/s, CPU ms a step: client {row['client_cpu_ms_per_step']:.2f}, "
                    f"server {row['server_cpu_ms_per_step']:.2f} (event loop {row['server_event_loop_cpu_ms_per_step']:.2f}); "
                    f"server page faults a step {row['server_minor_faults_per_step']:.0f} "
                    f"(event loop {row['server_event_loop_minor_faults_per_step']:.0f})")
        # The yardstick is timed again after the load, and the limit takes the faster of the two
        # (the higher limit, the lower fraction): single timings before the load read up to 25 %
        # slower than others minutes apart (measured 2026-11-25).
        step_after = measure_group_step_s(torch_device)
        group_step_s = min(step_before, step_after)
        for row in rows:
            row.update(_against_limits(row, group_step_s, cores, len(client_set)))
        log(f"  one group step in-process after the load: {1e3 * step_after:.1f} ms; the limit uses "
            f"{1e3 * group_step_s:.1f} ms: " + ", ".join(f"{r['devices']} devices {r['fraction_of_compute_limit']:.2f}"
                                                        for r in rows) + " of it")
        peak = proc_status_kib(mains[0].process.pid, "VmHWM")
    finally:
        os.sched_setaffinity(0, own_affinity)
        group.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "setup": {"model": "cnn", "split_point": SPLIT, "fx_shape": [BATCH, 64, 7, 7],
                  "fx_bytes": BATCH * 64 * 7 * 7 * 4, "group_size": GROUP_SIZE, "grouping": "balanced",
                  "torch_device": torch_device, "gpu": gpu_name(torch_device),
                  "client": "one keep-alive HTTP/1.1 connection per virtual device (DeviceConnection), all in "
                            "the benchmark process's event loop",
                  "server_cores": sorted(server_set), "client_cores": sorted(client_set),
                  "cores_shared": server_set == client_set,
                  "fed_server": "a stand-in that reads each upload and answers Ack (benchmarks/bare_http.py), on the "
                                "load generator's cores, its CPU counted in neither",
                  "replicas": "Main Server processes on the same machine; groups spread by spread_groups (LPT)"},
        "group_step_ms_in_process": 1e3 * group_step_s,
        "group_step_ms_in_process_before_and_after_load": [1e3 * step_before, 1e3 * step_after],
        "usable_cores": len(own_affinity), "server_cores": cores,
        "populations": rows,
        "main_server_peak_rss_mib": round(peak / 1024, 1) if peak else None,
    }
