"""The rule behind each device's own deadline, wherever a round waits for many devices.

A round's fixed deadlines (``deadlines.round_s``, ``join_s``) are set for the slowest device the
operator expects, often many times a usual wait. A device that takes its task and then says
nothing would hold every other device to them. So once at least half of the devices still
awaited have arrived, each missing one is waited for only until

    due = since + patience * expected + grace_s

where ``expected`` is the larger of its peers' time (the slowest arrival's, leaving out the
``ignore_slowest`` slowest, scaled up for a device with more work than any of them, by at most
``patience``) and its own expected time, where known.
Before half have arrived nothing shows that the wait is not simply slow for everyone (a busy
machine, a slow network), and only the fixed deadline applies.

**A claim cannot stretch a deadline past the bound.** A device's work (samples over the FLOP/s it
registered, or its portion's download time at the link rate it registered) is its own word until
the servers have measured it. It may make its deadline shorter (a claim of more speed), and longer
by at most ``patience`` times its peers' time: with its own expected time learnt from what the
servers timed, capped at ``patience`` times its peers' (:mod:`fed_server.device_pace`), no device
is waited for more than about ``patience ** 2`` times the slowest counted arrival, plus
``grace_s``, whatever it claims (docs/security.md).

**Nor can devices slow on purpose together.** Were the slowest arrival always counted, a second
such device, arriving at its own stretched deadline, would become the first's peers' time, and
the two would stretch each other: ``patience`` times further with each one that arrives late,
and round after round through their learnt times. Leaving out the ``ignore_slowest`` slowest
arrivals (and as many of the slowest other devices where a learnt time is capped) keeps the
bound against up to ``ignore_slowest + 1`` such devices, while they are fewer than half of the
attempt (:func:`counted_arrivals`). What it costs: up to that many honest devices much slower than
all the others look exactly like them to the servers' clocks and are held to the same bound
(docs/security.md).

The Fed Server applies it to uploads (:mod:`fed_server.device_pace`), the Main Server to joins
(:mod:`main_server.join_phase`), with the same ``deadlines.patience``, ``patience_grace_s`` and
``ignore_slowest``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def expected_seconds(own: float | None, finishers: Sequence[tuple[float, float]], work: float,
                     in_attempt: int, max_scale: float = math.inf, ignore_slowest: int = 0) -> float | None:
    """The seconds a device's wait is expected to take, once ``finishers`` (``(seconds, work)`` of
    each device that arrived) are at least half of the ``in_attempt`` devices still awaited or
    arrived; None before. The larger of its peers' time (the slowest counted finisher's, times
    ``work`` over the heaviest counted finisher's work when that is more than one, and at most
    ``max_scale``) and its own expected time ``own`` (None: not known). Up to ``ignore_slowest``
    of the slowest finishers are not counted (:func:`counted_arrivals`), so that devices slow on
    purpose together cannot lengthen each other's waits."""
    if not finishers or 2 * len(finishers) < in_attempt:
        return None
    counted = sorted(finishers, key=lambda finisher: finisher[0])[:counted_arrivals(len(finishers), in_attempt,
                                                                                     ignore_slowest)]
    slowest = counted[-1][0]
    heaviest = max(w for _, w in counted)
    scale = min(max(1.0, work / heaviest), max_scale) if heaviest > 0 else 1.0
    peers = slowest * scale
    return peers if own is None else max(peers, own)


def counted_arrivals(arrived: int, in_attempt: int, ignore_slowest: int) -> int:
    """How many of the ``arrived`` devices (the fastest first) a peers' time counts: all but the
    ``ignore_slowest`` slowest, but always more than half of the ``in_attempt`` devices (as many
    as arrived, if fewer), and at least one. Devices slow on purpose that are half of an attempt or
    more hold it back whatever the rule, and leaving them out would cut honest slow devices that
    are half of the fleet or more (two boards beside one or two servers) as if they lied."""
    return min(arrived, max(arrived - ignore_slowest, in_attempt // 2 + 1))


def check_patience(patience: float | None, grace_s: float, ignore_slowest: int = 0) -> None:
    """ValueError unless ``patience`` is None or at least 1 and ``grace_s`` and ``ignore_slowest``
    are not negative."""
    if patience is not None and patience < 1.0:
        raise ValueError(f"patience must be >= 1, got {patience}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    if ignore_slowest < 0:
        raise ValueError(f"ignore_slowest must be >= 0, got {ignore_slowest}")
