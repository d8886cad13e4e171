"""What an honest-but-curious Fed Server and Main Server kept of a run (``--record-received``,
``shared/recording.py``), read back beside the truth an attack on it would be scored against.

For every recorded step the Main Server kept the activations (and the labels, where it computes the
loss; in U-shaped mode the gradient at the middle's output); the benchmark, not the servers, knows
which samples the step held: a device's batches are reproducible from the run's seed, its shard and
the attempt (``device_agent.trainer.batches`` with ``round_seed``), so each recorded step is matched
with its true inputs and labels. The Fed Server kept the global model each recorded round started
from (what an attacker runs its attacks with) and each device's upload.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from device_agent.trainer import batches, leaves_out_single_samples, round_seed
from shared.config import RunConfig
from shared.data import ArrayDataset, device_shard, load_dataset
from shared.models import SplitModel

_ROUND = re.compile(r"round-(\d+)-attempt-(\d+)")
_STEP = re.compile(r"(?P<device>.+)-step-(?P<step>\d+)-(?P<kind>fx|labels|gradient)\.npy")
_AGENT_SHARD = re.compile(r".*-(\d+)")


@dataclass
class StepRecord:
    """One device step the Main Server recorded, with the samples it really held."""

    device_id: str
    step: int
    split_point: int
    fx: torch.Tensor                  # the activations the Main Server received
    labels: torch.Tensor | None       # the labels it received (plain mode), or None
    gradient: torch.Tensor | None     # the gradient at the middle's output (U-shaped), or None
    x: torch.Tensor                   # the true inputs (the benchmark's knowledge, not the server's)
    y: torch.Tensor                   # the true labels


@dataclass
class RoundRecords:
    """One recorded attempt: what both servers kept of it."""

    round_index: int
    attempt: int
    head_start: int | None
    split_points: dict[str, int]
    joins: dict[str, list[int]]                      # label counts as each device reported them
    true_counts: dict[str, list[int]]                # its real ones
    global_state: dict[str, torch.Tensor] | None     # the model the round started from (Fed Server)
    uploads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)


def shard_of(device_id: str) -> int:
    """The shard of a testbed device (``dev-007`` -> 7)."""
    found = _AGENT_SHARD.fullmatch(device_id)
    if found is None:
        raise ValueError(f"{device_id!r} is not a testbed device of a built-in data set's shard")
    return int(found.group(1))


def _state(path: Path) -> dict[str, torch.Tensor]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: torch.from_numpy(archive[name].copy()) for name in archive.files}


def read_records(folder: Path, config: RunConfig, model: SplitModel) -> list[RoundRecords]:
    """Every attempt the servers recorded under ``folder`` (the ``--record-received`` folder),
    oldest first, each step matched with its true samples (``model``: the run's, for whether a
    device's epoch leaves a batch of one out)."""
    train, _ = load_dataset(config.data)
    shards: dict[int, ArrayDataset] = {}
    rounds: list[RoundRecords] = []
    main_folder, fed_folder = folder / "main_server", folder / "fed_server"
    for round_folder in sorted(main_folder.glob("round-*")):
        found = _ROUND.fullmatch(round_folder.name)
        if found is None:
            continue
        index, attempt = int(found.group(1)), int(found.group(2))
        plan = json.loads((round_folder / "plan.json").read_text())
        joins = {p.name.removesuffix("-join.json"): json.loads(p.read_text())["label_counts"]
                 for p in round_folder.glob("*-join.json")}
        fed_round = fed_folder / round_folder.name
        record = RoundRecords(index, attempt, plan["head_start"], plan["split_points"], joins, {},
                              _state(fed_round / "global.npz") if (fed_round / "global.npz").exists() else None,
                              {p.name.removesuffix("-upload.npz"): _state(p) for p in fed_round.glob("*-upload.npz")})
        tensors: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for path in round_folder.glob("*-step-*.npy"):
            match = _STEP.fullmatch(path.name)
            if match is not None:
                key = (match["device"], int(match["step"]))
                tensors.setdefault(key, {})[match["kind"]] = torch.from_numpy(np.load(path, allow_pickle=False))
        for device, split in plan["split_points"].items():
            shard = shard_of(device)
            if shard not in shards:
                shards[shard] = device_shard(config.data, train, shard)
            data = shards[shard]
            record.true_counts[device] = data.label_counts().tolist()
            no_single = leaves_out_single_samples(model, split, split=True)
            steps = sorted(s for d, s in tensors if d == device)
            if not steps:
                continue
            order = batches(data, config.train.batch_size, config.train.local_epochs,
                            round_seed(config.seed, shard, attempt), no_single=no_single)
            for step, (x, y) in enumerate(order):
                if step > steps[-1]:
                    break
                kept = tensors.get((device, step))
                if kept is None:
                    continue
                record.steps.append(StepRecord(device, step, split, kept["fx"], kept.get("labels"),
                                               kept.get("gradient"), x, y))
        rounds.append(record)
    return rounds
