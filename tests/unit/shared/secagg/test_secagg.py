"""Secure aggregation's primitives: masks that cancel block by block over the devices that hold a
block, dropped devices' masks removed through their rebuilt keys, the fixed-point range and the AEAD's
verification (Shamir's scheme: test_shamir.py)."""
import os

import numpy as np
import pytest

from shared.secagg.crypto import MASK_PURPOSE, ShareError, agree, check_public_key, new_private_key, open_sealed, public_key, seal
from shared.secagg.encoding import SUM_BITS, decode, decode_within, encode, fraction_bits
from shared.secagg.masks import BlockLayout, add_masks, masked_splits, remove_masks, well_held

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
    honest = [encode(np.array([0.5, -0.5, 0.1]), bits, bound) for _ in range(n - 1)]
    total = np.sum(honest, axis=0, dtype=np.uint64)
    values, outside = decode_within(total + encode(np.array([0.5, -0.5, 0.1]), bits, bound), bits, n * bound)
    assert outside == 0 and np.allclose(values, [2.0, -2.0, 0.4])     # every device at its limit: kept
    # One device puts words of its own choosing in the sum: over the fixed point's whole range,
    # [-2^63, 2^63) / 2^bits, two to four times what every device at its limit adds up to.
    harmful = np.array([1 << 62, 3 << 62, 12345], dtype=np.uint64)      # +2^62, -2^62, a little
    assert 2 * n * bound <= float(decode(np.array([(1 << 63) - 1], dtype=np.uint64), bits)[0]) < 4 * n * bound
    values, outside = decode_within(total + harmful, bits, n * bound)
    assert outside == 2 and values[0] == n * bound and values[1] == -n * bound
    assert values[2] == pytest.approx(0.3 + 12345 / 2.0 ** bits)


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
    # Blocks 0..2 are held by 5, 4 and 3 devices, block 3 by one: with threshold 3 no device
    # uploads block 3, and the rest keep their cuts.
    assert well_held(splits, 3) == 3
    assert masked_splits(splits, 3) == {"a": 1, "b": 2, "c": 3, "d": 3, "e": 3}
    assert masked_splits(splits, 2) == {"a": 1, "b": 2, "c": 3, "d": 3, "e": 3}
    assert masked_splits(splits, 5) == {d: 1 for d in splits}
    assert well_held(splits, 6) == 0 and well_held({}, 2) == 0
    same = {d: 4 for d in splits}
    assert masked_splits(same, 5) == same
