"""(b) Tensor encode/decode throughput of the wire format (shared/wire.py), msgpack vs JSON.

encode = ``pack_body({"fx": encode_tensor(t)})`` (what a device does before sending activations:
its client writes the body's pieces to the socket as they are); encode+join =
``packb({"fx": encode_tensor(t)})``, the same body joined into one ``bytes``, as a server answers;
decode = ``decode_tensor(unpackb(body)["fx"])`` (zero-copy view plus the finiteness check every
receiving service makes); decode+schema adds the pydantic ``WireTensor`` validation the HTTP
layer runs on every tensor before decoding it. JSON = ``json.dumps(t.tolist())`` /
``torch.tensor(json.loads(...))``, the naive alternative, for the small sizes only.
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from shared.schemas import WireTensor
from shared.wire import decode_tensor, encode_tensor, pack_body, packb, unpackb

#: (label, shape): float32 tensors of about 4 KB, 256 KB, 1.6 MB and 16 MB.
SIZES: list[tuple[str, tuple[int, ...]]] = [
    ("4 KB", (1024,)),
    ("256 KB", (64, 1024)),
    ("1.6 MB", (64, 32, 14, 14)),   # cnn activations after block 1 at batch 64
    ("16 MB", (4, 1024, 1024)),
]


def _time_per_call(fn: Callable[[], object], budget_s: float, min_calls: int = 3) -> float:
    """Median seconds per call over batches of calls that together take about ``budget_s``."""
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(budget_s / 5 / one))
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < min_calls or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t0) / per_batch)
        if len(samples) >= 50:
            break
    return statistics.median(samples)


def run(quick: bool, log: Callable[[str], None] = print) -> dict:
    budget = 0.15 if quick else 1.0
    json_sizes = {"4 KB"} if quick else {"4 KB", "256 KB"}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, shape in SIZES:
        t = torch.randn(*shape, generator=gen)
        nbytes = t.numel() * t.element_size()
        body = packb({"fx": encode_tensor(t)})
        enc_s = _time_per_call(lambda: pack_body({"fx": encode_tensor(t)}), budget)
        enc_join_s = _time_per_call(lambda: packb({"fx": encode_tensor(t)}), budget)
        dec_s = _time_per_call(lambda: decode_tensor(unpackb(body)["fx"]), budget)
        dec_schema_s = _time_per_call(lambda: decode_tensor(WireTensor.model_validate(unpackb(body)["fx"])), budget)
        assert torch.equal(decode_tensor(unpackb(body)["fx"]), t)
        row = {
            "size": label, "shape": list(shape), "tensor_bytes": nbytes, "body_bytes": len(body),
            "encode_ms": enc_s * 1e3, "encode_join_ms": enc_join_s * 1e3, "decode_ms": dec_s * 1e3,
            "decode_schema_ms": dec_schema_s * 1e3,
            "encode_MBps": nbytes / enc_s / 1e6, "encode_join_MBps": nbytes / enc_join_s / 1e6,
            "decode_MBps": nbytes / dec_s / 1e6,
            "decode_schema_MBps": nbytes / dec_schema_s / 1e6,
        }
        if label in json_sizes:
            text = json.dumps(t.tolist())
            jenc_s = _time_per_call(lambda: json.dumps(t.tolist()), budget)
            jdec_s = _time_per_call(lambda: torch.tensor(json.loads(text), dtype=torch.float32), budget)
            row.update({"json_body_bytes": len(text), "json_encode_MBps": nbytes / jenc_s / 1e6,
                        "json_decode_MBps": nbytes / jdec_s / 1e6})
        rows.append(row)
        log(f"  wire {label:>7}: encode {row['encode_MBps']:9.0f} MB/s (joined {row['encode_join_MBps']:.0f}), "
            f"decode {row['decode_MBps']:9.0f} MB/s")
    return {"method": "median over batches of calls, ~%.2fs per measurement, one thread" % budget, "sizes": rows}
