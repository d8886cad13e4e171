"""Shamir's secret sharing of a device's secrets (its mask seed, its mask key's private half)
among its neighbours, over the prime field of the Mersenne prime ``2**521 - 1``.

A secret of up to 65 bytes is one field element, the constant term of a polynomial of degree
``threshold - 1`` whose other coefficients are drawn uniformly from the field (``secrets``); share
``i`` is the polynomial's value at ``i``, and any ``threshold`` shares give the constant term back
by Lagrange interpolation at 0. The arithmetic is Python's integers: a split of one secret into 21
shares of degree 7, or an interpolation from 8 shares, takes tens of microseconds, where
pycryptodome's GF(2^128) arithmetic in Python (16-byte chunks, as Flower's ``secaggplus`` uses it)
took milliseconds and was most of a secure round's CPU (docs/privacy.md, "Cost"). Fewer than
``threshold`` shares, or shares of different secrets, interpolate to a field element that is
almost surely (all but 2^-393 for a 16-byte secret) larger than any secret of the size asked for,
and are refused. A share altered by a small amount can still rebuild a wrong secret of the right
size: what catches that is the owner's commitments to its shares and its seed
(``shared.secagg.protocol``; docs/privacy.md, "What it protects")."""
from __future__ import annotations

import secrets
from collections.abc import Mapping

#: The field's order: the Mersenne prime 2**521 - 1 (above every secret this module shares).
PRIME = (1 << 521) - 1
#: A share's length: one field element, big-endian.
SHARE_BYTES = 66
#: The longest secret: a whole number of bytes below the field's order.
MAX_SECRET_BYTES = 65


def is_share(share: bytes) -> bool:
    """Whether ``share`` is a field element of :data:`SHARE_BYTES` bytes (what a share must be)."""
    return len(share) == SHARE_BYTES and int.from_bytes(share, "big") < PRIME


def split_secret(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` shares of ``secret`` (1 to :data:`MAX_SECRET_BYTES` bytes), any ``threshold`` of
    which rebuild it; share ``i`` (from 0) is the polynomial's value at ``i + 1``,
    :data:`SHARE_BYTES` bytes. ValueError for a secret or threshold that does not fit."""
    if not 1 <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"a secret of {len(secret)} bytes does not fit the field (1 to {MAX_SECRET_BYTES})")
    if not 1 <= threshold <= count:
        raise ValueError(f"a threshold of {threshold} does not fit {count} shares")
    # Highest degree first, for Horner's rule.
    coefficients = [secrets.randbelow(PRIME) for _ in range(threshold - 1)] + [int.from_bytes(secret, "big")]
    shares = []
    for x in range(1, count + 1):
        y = 0
        for c in coefficients:
            y = (y * x + c) % PRIME
        shares.append(y.to_bytes(SHARE_BYTES, "big"))
    return shares


def combine_secret(shares: Mapping[int, bytes], size: int) -> bytes:
    """The ``size``-byte secret rebuilt from shares by index (as many as the threshold: more
    rebuild the same secret at a cost quadratic in them). ValueError for a share that is not a
    field element of :data:`SHARE_BYTES` bytes at an index from 1, and for shares that rebuild no
    ``size``-byte secret (fewer than the threshold, altered, or of different secrets)."""
    points = []
    for index, share in shares.items():
        if not 0 < index < PRIME or not is_share(share):
            raise ValueError(f"share {index} is not a field element of {SHARE_BYTES} bytes at an index from 1")
        points.append((index, int.from_bytes(share, "big")))
    if not points:
        raise ValueError("no shares to rebuild a secret from")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        numerator = denominator = 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        secret = (secret + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >> (8 * size):
        raise ValueError(f"the shares rebuild no {size}-byte secret (fewer than the threshold, or altered)")
    return secret.to_bytes(size, "big")
