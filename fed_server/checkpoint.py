"""What a Fed Server checkpoint holds besides the model, and the rules for resuming from one.

The coordinator decides *when* to checkpoint (after every round attempt); this module decides
*what* a checkpoint contains and whether a restarted server may continue from it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fed_server.run_dir import RunDirectory
from shared.config import RunConfig

# What a resumed run may change: how long it runs, how patient it is and where its figures are
# also sent. Anything else (model, data, algorithm, seeds, ...) would silently continue a different
# experiment from this checkpoint.
RESUMABLE_CHANGES = ("rounds", "deadlines", "tracking")


@dataclass
class RunProgress:
    """Everything besides the model that a restart needs to neither lose nor repeat a round."""

    run_id: str
    rounds_done: int
    attempts: int                 # round attempts started; the last one's wire round_id
    failed_in_a_row: int
    history_len: int              # metrics.jsonl records this checkpoint covers
    cumulative_bytes: int
    elapsed_s: float
    rng_state: tuple              # the selection RNG (random.Random.getstate())
    algorithm_state: dict[str, Any] = field(default_factory=dict)
    selector_state: dict[str, Any] = field(default_factory=dict)
    # The client time table (fed_server/time_table.py, ClientTimeTable.state_dict).
    time_table: dict[str, Any] = field(default_factory=dict)
    # Devices sitting out after missed deadlines (fed_server/missed_deadlines.py).
    missed_deadlines: dict[str, list[int]] = field(default_factory=dict)
    # Each device's usual round time per split point (fed_server/device_pace.py).
    device_pace: dict[str, dict[str, float]] = field(default_factory=dict)
    finished: bool = False
    stop_reason: str | None = None
    # The noise multiplier, clip bound and privacy ledger (fed_server/privacy.py); empty without privacy.
    privacy: dict[str, Any] = field(default_factory=dict)
    # The devices' DP-SGD tasks counted (fed_server/sample_privacy.py); empty without train.dp_sgd.
    sample_privacy: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(run_dir: RunDirectory, model_state: Mapping[str, torch.Tensor], progress: RunProgress) -> None:
    """Write the model and the progress atomically (msgpack, never pickle)."""
    extra = {k: v for k, v in dataclasses.asdict(progress).items() if k != "rounds_done"}
    version, internal, gauss = progress.rng_state
    extra["rng_state"] = [version, list(internal), gauss]      # msgpack has no tuples
    run_dir.write_checkpoint(progress.rounds_done, model_state, extra)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dumps, except ``RESUMABLE_CHANGES``."""
    out = []
    for key in sorted(set(old) | set(new)):
        dotted = f"{prefix}{key}"
        if dotted in RESUMABLE_CHANGES or dotted == "run_id":
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, dotted + ".")
        elif a != b:
            out.append(dotted)
    return out


def load_checkpoint(run_dir: RunDirectory, config: RunConfig) -> tuple[dict[str, torch.Tensor], RunProgress] | None:
    """The run directory's checkpoint, or None when there is none.

    ValueError when the directory's run was started with a configuration that differs from
    ``config`` in more than ``RESUMABLE_CHANGES``.
    """
    if not run_dir.checkpoint_path.exists():
        return None
    previous = run_dir.read_config()
    if previous is not None:
        changed = config_differences(previous, config.model_dump(mode="json"))
        if changed:
            raise ValueError(
                f"{run_dir.path} holds a checkpoint of a run with a different configuration "
                f"({', '.join(changed)} differ); resume with the same configuration (only "
                f"{' and '.join(RESUMABLE_CHANGES)} may change) or use a new run directory")
    rounds_done, state, extra = run_dir.read_checkpoint()
    version, internal, gauss = extra["rng_state"]
    return state, RunProgress(**{
        **extra, "rounds_done": rounds_done, "rng_state": (version, tuple(internal), gauss),
    })
