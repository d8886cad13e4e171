"""docs/builtin-data.md#test-vectors cannot go stale: the shard sizes, first-batch digests,
``shards_sha256`` and the default run's fingerprint digest on the page are recomputed here, the
first batch's bytes laid out as the page says, and ``python -m shared.data.vectors`` prints them."""
from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import numpy as np
import torch

from shared.config import RunConfig
from shared.data import device_shard, load_dataset
from shared.data.vectors import FIRST_BATCH, batch_sha256, main, shard_vectors, shards_sha256
from shared.models import model_fingerprint
from shared.run_config import build_config_model

PAGE = Path(__file__).resolve().parents[4] / "docs" / "builtin-data.md"
DEFAULT = RunConfig()


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("## Test vectors")
    return text[start:text.index("\n## ", start + 1)]


def _published() -> tuple[list[tuple[int, str]], str, str]:
    """(size, first-batch sha256) per shard, ``shards_sha256`` and the fingerprint digest, as on the page."""
    section = _section()
    rows = [(int(size.replace(",", "")), digest) for _, size, digest in
            re.findall(r"^\| (\d+) \| ([\d,]+) \| `([0-9a-f]{64})` \|$", section, re.M)]
    shards = re.search(r"for the default run it is\s+`([0-9a-f]{64})`", section)
    digest = re.search(r"has the digest\s+`([0-9a-f]{64})`", section)
    assert shards and digest, "the page must give shards_sha256 and the fingerprint's digest"
    return rows, shards.group(1), digest.group(1)


def test_the_page_gives_the_default_runs_vectors():
    rows, shards, digest = _published()
    vectors = shard_vectors(DEFAULT.data)
    assert len(rows) == DEFAULT.data.num_devices == 10
    assert rows == [(v.size, v.first_batch_sha256) for v in vectors]
    assert shards == shards_sha256(vectors)
    fingerprint = model_fingerprint(build_config_model(DEFAULT), DEFAULT.data)
    assert fingerprint.data is not None and fingerprint.data.shards_sha256 == shards
    assert fingerprint.digest == digest == hashlib.sha256(fingerprint.canonical_json().encode()).hexdigest()


def test_the_first_batch_is_the_shards_first_samples_as_little_endian_float32_then_int64():
    train, _ = load_dataset(DEFAULT.data)
    shard = device_shard(DEFAULT.data, train, 3)
    x, y = shard.x[:FIRST_BATCH].numpy(), shard.y[:FIRST_BATCH].numpy()
    assert x.shape == (32, 1, 28, 28)
    raw = struct.pack(f"<{x.size}f", *x.reshape(-1).tolist()) + struct.pack(f"<{y.size}q", *y.tolist())
    assert shard_vectors(DEFAULT.data)[3].first_batch_sha256 == hashlib.sha256(raw).hexdigest()
    # The layout, on two numbers and one label.
    expected = hashlib.sha256(bytes.fromhex("0000803f") + bytes.fromhex("000020c0") + (7).to_bytes(8, "little"))
    assert batch_sha256(torch.tensor([[1.0, -2.5]]), torch.tensor([7])) == expected.hexdigest()
    assert batch_sha256(torch.tensor([[1.0, -2.5]], dtype=torch.float64), torch.tensor([7], dtype=torch.int32)) \
        == expected.hexdigest()


def test_a_shard_smaller_than_a_batch_is_hashed_whole():
    spec = DEFAULT.data.model_copy(update={"max_samples": 40, "num_devices": 4, "partition": "iid"})
    vectors = shard_vectors(spec)
    train, _ = load_dataset(spec)
    shard = device_shard(spec, train, 0)
    assert [v.size for v in vectors] == [10, 10, 10, 10]
    assert vectors[0].first_batch_sha256 == batch_sha256(shard.x, shard.y)
    assert np.all(np.diff([v.size for v in vectors]) == 0)


def test_the_command_prints_the_pages_numbers(capsys):
    main([])
    out = capsys.readouterr().out
    rows, shards, digest = _published()
    for shard, (size, first) in enumerate(rows):
        assert re.search(rf"^\s*{shard}\s+{size}\s+{first}$", out, re.M)
    assert f"shards_sha256: {shards}" in out and f"digest {digest}" in out
    main(["--set", "data.seed=1", "--json"])
    other = capsys.readouterr().out
    assert f"shards_sha256: {shards}" not in other and '"seed":1' in other.splitlines()[-1]
