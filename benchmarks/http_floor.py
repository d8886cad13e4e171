"""The HTTP floor under benchmark (c): what a server costs per step request when the app does nothing.

Two servers, each in its own process, under the (c) load generator's connections
(``DeviceConnection``, one per virtual device), which send real step bodies (a msgpack
``StepRequest`` with ``[32, 64, 7, 7]`` float32 activations, 401 KB) and read the answers:

- ``uvicorn``: uvicorn as the services run it (``http_api.serve.head_timeout_protocol``,
  httptools, uvloop, no access log) serving a bare ASGI app that reads each request's body into
  one buffer and answers a preallocated body of a step answer's size;
- ``asyncio``: no HTTP server at all, the least Python can do per request: an asyncio
  ``BufferedProtocol`` on uvloop (``benchmarks.bare_http.BareProtocol``) that receives each
  request's head into a buffer and its body straight into a buffer of its Content-Length, and
  writes the same answer. It checks nothing: a yardstick for what an HTTP server of our own could
  save, not a server.

No msgpack, no validation, no tensors, no training in either. The server's CPU per request (and
its event loop's, the main thread) is the least any app on that server pays for a step on this
machine: the socket reads and writes of 401 KB each way, and for uvicorn its parsing, its copies
of each chunk and its ASGI messages. The client's is the least the load generator pays besides
packing the step and decoding the answer. ``--training-thread`` runs the Main Server's training
(``GroupTrainer.step`` of a group of 5 on the cnn, back to back) in a thread of the server's
process, to see whether training beside the event loop raises the event loop's CPU per request
(with ``--server-cores 1`` the two share one core, as in (c) with ``--server-cores 1``).
benchmarks/README.md ("The HTTP floor") compares the figures with the Main Server's.

``python -m benchmarks.http_floor [--servers uvicorn,asyncio] [--training-thread] [--server-cores N]
[--devices 100] [--requests 20] [--repeats 1] [--name NAME] [--out FILE]`` writes the rows as JSON
(``benchmarks/results/<UTC date>_http-floor/results.json`` by default).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks import bare_http
from benchmarks.main_server_load import BATCH, CpuMeter, DeviceConnection, group_step_inputs, split_cores
from benchmarks.result_files import add_name_option, default_out, write_json
from shared.machine import describe_machine
from shared.schemas import StepRequest, WireTensor
from shared.wire import encode_tensor, pack_body
from testbed.processes import ProcessGroup, free_port, wait_healthy

FX_SHAPE = (BATCH, 64, 7, 7)
ANSWER_BYTES = 4 * BATCH * 64 * 7 * 7 + 64   # the dfx bytes plus about a step answer's small fields
SERVERS = ("uvicorn", "asyncio")


async def bare_app(scope, receive, send) -> None:
    """Read the body into one buffer, answer ANSWER_BYTES; any path, any method (``/healthz`` too)."""
    if scope["type"] != "http":
        return
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/msgpack"), (b"content-length", str(ANSWER_BYTES).encode())]})
    await send({"type": "http.response.body", "body": _ANSWER})


_ANSWER = bytes(ANSWER_BYTES)


def train_beside() -> None:
    """The Main Server's training, back to back, in this thread (as (c)'s training worker runs)."""
    trainer, batches = group_step_inputs()
    while True:
        trainer.step(batches)


def serve(server: str, port: int, training_thread: bool) -> None:
    """Run one of the bare servers in this process (uvicorn with http_api.serve.serve's settings)."""
    torch.set_num_threads(1)
    if training_thread:
        threading.Thread(target=train_beside, daemon=True, name="training").start()
    if server == "uvicorn":
        import uvicorn

        from http_api.serve import head_timeout_protocol
        uvicorn.run(bare_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                    http=head_timeout_protocol(10.0), timeout_keep_alive=5)
        return
    bare_http.run(port, bare_http.http_answer(_ANSWER))


async def _drive(url: str, pid: int, devices: int, requests: int) -> dict:
    fx = torch.randn(*FX_SHAPE, generator=torch.Generator().manual_seed(0))
    body = pack_body(StepRequest(device_id="vdev-000", step=0, fx=WireTensor(**encode_tensor(fx)),
                                 labels=WireTensor(**encode_tensor(torch.zeros(BATCH, dtype=torch.int64)))).model_dump())
    connections = [DeviceConnection(url) for _ in range(devices)]

    async def device(connection: DeviceConnection, n: int) -> None:
        for _ in range(n):
            status, content = await connection.post("/v1/rounds/1/step", body)
            if status != 200 or len(content) != ANSWER_BYTES:
                raise RuntimeError(f"HTTP {status}, {len(content)} bytes")

    try:
        await asyncio.gather(*(device(c, 2) for c in connections))   # connections open, allocator warm
        cpu = CpuMeter([pid])
        t0 = time.perf_counter()
        await asyncio.gather(*(device(c, requests) for c in connections))
        wall = time.perf_counter() - t0
        client_cpu_s, server_cpu_s, loop_cpu_s = cpu.read()
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    n = devices * requests
    return {"devices": devices, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "server_cpu_ms_per_request": 1e3 * server_cpu_s / n,
            "server_event_loop_cpu_ms_per_request": 1e3 * loop_cpu_s / n,
            "client_cpu_ms_per_request": 1e3 * client_cpu_s / n,
            "request_bytes": len(body), "answer_bytes": ANSWER_BYTES}


def run(server: str = "uvicorn", devices: int = 100, requests: int = 20, training_thread: bool = False,
        server_cores: int | None = None) -> dict:
    """Start one bare server (on its cores), drive it from the other cores, stop it; the figures
    with the load average around them."""
    server_set, client_set = split_cores(server_cores)
    own_affinity = os.sched_getaffinity(0)
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-floor-"))
    group = ProcessGroup(root / "logs")
    try:
        port = free_port()
        os.sched_setaffinity(0, server_set)   # the child is born on the server's cores
        process = group.start("http_floor", "benchmarks.http_floor",
                              ["--serve", server, "--port", str(port)] + (["--training-thread"] if training_thread else []))
        os.sched_setaffinity(0, client_set)
        wait_healthy(f"http://127.0.0.1:{port}", process, timeout=60)
        load = os.getloadavg()[0]
        row = asyncio.run(_drive(f"http://127.0.0.1:{port}", process.process.pid, devices, requests))
        row.update(server=server, training_thread=training_thread, server_cores=sorted(server_set),
                   client_cores=sorted(client_set), load_average_1min=[load, os.getloadavg()[0]])
        return row
    finally:
        os.sched_setaffinity(0, own_affinity)
        group.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="uvicorn",
                        help=f"comma-separated, run in turn: {', '.join(SERVERS)} (default uvicorn)")
    parser.add_argument("--training-thread", action="store_true",
                        help="train the Main Server's group steps back to back in a thread of the server's process")
    parser.add_argument("--server-cores", type=int, default=None,
                        help="the server on the first N usable cores, the load generator on the rest (default: shared)")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20, help="requests per device")
    parser.add_argument("--repeats", type=int, default=1, help="run the servers in turn this many times (interleaved)")
    add_name_option(parser, "http-floor")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default benchmarks/results/<UTC date>_<name>/results.json)")
    parser.add_argument("--serve", choices=SERVERS, default=None, help=argparse.SUPPRESS)   # the server process
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.port, args.training_thread)
        return 0
    servers = args.servers.split(",")
    if not servers or any(s not in SERVERS for s in servers):
        parser.error(f"--servers: a comma-separated list of {', '.join(SERVERS)}, got {args.servers!r}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)   # one torch thread, as in (c)
    rows = []
    for _ in range(args.repeats):
        for server in servers:
            row = run(server, args.devices, args.requests, args.training_thread, args.server_cores)
            rows.append(row)
            print(f"bare {server}{' beside training' if args.training_thread else ''}, {row['devices']} connections: "
                  f"{row['requests_per_s']:.0f} requests/s, CPU ms a request: server {row['server_cpu_ms_per_request']:.3f} "
                  f"(event loop {row['server_event_loop_cpu_ms_per_request']:.3f}), client "
                  f"{row['client_cpu_ms_per_request']:.3f} (load {row['load_average_1min'][0]:.2f} -> "
                  f"{row['load_average_1min'][1]:.2f})", flush=True)
    machine = describe_machine()
    out = write_json({"machine": machine, "http_floor": rows}, args.out or default_out(machine["date_utc"], args.name))
    print(f"results: {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
