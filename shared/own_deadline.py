"""The rule behind each device's own deadline, wherever a round waits for many devices.

A round's fixed deadlines (``deadlines.round_s``, ``join_s``) are set for the slowest device the
operator expects, often many times a usual wait. A device that takes its task and then says
nothing would hold every other device to them. So once at least half of the devices still
awaited have arrived, each missing one is waited for only until

    due = since + patience * expected + grace_s

where ``expected`` is the larger of its peers' time (the slowest arrival's, scaled up for a device
with more work than any of them, by at most ``patience``) and its own expected time, where known.
Before half have arrived nothing shows that the wait is not simply slow for everyone (a busy
machine, a slow network), and only the fixed deadline applies.

**A claim cannot stretch a deadline past the bound.** A device's work (samples over the FLOP/s it
registered, or its portion's download time at the link rate it registered) is its own word until
the servers have measured it. It may make its deadline shorter (a claim of more speed), and longer
by at most ``patience`` times its peers' time: with its own expected time learnt from what the
servers timed, capped at ``patience`` times its peers' (:mod:`fed_server.device_pace`), no device
is waited for more than about ``patience ** 2`` times the slowest arrival, plus ``grace_s``,
whatever it claims (docs/security.md).

The Fed Server applies it to uploads (:mod:`fed_server.device_pace`), the Main Server to joins
(:mod:`main_server.join_phase`), with the same ``deadlines.patience`` and ``patience_grace_s``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def expected_seconds(own: float | None, finishers: Sequence[tuple[float, float]], work: float,
                     in_attempt: int, max_scale: float = math.inf) -> float | None:
    """The seconds a device's wait is expected to take, once ``finishers`` (``(seconds, work)`` of
    each device that arrived) are at least half of the ``in_attempt`` devices still awaited or
    arrived; None before. The larger of its peers' time (the slowest finisher's, times ``work``
    over the heaviest finisher's work when that is more than one, and at most ``max_scale``) and
    its own expected time ``own`` (None: not known)."""
    if not finishers or 2 * len(finishers) < in_attempt:
        return None
    slowest = max(seconds for seconds, _ in finishers)
    heaviest = max(w for _, w in finishers)
    scale = min(max(1.0, work / heaviest), max_scale) if heaviest > 0 else 1.0
    peers = slowest * scale
    return peers if own is None else max(peers, own)


def check_patience(patience: float | None, grace_s: float) -> None:
    """ValueError unless ``patience`` is None or at least 1 and ``grace_s`` is not negative."""
    if patience is not None and patience < 1.0:
        raise ValueError(f"patience must be >= 1, got {patience}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
