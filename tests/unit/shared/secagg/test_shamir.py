"""Shamir's secret sharing over the prime field: the shares are the polynomial's values, any
threshold of them rebuild the secret, fewer or mixed shares rebuild none, and malformed shares are
refused."""
import itertools
import os
import random

import pytest

from shared.secagg import shamir
from shared.secagg.shamir import MAX_SECRET_BYTES, PRIME, SHARE_BYTES, combine_secret, split_secret


def test_the_prime_is_the_mersenne_prime_above_every_secret():
    assert PRIME == 2**521 - 1 and pow(3, PRIME - 1, PRIME) == 1   # Fermat: a prime passes, as 2**521 - 1 is
    assert 1 << (8 * MAX_SECRET_BYTES) < PRIME < 1 << (8 * SHARE_BYTES)


def test_share_i_is_the_polynomial_at_i_with_the_secret_as_constant_term_and_random_coefficients(monkeypatch):
    drawn = []

    def randbelow(bound: int) -> int:
        assert bound == PRIME   # uniform over the whole field
        drawn.append(random.Random(len(drawn)).randrange(bound))
        return drawn[-1]

    monkeypatch.setattr(shamir.secrets, "randbelow", randbelow)
    secret = os.urandom(32)
    shares = split_secret(secret, threshold=4, count=6)
    a0 = int.from_bytes(secret, "big")
    coefficients = [a0, *reversed(drawn)]   # drawn highest degree first
    assert len(drawn) == 3
    for x, share in enumerate(shares, 1):
        assert len(share) == SHARE_BYTES
        assert int.from_bytes(share, "big") == sum(c * x**k for k, c in enumerate(coefficients)) % PRIME


@pytest.mark.parametrize("size", [1, 16, 32, MAX_SECRET_BYTES])
def test_every_threshold_of_the_shares_rebuilds_the_secret(size):
    for secret in (os.urandom(size), bytes(size), b"\xff" * size, b"\x00" + os.urandom(size - 1)):
        shares = dict(enumerate(split_secret(secret, threshold=3, count=5), 1))
        for subset in itertools.combinations(shares, 3):
            assert combine_secret({i: shares[i] for i in subset}, size) == secret
        assert combine_secret(shares, size) == secret   # more than the threshold: the same secret


def test_fewer_than_the_threshold_or_shares_of_different_secrets_rebuild_nothing():
    shares = dict(enumerate(split_secret(os.urandom(16), threshold=3, count=5), 1))
    with pytest.raises(ValueError, match="rebuild no 16-byte secret"):
        combine_secret({1: shares[1], 2: shares[2]}, 16)
    other = dict(enumerate(split_secret(os.urandom(16), threshold=3, count=5), 1))
    with pytest.raises(ValueError, match="rebuild no 16-byte secret"):
        combine_secret({1: shares[1], 2: shares[2], 3: other[3]}, 16)


@pytest.mark.parametrize("bad", [{0: bytes(SHARE_BYTES)}, {1: bytes(SHARE_BYTES - 1)},
                                 {1: PRIME.to_bytes(SHARE_BYTES, "big")}, {}])
def test_a_malformed_share_is_refused(bad):
    with pytest.raises(ValueError):
        combine_secret(bad, 16)


@pytest.mark.parametrize("secret, threshold, count", [(b"", 2, 3), (bytes(MAX_SECRET_BYTES + 1), 2, 3),
                                                      (b"s", 0, 3), (b"s", 4, 3)])
def test_a_secret_or_threshold_that_does_not_fit_is_refused(secret, threshold, count):
    with pytest.raises(ValueError):
        split_secret(secret, threshold, count)
