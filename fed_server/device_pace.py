"""Each device's own deadline in an attempt: how long the Fed Server waits for its upload.

The round deadline (``deadlines.round_s``) is set for the slowest device the operator expects,
often many times a usual round. A device that takes its task and then says nothing (alive but
silent, or gone without telling) would hold every other device to it. So each selected device
also gets a deadline of its own, counted from the moment it took its task (or from the moment
the tasks went out, for one that never asked):

    due = start + patience * expected + grace_s

(the rule of :mod:`shared.own_deadline`, which the Main Server applies to joins). The rule applies once at least half of the attempt's devices still in it have uploaded: before
that, nothing shows that the round is not simply slow for everyone (a busy machine, a slow
network), and only the round deadline applies. ``expected`` is then the larger of

* **its peers' time**: the slowest of those that uploaded, leaving out the
  ``deadlines.ignore_slowest`` slowest (while those counted are at least half of the attempt),
  scaled up by how much more compute the
  device's round needs than the heaviest of them (samples over the FLOP/s it registered), never
  down, and by at most ``patience``: the FLOP/s is the device's word, so it may shorten its
  deadline but lengthen it only within the bound below;
* **its own usual time**, where known: the running average (``(1 - s) * old + s * new``,
  ``s`` = 0.5) of the seconds its aggregated rounds took at the same split point, task to upload,
  as the Fed Server's own clock saw them, each counted at most ``patience`` times its peers' time
  in that round (the slowest counted other aggregated device's, leaving out as many). A device
  that is always slower than its peers keeps its time; one slow on purpose, uploading just before
  its deadline every round, cannot push its own deadline further each round.

So no device, whatever it claims and however it times its uploads, is waited for more than about
``patience ** 2`` times the slowest counted uploader's time plus ``grace_s``, nor are up to
``ignore_slowest + 1`` such devices together, while they are fewer than half of the attempt
(:mod:`shared.own_deadline`).
Its usual times are kept by device id, so registering again clears nothing.

A device past its own deadline is taken out of the attempt (``fed_round.OVERDUE``), which
counts as a missed deadline (:mod:`fed_server.missed_deadlines`): it sits out the next attempts.
Its late upload is refused, and its time is not learnt from (a cut-off round is not a
measurement).

Honest rounds are unaffected as long as no device takes more than ``patience`` times the
expected time (plus ``grace_s``); ``deadlines.patience`` null turns the rule off
(docs/security.md, "A silent device").
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from shared.own_deadline import check_patience, counted_arrivals, expected_seconds

SMOOTHING = 0.5


class DevicePace:
    """Per device and split point, the running average of its rounds' seconds (task to upload),
    and the rule that turns them into each device's deadline in an attempt."""

    def __init__(self, patience: float | None, grace_s: float, ignore_slowest: int = 0) -> None:
        """``patience``: how many times its expected time a device is waited for (None: only the
        round deadline applies); ``grace_s``: seconds added to every device's deadline;
        ``ignore_slowest``: how many of the slowest arrivals a peers' time leaves out
        (:func:`shared.own_deadline.counted_arrivals`)."""
        check_patience(patience, grace_s, ignore_slowest)
        self.patience = patience
        self.grace_s = grace_s
        self.ignore_slowest = ignore_slowest
        self._usual: dict[str, dict[int, float]] = {}

    def observe(self, device: str, split_point: int, seconds: float) -> None:
        """Fold an aggregated round's seconds into the device's usual time at ``split_point``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        row = self._usual.setdefault(device, {})
        old = row.get(split_point)
        row[split_point] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds

    def observe_attempt(self, rounds: Mapping[str, tuple[int, float]]) -> None:
        """Fold an aggregated attempt's times in: device -> (split point, seconds task to upload).
        Each device's seconds count at most ``patience`` times the slowest counted other device's
        in the same attempt (leaving out up to ``ignore_slowest`` of the slowest, as a peers' time
        does; no scaling for claimed work: what is learnt comes from the Fed Server's clock
        alone); a device alone is not capped."""
        slowest_other = _slowest_counted_other({d: s for d, (_, s) in rounds.items()}, self.ignore_slowest)
        for device, (split_point, seconds) in rounds.items():
            if self.patience is not None and len(rounds) > 1:
                seconds = min(seconds, self.patience * slowest_other(device))
            self.observe(device, split_point, seconds)

    def usual(self, device: str, split_point: int) -> float | None:
        """The device's usual seconds at ``split_point``; None before its first aggregated round there."""
        return self._usual.get(device, {}).get(split_point)

    def deadlines(self, waiting: Mapping[str, tuple[int, float]], finishers: Sequence[tuple[float, float]],
                  in_attempt: int, work: Callable[[str], float]) -> dict[str, float]:
        """Each waiting device's own deadline (monotonic seconds), for those that have one.

        ``waiting``: device -> (split point, when its wait began); ``finishers``, ``in_attempt``:
        as in :func:`expected_seconds`; ``work``: a device's compute per round (samples / FLOP/s)."""
        if self.patience is None:
            return {}
        out: dict[str, float] = {}
        for device, (split_point, since) in waiting.items():
            expected = expected_seconds(self.usual(device, split_point), finishers, work(device), in_attempt,
                                        max_scale=self.patience, ignore_slowest=self.ignore_slowest)
            if expected is not None:
                out[device] = since + self.patience * expected + self.grace_s
        return out

    def state_dict(self) -> dict[str, dict[str, float]]:
        """For the checkpoint: device -> {split point (as text): usual seconds}."""
        return {d: {str(k): t for k, t in sorted(row.items())} for d, row in sorted(self._usual.items())}

    def load_state_dict(self, state: Mapping[str, Mapping[str, float]]) -> None:
        """Restore :meth:`state_dict`'s output (a resumed run waits as long as it would have)."""
        self._usual = {str(d): {int(k): float(t) for k, t in row.items()} for d, row in state.items()}


def _slowest_counted_other(seconds: Mapping[str, float], ignore_slowest: int) -> Callable[[str], float]:
    """For each device, the slowest of the other devices' ``seconds`` that a peers' time counts
    (the attempt being all of ``seconds``' devices: :func:`counted_arrivals`); ``-inf`` where
    there is no other. One sort serves every device."""
    devices = sorted(seconds, key=seconds.__getitem__)
    ordered = [seconds[device] for device in devices]
    keep = counted_arrivals(len(ordered) - 1, len(ordered), ignore_slowest)
    rank = {device: i for i, device in enumerate(devices)}

    def slowest(device: str) -> float:
        if keep < 1:
            return -math.inf
        # The others' keep fastest: the attempt's keep fastest, or keep + 1 where the device is among them.
        return ordered[keep] if rank[device] < keep else ordered[keep - 1]
    return slowest
