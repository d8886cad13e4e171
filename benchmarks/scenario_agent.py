"""``python -m benchmarks.scenario_agent --compute-speed X --link-speed Y --change-file PATH [python -m device_agent's arguments]``:
a device agent whose emulated kind changes mid-run, for the scenario benchmark (benchmarks/scenarios.py).

The agent is ``python -m device_agent`` with the same arguments and code; only its emulated kind's
speeds are multiplied: ``--compute-speed 0.5`` makes every compute section take twice the kind's
stretch (a board that throttles), ``--link-speed 0.1`` makes every emulated transfer take ten times
the kind's delay (emulated links only: on a shaped link the link itself is changed, with ``tc``).
On SIGUSR1 the agent reads new speeds from ``--change-file`` (JSON, ``{"compute": X, "link": Y}``):
the benchmark writes the file and signals the agent when the round it changes after has ended. A
compute stretch never goes below 1: an emulated device cannot be faster than this machine.
"""
from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from types import FrameType
from unittest import mock

from shared.profiles import EmulatedKind


class Speeds:
    """The multipliers of the kind's compute speed and link rate now in force."""

    compute = 1.0
    link = 1.0

    @classmethod
    def read(cls, path: Path) -> None:
        """Take the speeds in ``path`` (a JSON object with ``compute`` and ``link``)."""
        data = json.loads(path.read_text())
        cls.compute, cls.link = float(data["compute"]), float(data["link"])


_STRETCH: property = vars(EmulatedKind)["compute_stretch"]
_DELAY = EmulatedKind.transfer_delay


def _compute_stretch(kind: EmulatedKind) -> float:
    """The kind's stretch at the compute speed now in force."""
    assert _STRETCH.fget is not None
    return float(_STRETCH.fget(kind)) / Speeds.compute


def _transfer_delay(kind: EmulatedKind, num_bytes: int, time_scale: float) -> float:
    """The kind's transfer delay at the link speed now in force."""
    return _DELAY(kind, num_bytes, time_scale) / Speeds.link


def main(argv: list[str] | None = None) -> None:
    """Parse the speeds and the change file; hand every other argument to ``python -m device_agent``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scenario_agent",
        description="python -m device_agent with its emulated kind's speeds multiplied, changed on SIGUSR1. "
                    "Every other argument is python -m device_agent's.")
    parser.add_argument("--compute-speed", type=float, default=1.0, help="multiplier of the kind's compute speed")
    parser.add_argument("--link-speed", type=float, default=1.0,
                        help="multiplier of the kind's link rate (emulated links only)")
    parser.add_argument("--change-file", type=Path, required=True,
                        help="JSON {\"compute\": X, \"link\": Y} read on SIGUSR1")
    args, rest = parser.parse_known_args(argv)
    if not (args.compute_speed > 0 and args.link_speed > 0):
        parser.error("--compute-speed and --link-speed take numbers > 0")
    Speeds.compute, Speeds.link = args.compute_speed, args.link_speed

    def change(signum: int, frame: FrameType | None) -> None:
        Speeds.read(args.change_file)
        print(f"scenario: compute speed x{Speeds.compute:g}, link speed x{Speeds.link:g}", flush=True)

    signal.signal(signal.SIGUSR1, change)
    from device_agent.__main__ import main as agent_main

    with mock.patch.object(EmulatedKind, "compute_stretch", property(_compute_stretch)), \
            mock.patch.object(EmulatedKind, "transfer_delay", _transfer_delay):
        agent_main(rest)


if __name__ == "__main__":
    main()
