"""Recording what a server receives: an honest-but-curious server, for studying what it learns.

A server started with ``--record-received DIR`` keeps, under ``DIR/<service>/``, what the devices
(and the other server) send it, exactly as it decoded it: the Main Server every step's activations
(with their labels, where the Main Server computes the loss; in U-shaped mode the gradients at the
middle's output) and every join's label counts; the Fed Server the global model each round starts
from, every device's upload and every group's server portion. That is what an operator who follows
the protocol but looks at everything could keep, and what attacks on it start from
(docs/split-privacy.md; ``benchmarks/privacy_records.py`` reads it back). It is off unless the flag is
given, and a server that records says so in its log, loudly, at start and in every round it
records.

Files, per recorded round (``round-<index>-attempt-<attempt>/``): ``.npy`` arrays (one tensor),
``.npz`` archives (a state, by its state_dict names) and ``.json`` values, all readable without
pickle (``numpy.load(..., allow_pickle=False)``). ``--record-rounds`` limits the rounds (their
logical indexes), ``--record-steps`` the steps of each device in a round (its first N): activations
at a shallow cut are 25 KB a sample.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:   # the servers parse their flags before torch is imported (shared/service.py)
    import torch

log = logging.getLogger("recording")

#: What the log says, in capitals, wherever a server records.
BANNER = "RECORDING WHAT DEVICES SEND"


def add_recording_args(parser: argparse.ArgumentParser) -> None:
    """The recording flags a server takes (off by default)."""
    group = parser.add_argument_group("recording (honest-but-curious; off by default; docs/split-privacy.md)")
    group.add_argument("--record-received", metavar="DIR", default=None,
                       help="keep what devices send this server under DIR (activations, labels, gradients, label "
                            "counts, uploads) to study what a server learns; the log says so loudly. Off by default")
    group.add_argument("--record-rounds", metavar="N,M,...", default=None,
                       help="with --record-received: only these rounds (logical indexes; default every round)")
    group.add_argument("--record-steps", type=int, metavar="N", default=None,
                       help="with --record-received: only each device's first N steps of a round (default all)")


def recording_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, service: str) -> Recording | None:
    """The recording the flags ask for (None: off); ``parser.error`` for flags that do not fit."""
    if args.record_received is None:
        if args.record_rounds is not None or args.record_steps is not None:
            parser.error("--record-rounds and --record-steps limit --record-received, which is not given")
        return None
    try:
        rounds = None if args.record_rounds is None else frozenset(
            int(r) for r in str(args.record_rounds).split(",") if r.strip())
    except ValueError:
        parser.error(f"--record-rounds takes round indexes, e.g. 18,19,20; got {args.record_rounds!r}")
    if rounds is not None and (not rounds or min(rounds) < 1):
        parser.error(f"--record-rounds takes round indexes from 1, e.g. 18,19,20; got {args.record_rounds!r}")
    if args.record_steps is not None and args.record_steps < 1:
        parser.error(f"--record-steps must be at least 1, got {args.record_steps}")
    return Recording(Path(args.record_received) / service, rounds, args.record_steps)


@dataclass
class Recording:
    """Keeps what a server receives under ``folder`` (``rounds``: the logical rounds kept, None:
    every one; ``steps``: each device's first steps of a round kept, None: all)."""

    folder: Path
    rounds: frozenset[int] | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._announced: set[tuple[int, int]] = set()
        log.warning("%s: this server keeps everything devices send it under %s (honest-but-curious recording for "
                    "studying what a server learns, --record-received; rounds %s, steps %s). Never in a real deployment.",
                    BANNER, self.folder, "all" if self.rounds is None else sorted(self.rounds),
                    "all" if self.steps is None else f"the first {self.steps}")

    def keeps(self, round_index: int | None, step: int | None = None) -> bool:
        """Whether round ``round_index`` (and a device's ``step`` of it) is recorded."""
        if round_index is None or (self.rounds is not None and round_index not in self.rounds):
            return False
        return step is None or self.steps is None or step < self.steps

    def round_folder(self, round_index: int, attempt: int) -> Path:
        """The folder of one attempt's records (made, and said in the log, once)."""
        folder = self.folder / f"round-{round_index:03d}-attempt-{attempt}"
        if (round_index, attempt) not in self._announced:
            folder.mkdir(parents=True, exist_ok=True)
            self._announced.add((round_index, attempt))
            log.warning("%s: round %d (attempt %d) is recorded under %s", BANNER, round_index, attempt, folder)
        return folder

    def tensor(self, round_index: int, attempt: int, name: str, value: torch.Tensor) -> None:
        """Keep one tensor as ``<name>.npy``."""
        np.save(self.round_folder(round_index, attempt) / f"{name}.npy", _array(value), allow_pickle=False)

    def state(self, round_index: int, attempt: int, name: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep a state (tensors by name) as ``<name>.npz``."""
        arrays: dict[str, Any] = {k: _array(v) for k, v in state.items()}
        np.savez(self.round_folder(round_index, attempt) / f"{name}.npz", **arrays)

    def value(self, round_index: int, attempt: int, name: str, value: Any) -> None:
        """Keep a JSON value as ``<name>.json``."""
        (self.round_folder(round_index, attempt) / f"{name}.json").write_text(json.dumps(value, sort_keys=True))


def _array(value: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array (on the CPU, float32 for a half or bfloat16 tensor)."""
    import torch

    value = value.detach().to("cpu")
    if value.dtype in (torch.float16, torch.bfloat16):
        value = value.float()
    return value.numpy()
