"""Test vectors of a built-in data set's pipeline: each shard's size and the sha256 of its first
batch, as this process derives them from the run's ``data`` settings.

The model fingerprint carries their digest (``shared.models.fingerprint``), so a device whose
pipeline gives other samples than the Fed Server's (another version of this code, of numpy or of
the data file, or other settings) is refused at registration; docs/builtin-data.md publishes the
default run's vectors, so a device written in another language can check itself against them
(docs/builtin-data.md#test-vectors says exactly what is hashed).

    python -m shared.data.vectors                               # the default run's vectors and fingerprint
    python -m shared.data.vectors --set data.alpha=0.1 --json   # another run, with the fingerprint's JSON form
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from shared.data.datasets import dataset_input_shape, load_dataset
from shared.data.partition import device_shards
from shared.data.spec import DataSpec

__all__ = ["FIRST_BATCH", "ShardVector", "batch_sha256", "canonical_json", "shard_vectors", "shards_sha256"]

#: Samples in a shard's "first batch": the first 32 of the shard in its order (the default
#: ``train.batch_size``, whatever the run's batch size is), or the whole shard when it is smaller.
FIRST_BATCH = 32


class ShardVector(BaseModel):
    """One shard's test vector: its size and the sha256 (hex) of its first batch (:func:`batch_sha256`)."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=0)
    first_batch_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def canonical_json(value: Any) -> str:
    """The JSON form digests are computed over: keys sorted, no spaces (``","`` and ``":"``),
    non-ASCII escaped (``\\uXXXX``), floats as Python writes them (the shortest decimal that reads
    back to the same double, always with a ``.`` or an exponent: ``1.0``, ``0.5``, ``1e-05``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def batch_sha256(x: torch.Tensor, y: torch.Tensor) -> str:
    """sha256 (hex) of the inputs ``x`` as float32 little-endian bytes in C order (row-major over
    ``[B, *input_shape]``), followed by the labels ``y`` as int64 little-endian bytes."""
    inputs = x.detach().cpu().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    labels = y.detach().cpu().to(torch.int64).contiguous().numpy().astype("<i8", copy=False)
    return hashlib.sha256(inputs.tobytes() + labels.tobytes()).hexdigest()


# The digest of one spec's vectors is computed once per process: an agent hosting many virtual
# devices fingerprints each of them, and the threads may ask at the same time.
_LOCK = threading.Lock()
_DIGESTS: dict[str, str] = {}


def shard_vectors(spec: DataSpec) -> list[ShardVector]:
    """Every shard's :class:`ShardVector` under ``spec`` (a built-in data set): each shard exactly
    as a device derives it (``device_shard``, here ``device_shards``: normalisation, public set, ``max_samples``,
    partition, per-device transform), its first :data:`FIRST_BATCH` samples hashed."""
    if spec.dataset == "local":
        raise ValueError("dataset='local' has no shards: every device brings its own data")
    train, _ = load_dataset(spec)
    return [ShardVector(size=len(s), first_batch_sha256=batch_sha256(s.x[:FIRST_BATCH], s.y[:FIRST_BATCH]))
            for s in device_shards(spec, train)]


def shards_sha256(vectors: list[ShardVector]) -> str:
    """sha256 (hex) of the vectors in shard order as canonical JSON: ``[{"first_batch_sha256":
    "...","size":N},...]``."""
    return hashlib.sha256(canonical_json([v.model_dump(mode="json") for v in vectors]).encode()).hexdigest()


def spec_shards_sha256(spec: DataSpec) -> str:
    """``shards_sha256(shard_vectors(spec))``, computed once per process and spec: what every
    device's fingerprint carries, so that fingerprinting N devices costs N times the model, not
    N times the shards (O(N^2) for a population of one device per shard)."""
    key = spec.model_dump_json()
    with _LOCK:   # held while computing: concurrent first calls compute once
        digest = _DIGESTS.get(key)
        if digest is None:
            digest = _DIGESTS[key] = shards_sha256(shard_vectors(spec))
    return digest


def main(argv: list[str] | None = None) -> None:
    """Print a run's test vectors (the default run unless ``--config``/``--set`` say otherwise)
    and its model fingerprint's digest."""
    from shared.models import model_fingerprint
    from shared.run_config import ConfigError, build_config_model, exit_on_config_error, resolve_run_config

    parser = argparse.ArgumentParser(prog="python -m shared.data.vectors",
                                     description="Print each shard's size and first-batch sha256 and the model "
                                                 "fingerprint's digest for a run of a built-in data set "
                                                 "(docs/builtin-data.md#test-vectors).")
    parser.add_argument("--config", help="a run configuration file (YAML or JSON); default: the default run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set data.alpha=0.1 (repeatable)")
    parser.add_argument("--json", action="store_true",
                        help="also print the fingerprint's canonical JSON, the text its digest is the sha256 of")
    args = parser.parse_args(argv)
    try:
        config = resolve_run_config(args.config, args.overrides)
    except ConfigError as exc:
        exit_on_config_error(exc)
    spec = config.data
    if spec.dataset == "local":
        print("dataset 'local' has no shards to derive: test vectors are for the built-in data sets", file=sys.stderr)
        sys.exit(2)
    vectors = shard_vectors(spec)
    fingerprint = model_fingerprint(build_config_model(config), spec, config.train.loss, config.train.resolved_task)
    print(f"data: {spec.dataset}, transform {spec.transform}, partition {spec.partition} (alpha {spec.alpha}), "
          f"{spec.num_devices} shards, seed {spec.seed}, max_samples {spec.max_samples}, "
          f"public_samples {spec.public_samples}, device_transform {spec.device_transform} "
          f"{canonical_json(spec.device_transform_params)}")
    shape = ", ".join(map(str, dataset_input_shape(spec)))
    print(f"first batch: the shard's first min({FIRST_BATCH}, size) samples; x float32 little-endian "
          f"[B, {shape}], then y int64 little-endian [B]")
    print("shard  size  first batch sha256")
    for i, v in enumerate(vectors):
        print(f"{i:5d} {v.size:5d}  {v.first_batch_sha256}")
    print(f"shards_sha256: {shards_sha256(vectors)}")
    print(f"fingerprint of model {config.model!r}: digest {fingerprint.digest}")
    if args.json:
        print(fingerprint.canonical_json())


if __name__ == "__main__":
    main()
