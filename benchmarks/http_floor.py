"""The HTTP floor under benchmark (c): what uvicorn costs per step request when the app does nothing.

uvicorn, run as the services run it (``http_api.serve.head_timeout_protocol``, httptools, uvloop,
no access log), serves a bare ASGI app that reads each request's body into one buffer and answers
a preallocated body of a step answer's size; the (c) load generator's connections
(``DeviceConnection``, one per virtual device) send real step bodies (a msgpack ``StepRequest``
with ``[32, 64, 7, 7]`` float32 activations, 401 KB) and read the answers. No msgpack, no
validation, no tensors, no training on the server. The server's CPU per request is the least any
ASGI app on uvicorn pays for a step on this machine (HTTP parsing, the body's chunks, the socket
reads and writes of 401 KB each way); the client's is the least the load generator pays besides
packing the step and decoding the answer. benchmarks/README.md ("mainserver-lean") compares them
with the Main Server's.

``python -m benchmarks.http_floor [--devices 100] [--requests 20] [--out FILE]``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.main_server_load import BATCH, CpuMeter, DeviceConnection
from shared.machine import describe_machine
from shared.schemas import StepRequest, WireTensor
from shared.wire import encode_tensor, pack_body
from testbed.processes import ProcessGroup, free_port, wait_healthy

FX_SHAPE = (BATCH, 64, 7, 7)
ANSWER_BYTES = 4 * BATCH * 64 * 7 * 7 + 64   # the dfx bytes plus about a step answer's small fields


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


def serve(port: int) -> None:
    """Run the bare app under uvicorn as the services run (http_api.serve.serve's settings)."""
    import uvicorn

    from http_api.serve import head_timeout_protocol
    uvicorn.run(bare_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                http=head_timeout_protocol(10.0), timeout_keep_alive=5)


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
        client_cpu_s, server_cpu_s, _ = cpu.read()
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    n = devices * requests
    return {"devices": devices, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "server_cpu_ms_per_request": 1e3 * server_cpu_s / n, "client_cpu_ms_per_request": 1e3 * client_cpu_s / n,
            "request_bytes": len(body), "answer_bytes": ANSWER_BYTES}


def run(devices: int = 100, requests: int = 20) -> dict:
    """Start the bare server, drive it, stop it; the figures with the load average around them."""
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-floor-"))
    group = ProcessGroup(root / "logs")
    try:
        port = free_port()
        server = group.start("http_floor", "benchmarks.http_floor", ["--serve", str(port)])
        wait_healthy(f"http://127.0.0.1:{port}", server, timeout=60)
        load = os.getloadavg()[0]
        row = asyncio.run(_drive(f"http://127.0.0.1:{port}", server.process.pid, devices, requests))
        row["load_average_1min"] = [load, os.getloadavg()[0]]
        return row
    finally:
        group.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--requests", type=int, default=20, help="requests per device")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)   # the server process
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)   # one torch thread, as in (c)
    row = run(args.devices, args.requests)
    print(f"bare uvicorn, {row['devices']} connections: {row['requests_per_s']:.0f} requests/s, CPU ms a request: "
          f"server {row['server_cpu_ms_per_request']:.3f}, client {row['client_cpu_ms_per_request']:.3f} "
          f"(load {row['load_average_1min'][0]:.2f} -> {row['load_average_1min'][1]:.2f})")
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": describe_machine(), "http_floor": row}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
