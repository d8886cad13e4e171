"""Devices that let a deadline pass: skipped by selection for a while, longer each time in a row.

A device that was selected and then never joined its group at the Main Server, never reported
(two-phase algorithms) or never uploaded costs its attempt a whole deadline (``join_s``,
``report_s`` or ``round_s``): every other device waits for it. A device that is alive but silent,
or gone without telling, would do so in every attempt it is selected for. So after such a miss
the device is not selected for the next attempt, after a second miss in a row for the next two,
then four, ... up to ``deadlines.max_skip_rounds``; an upload in time clears its record. The
record is the device's, kept by device id: registering again (an agent that restarted, or a
device that re-registers to wash a penalty out) clears nothing. A device that leaves an attempt at once (a refused upload, a
withdrawal, a member the Main Server dropped) costs no deadline and is not counted.

Honest runs are unchanged: a device that answers in time never misses. Where a device is merely
late (a deadline set too short for it), it is tried again after its skip, as the selection would
have; the skip trades its rounds for the others' time (docs/security.md, "A silent device").
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass
class _Record:
    misses: int          # deadlines missed in a row
    skip_until: int      # first attempt id it may be selected for again


class MissedDeadlines:
    """Per device: deadlines missed in a row, and until which attempt it is skipped."""

    def __init__(self, max_skip: int) -> None:
        """``max_skip``: the most attempts one miss makes a device sit out (0: never skipped)."""
        if max_skip < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        self.max_skip = max_skip
        self._records: dict[str, _Record] = {}

    def skipped(self, attempt: int) -> set[str]:
        """The devices that may not be selected for attempt id ``attempt``."""
        return {d for d, r in self._records.items() if attempt < r.skip_until}

    def missed(self, devices: Iterable[str], attempt: int) -> dict[str, int]:
        """``devices`` let a deadline of attempt ``attempt`` pass: each sits out the next
        ``min(2 ** (misses in a row - 1), max_skip)`` attempts. Returns how many each sits out."""
        out: dict[str, int] = {}
        for device in sorted(set(devices)):
            record = self._records.get(device) or _Record(0, 0)
            record.misses += 1
            skip = min(2 ** min(record.misses - 1, 30), self.max_skip)
            record.skip_until = attempt + 1 + skip
            self._records[device] = record
            out[device] = skip
        return out

    def answered(self, devices: Iterable[str]) -> None:
        """``devices`` uploaded in time: their record is cleared."""
        for device in devices:
            self._records.pop(device, None)

    def state_dict(self) -> dict[str, list[int]]:
        """For the checkpoint: device -> [misses in a row, first attempt it may be selected for]."""
        return {d: [r.misses, r.skip_until] for d, r in sorted(self._records.items())}

    def load_state_dict(self, state: Mapping[str, Iterable[int]]) -> None:
        """Restore :meth:`state_dict`'s output (a resumed run skips whom it skipped)."""
        records: dict[str, _Record] = {}
        for device, values in state.items():
            misses, skip_until = (int(v) for v in values)
            records[str(device)] = _Record(misses, skip_until)
        self._records = records
