"""Secure aggregation's primitives: masks that cancel block by block over the devices that hold a
block, dropped devices' masks removed through their rebuilt keys, the fixed-point range and the AEAD's
verification (Shamir's scheme: test_shamir.py)."""
import os

import numpy as np
import pytest

from shared.secagg.crypto import MASK_PURPOSE, ShareError, agree, check_public_key, new_private_key, open_sealed, public_key, seal
from shared.secagg.encoding import SUM_BITS, decode, decode_within, encode, fraction_bits, word_limit
from shared.secagg.masks import BlockLayout, add_masks, masked_splits, remove_masks, unprotected, well_held

LAYOUT = BlockLayout(((("a", (3,)),), (("b", (2, 2)), ("c", ())), (("d", (5,)),)))
SPLITS = {"d0": 1, "d1": 2, "d2": 3, "d3": 3, "d4": 2}


def _words(layout: BlockLayout, split: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {key: rng.integers(0, 2**63, size=shape, dtype=np.uint64) if shape else
            np.array(rng.integers(0, 2**63, dtype=np.uint64)) for block in layout.held(split)
            for key, shape in layout.entries(block)}


def _masked_round(dropped: set[str]):
    """Every device of SPLITS masks random words with all others as partners; the sum of the
    survivors' masked words with the masks removed, and the sum of their plain words."""
    rng = np.random.default_rng(0)
    secrets = {d: (os.urandom(16), new_private_key()) for d in SPLITS}
    public = {d: public_key(secrets[d][1]) for d in SPLITS}
    plain = {d: _words(LAYOUT, s, rng) for d, s in SPLITS.items()}
    masked = {d: add_masks({k: v.copy() for k, v in plain[d].items()}, LAYOUT, d, SPLITS[d], secrets[d][0],
                           {p: (agree(secrets[d][1], public[p], MASK_PURPOSE), SPLITS[p]) for p in SPLITS if p != d})
              for d in SPLITS}
    survivors = [d for d in SPLITS if d not in dropped]
    keys = {k for d in survivors for k in masked[d]}
    total = {k: sum((masked[d][k] for d in survivors if k in masked[d]), np.zeros_like(next(
        masked[d][k] for d in survivors if k in masked[d]))) for k in keys}
    expected = {k: sum((plain[d][k] for d in survivors if k in plain[d]), np.zeros_like(total[k])) for k in keys}
    remove_masks(total, LAYOUT, SPLITS, {d: secrets[d][0] for d in survivors}, {d: secrets[d][1] for d in dropped},
                 {d: survivors for d in dropped}, public)
    return total, expected, masked


def test_masks_cancel_block_by_block_over_mixed_split_points():
    total, expected, masked = _masked_round(set())
    assert set(total) == {"a", "b", "c", "d"}
    for key in total:
        np.testing.assert_array_equal(total[key], expected[key])
    # Block 0 is summed over all five devices, block 2 over the two that hold it.
    assert all("a" in masked[d] for d in SPLITS) and sorted(d for d in SPLITS if "d" in masked[d]) == ["d2", "d3"]


def test_the_masks_of_devices_that_dropped_after_masking_are_removed_with_their_keys():
    total, expected, _ = _masked_round({"d1", "d3"})
    for key in total:
        np.testing.assert_array_equal(total[key], expected[key])


def test_a_masked_upload_looks_like_uniform_words():
    """An update of zeros, masked: its bytes are uniform (chi-square over the 256 byte values)."""
    layout = BlockLayout(((("w", (20000,)),),))
    words = add_masks({"w": np.zeros(20000, dtype=np.uint64)}, layout, "a", 1, os.urandom(16),
                      {"b": (agree(new_private_key(), public_key(new_private_key()), MASK_PURPOSE), 1)})
    counts = np.bincount(np.frombuffer(words["w"].tobytes(), dtype=np.uint8), minlength=256)
    expected = counts.sum() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 330   # 255 degrees of freedom: P(chi2 > 330) is below 0.1 %


def test_fixed_point_sum_is_exact_within_the_rounding_and_never_wraps():
    rng = np.random.default_rng(1)
    n, bound = 1000, 3.0
    bits = fraction_bits(n, bound)
    assert n * bound * 2.0 ** bits <= 2.0 ** SUM_BITS
    values = rng.uniform(-bound, bound, size=(n, 50))
    values[0] = bound   # every entry at the edge of the range: the sum is at its largest
    values[1:] = np.sign(values[1:]) * bound
    total = np.zeros(50, dtype=np.uint64)
    for row in values:
        total += encode(row, bits, bound)
    np.testing.assert_allclose(decode(total, bits), values.sum(axis=0), atol=n / 2.0 ** (bits + 1), rtol=0)


def test_fixed_point_keeps_values_within_the_range():
    bits = fraction_bits(1, 1.0)
    np.testing.assert_array_equal(decode(encode(np.array([5.0, -7.0, 0.25]), bits, 1.0), bits), [1.0, -1.0, 0.25])



def test_a_sum_beyond_what_its_devices_clipped_values_allow_is_clamped_and_counted():
    n, bound = 4, 0.5
    bits = fraction_bits(n, bound)
    limit = n * word_limit(bound, bits)
    honest = [encode(np.array([0.5, -0.5, 0.1]), bits, bound) for _ in range(n - 1)]
    total = np.sum(honest, axis=0, dtype=np.uint64)
    values, outside = decode_within(total + encode(np.array([0.5, -0.5, 0.1]), bits, bound), bits, limit)
    assert outside == 0 and np.allclose(values, [2.0, -2.0, 0.4])     # every device at its limit: kept
    # One device puts words of its own choosing in the sum: over the fixed point's whole range,
    # [-2^63, 2^63) / 2^bits, two to four times what every device at its limit adds up to.
    harmful = np.array([1 << 62, 3 << 62, 12345], dtype=np.uint64)      # +2^62, -2^62, a little
    assert 2 * n * bound <= float(decode(np.array([(1 << 63) - 1], dtype=np.uint64), bits)[0]) < 4 * n * bound
    values, outside = decode_within(total + harmful, bits, limit)
    assert outside == 2 and values[0] == n * bound and values[1] == -n * bound
    assert values[2] == pytest.approx(0.3 + 12345 / 2.0 ** bits)


def test_an_honest_sum_at_its_limit_is_never_clamped():
    # Near 2^62 one float64 step is 1,024 words: compared in whole words, every device's entry at
    # the edge of its range still sums to within the limit.
    rng = np.random.default_rng(3)
    for _ in range(2000):
        bound = float(rng.choice([0.05, 0.1, 0.3, 0.7, 1.1, 2.3]))
        weights = [float(w) for w in rng.integers(1, 5000, size=int(rng.integers(2, 11)))]
        bits = fraction_bits(sum(weights), bound)
        sign = float(rng.choice([-1.0, 1.0]))
        total = np.sum([encode(np.clip(np.array([5.0 * sign]), -bound, bound) * w, bits, w * bound) for w in weights],
                       axis=0, dtype=np.uint64)
        _, outside = decode_within(total, bits, sum(word_limit(w * bound, bits) for w in weights))
        assert outside == 0, (bound, weights)

def test_a_range_too_wide_for_64_bit_words_is_refused():
    with pytest.raises(ValueError, match="fraction bits"):
        fraction_bits(1e9, 1e6)


def test_a_sealed_share_verifies_only_unaltered_and_for_its_recipient():
    a, b = new_private_key(), new_private_key()
    key = agree(a, public_key(b), b"p")
    assert key == agree(b, public_key(a), b"p")
    sealed = seal(key, b"share", b"run|1|a|b")
    assert open_sealed(key, sealed, b"run|1|a|b") == b"share"
    with pytest.raises(ShareError):
        open_sealed(key, sealed, b"run|1|a|c")
    with pytest.raises(ShareError):
        open_sealed(key, sealed[:-1] + bytes([sealed[-1] ^ 1]), b"run|1|a|b")


def test_a_low_order_public_key_is_refused():
    with pytest.raises(ShareError):
        check_public_key(bytes(32))


def test_a_device_masks_only_the_blocks_that_at_least_threshold_devices_hold():
    splits = {"a": 1, "b": 2, "c": 3, "d": 3, "e": 4}
    everyone = sorted(splits)
    complete = {d: everyone for d in splits}
    # Blocks 0..2 are held by 5, 4 and 3 devices, block 3 by one: with threshold 3 no device
    # uploads block 3, and the rest keep their cuts.
    assert well_held(splits, everyone, 3) == 3
    assert masked_splits(splits, 3, complete) == {"a": 1, "b": 2, "c": 3, "d": 3, "e": 3}
    assert masked_splits(splits, 2, complete) == {"a": 1, "b": 2, "c": 3, "d": 3, "e": 3}
    assert masked_splits(splits, 5, complete) == {d: 1 for d in splits}
    assert well_held(splits, everyone, 6) == 0 and well_held({}, [], 2) == 0
    same = {d: 4 for d in splits}
    assert masked_splits(same, 5, complete) == same


def test_on_a_sparse_graph_a_device_masks_only_the_blocks_threshold_of_its_neighbourhood_mask():
    # A ring a-b-c-d-e-f-a, one neighbour on each side, threshold 2. a and d, not neighbours, are
    # cut at 2: across the whole roster block 1 has two holders, but neither has a neighbour that
    # holds it, so its block 1 would carry its own mask alone (the Fed Server rebuilds its seed).
    ring = "abcdef"
    hoods = {d: sorted({ring[i - 1], d, ring[(i + 1) % 6]}) for i, d in enumerate(ring)}
    splits = {d: 2 if d in "ad" else 1 for d in ring}
    assert masked_splits(splits, 2, {d: list(ring) for d in ring}) == splits       # the complete graph: kept
    assert masked_splits(splits, 2, hoods) == {d: 1 for d in ring}
    assert unprotected(splits, 2, hoods, set(ring)) == ["a", "d"]
    # b at 2 beside a: a and b mask block 1 together; c at 3 beside b masks only blocks 0 and 1.
    splits = {**splits, "b": 2, "c": 3}
    masked = masked_splits(splits, 2, hoods)
    assert masked == {"a": 2, "b": 2, "c": 2, "d": 2, "e": 1, "f": 1}
    assert unprotected(masked, 2, hoods, set(ring)) == []
    # Lowering one device can leave its neighbour short: with threshold 3, e at 3 keeps block 2 only
    # while d and f do; f is cut at 1, so e falls to d's and its own 2, then further to 1.
    deep = {"a": 1, "b": 1, "c": 1, "d": 3, "e": 3, "f": 1}
    assert masked_splits(deep, 3, hoods) == {d: 1 for d in ring}
    # Among the survivors: with b gone, a's block 1 is masked by a alone of its neighbourhood.
    assert unprotected(masked, 2, hoods, set(ring) - {"b"}) == ["a"]
