"""The fixed-point encoding of the masked updates, modulo 2**64.

A device's weighted update ``w * u`` has each entry within ``±w * bound``; it is sent as
``round(w * u * 2**f)`` in two's complement on 64 bits, plus its masks, all modulo 2**64. The sum
over a round's devices is within ``±W * bound`` (``W``: their summed weights), so with ``f`` chosen
by :func:`fraction_bits`, ``W * bound * 2**f <= 2**62``: the sum never wraps past ``±2**63``, and it
decodes to the true sum within ``n / 2**(f+1)`` per entry for ``n`` devices (each rounds once)."""
from __future__ import annotations

import math

import numpy as np

#: The sum's magnitude stays at most 2**SUM_BITS in fixed point, one bit below the sign's.
SUM_BITS = 62
#: Fewer fraction bits than this and the encoding would round updates of the clip bound's size
#: coarsely: refused instead.
MIN_FRACTION_BITS = 16


def fraction_bits(total_weight: float, bound: float) -> int:
    """The most fraction bits with which ``total_weight * bound`` still fits in 2**62 (at most 62).
    ValueError when fewer than :data:`MIN_FRACTION_BITS` would."""
    bits = min(SUM_BITS, math.floor(SUM_BITS - math.log2(total_weight * bound)))
    if bits < MIN_FRACTION_BITS:
        raise ValueError(f"a round's summed weight {total_weight:g} times the range {bound:g} leaves {bits} fraction "
                         f"bits in 64-bit words (at least {MIN_FRACTION_BITS} needed)")
    return bits


def encode(values: np.ndarray, bits: int, limit: float) -> np.ndarray:
    """Float64 ``values`` kept within ``±limit`` and encoded with ``bits`` fraction bits: uint64
    words (two's complement), each within ``±``:func:`word_limit`."""
    return np.rint(np.clip(values, -limit, limit) * 2.0 ** bits).astype(np.int64).view(np.uint64)


def word_limit(limit: float, bits: int) -> int:
    """The largest magnitude of a word :func:`encode` makes of values kept within ``±limit``:
    the same float operations, so exactly."""
    return int(np.rint(limit * 2.0 ** bits))


def decode(words: np.ndarray, bits: int) -> np.ndarray:
    """The float64 values of uint64 fixed-point ``words`` (a sum of encoded values, masks removed)."""
    return words.view(np.int64).astype(np.float64) / 2.0 ** bits


def decode_within(words: np.ndarray, bits: int, limit: int) -> tuple[np.ndarray, int]:
    """:func:`decode`, each word first clamped to ``±limit`` (what the summed devices' words can
    add up to: the sum of their :func:`word_limit`), and how many were outside it. Only a device
    that encoded a value beyond its own limit, or masked with something else than its secrets,
    puts a sum outside: the Fed Server cannot see which, and clamping keeps such a device from
    moving the sum further than every device at its limit could. Compared in whole words, so an
    honest sum is never clamped (its float64 value may round past a float bound)."""
    signed = words.view(np.int64)
    outside = int(np.count_nonzero((signed > limit) | (signed < -limit)))
    if outside:
        signed = np.clip(signed, -limit, limit)
    return signed.astype(np.float64) / 2.0 ** bits, outside
