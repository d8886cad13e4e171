"""Shamir's secret sharing of a device's secrets (its mask seed, its mask key's private half)
among its neighbours, over pycryptodome's implementation (``Crypto.Protocol.SecretSharing``,
GF(2^128)), 16 bytes at a time as Flower does: no field arithmetic is written here."""
from __future__ import annotations

from collections.abc import Mapping

from Crypto.Protocol.SecretSharing import Shamir

CHUNK = 16


def split_secret(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` shares of ``secret`` (a multiple of 16 bytes), any ``threshold`` of which rebuild
    it; share ``i`` (from 0) has the index ``i + 1`` and is the concatenation of its 16-byte
    pieces, one per chunk of the secret."""
    if not secret or len(secret) % CHUNK:
        raise ValueError(f"a secret of {len(secret)} bytes is not a whole number of {CHUNK}-byte chunks")
    pieces = [Shamir.split(threshold, count, secret[at:at + CHUNK], False) for at in range(0, len(secret), CHUNK)]
    return [b"".join(chunk[i][1] for chunk in pieces) for i in range(count)]


def combine_secret(shares: Mapping[int, bytes]) -> bytes:
    """The secret rebuilt from shares by index (as many as the threshold, or more). ValueError for
    shares of different lengths; shares of another secret rebuild garbage, which the caller
    checks against what the secret's owner committed to."""
    lengths = {len(share) for share in shares.values()}
    if len(lengths) != 1 or next(iter(lengths)) % CHUNK:
        raise ValueError(f"shares of unequal or partial lengths: {sorted(lengths)}")
    size = lengths.pop()
    return b"".join(Shamir.combine([(index, share[at:at + CHUNK]) for index, share in sorted(shares.items())], False)
                    for at in range(0, size, CHUNK))
