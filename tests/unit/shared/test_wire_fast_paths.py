"""Unit tests for shared.wire's fast paths: the one-pass finiteness check and the bodies packed in pieces.

Both must be exact: ``all_finite`` refuses NaN/inf wherever it sits (including the edges of the
vectorised inner loops) and never refuses a finite value, however large; ``pack_body``'s pieces and
``packb`` produce the same bytes as ``msgpack.packb`` for every shape of message.
"""
from __future__ import annotations

import math

import msgpack
import pytest
import torch

from shared.wire import WireError, all_finite, decode_tensor, encode_state, encode_tensor, pack_body, packb, unpackb

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

FLOAT_DTYPES = [torch.float16, torch.float32, torch.float64]
BAD_VALUES = [math.nan, math.inf, -math.inf]
# Lengths around vector widths (8/16/32/64 lanes) and a large tensor whose inner loop runs in blocks.
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4099, (1 << 18) + 3]


def _positions(n: int) -> list[int]:
    """First, last, middle and every lane/block boundary inside a tensor of ``n`` elements."""
    edges = {0, n - 1, n // 2}
    for width in (8, 16, 32, 64, 1024, 4096, 32768, 65536):
        edges.update(p for p in (width - 1, width, width + 1) if p < n)
    return sorted(edges)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_all_finite_refuses_nan_and_inf_at_every_position(dtype, n):
    base = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(dtype)
    assert all_finite(base)
    for pos in _positions(n):
        for bad in BAD_VALUES:
            t = base.clone()
            t[pos] = bad
            assert not all_finite(t), (pos, bad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_all_finite_accepts_values_at_the_dtype_limits(dtype):
    info = torch.finfo(dtype)
    # A sum of these would overflow to inf; every element is still finite and must be accepted.
    t = torch.tensor([info.max, info.max, -info.max, info.min, info.tiny, -0.0, 0.0] * 1000, dtype=dtype)
    assert all_finite(t)
    assert all_finite(torch.full((1,), info.max, dtype=dtype))
    assert all_finite(torch.tensor(info.min, dtype=dtype))  # 0-d


def test_all_finite_refuses_a_tensor_of_only_nan():
    assert not all_finite(torch.full((100,), math.nan))


@pytest.mark.parametrize("pos", [0, 1 << 19, (1 << 20) - 1])
def test_decode_refuses_one_nan_in_a_large_tensor(pos):
    t = torch.zeros(1 << 20)
    t[pos] = math.nan
    obj = unpackb(packb({"t": encode_tensor(t)}))["t"]
    with pytest.raises(WireError, match="NaN or Inf"):
        decode_tensor(obj)


def test_all_finite_of_a_strided_view_checks_exactly_its_elements():
    t = torch.zeros(64, 64)
    t[63, 62] = math.inf
    assert not all_finite(t[:, ::2])  # even columns: holds the inf
    assert all_finite(t[:, 1::2])  # odd columns: only zeros


# ------------------------------------------------------------------------------------ packb splicing
def _messages() -> list[object]:
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(64, 32, 14, 14, generator=gen)
    return [
        {"fx": encode_tensor(big)},
        {"weights": encode_state({"a.weight": torch.randn(300, 300, generator=gen), "a.bias": torch.randn(300, generator=gen)}),
         "round": 3, "loss": 0.25, "ok": True, "none": None, "name": "x"},
        [encode_tensor(big), encode_tensor(torch.zeros(3))],
        ({"nested": [[b"\x01" * 70000, b"\x02"], {"k": (1, 2.5, "s")}]},),
        {"at_threshold": b"\x00" * (1 << 16), "below": b"\x00" * ((1 << 16) - 1), "bytearray": bytearray(1 << 17)},
        {"empty_map": {}, "empty_list": [], "list_of_numbers": list(range(1000)), "neg": -(2**40)},
        b"\x07" * 100_000,
        "plain",
        42,
    ]


@pytest.mark.parametrize("obj", _messages(), ids=lambda o: type(o).__name__)
def test_packb_is_byte_for_byte_msgpack(obj):
    assert packb(obj) == msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("obj", _messages(), ids=lambda o: type(o).__name__)
def test_a_body_s_pieces_are_byte_for_byte_msgpack(obj):
    body = pack_body(obj)
    expected = msgpack.packb(obj, use_bin_type=True)
    assert b"".join(body) == expected
    assert len(body) == len(expected)
    assert all(isinstance(piece, bytes) and piece for piece in body)


def test_a_body_holds_the_tensor_snapshots_themselves_between_packed_pieces():
    gen = torch.Generator().manual_seed(3)
    fx, small = encode_tensor(torch.randn(64, 32, 14, 14, generator=gen)), encode_tensor(torch.randn(10, generator=gen))
    weights = encode_state({"a": torch.randn(300, 300, generator=gen), "b": torch.randn(300, generator=gen)})
    body = pack_body({"fx": fx, "small": small, "weights": weights, "round": 3})
    # Only the long byte strings are pieces of their own, and they are the very objects encode_tensor
    # made (no copy); the packed values around them are one piece each.
    assert [piece is fx["data"] or piece is weights["a"]["data"] for piece in body.pieces] == [False, True, False, True, False]
    assert small["data"] in body.pieces[2] and weights["b"]["data"] in body.pieces[4]


def test_a_body_is_fixed_once_packed_even_if_the_tensor_changes():
    t = torch.zeros(1 << 16)
    body = pack_body({"t": encode_tensor(t)})
    t += 1  # the next training step, in place
    assert torch.equal(decode_tensor(unpackb(b"".join(body))["t"]), torch.zeros(1 << 16))


def test_a_body_of_only_small_values_is_one_piece():
    assert pack_body({"a": 1, "b": [1, 2], "c": b"\x00" * 100}).pieces == (msgpack.packb({"a": 1, "b": [1, 2], "c": b"\x00" * 100}),)


def test_packb_round_trips_a_large_tensor_bit_exactly():
    t = torch.randn(4, 1024, 1024, generator=torch.Generator().manual_seed(2))
    body = packb({"fx": encode_tensor(t)})
    assert body == msgpack.packb({"fx": encode_tensor(t)}, use_bin_type=True)
    assert torch.equal(decode_tensor(unpackb(body)["fx"]), t)


def test_packb_still_refuses_what_msgpack_refuses():
    with pytest.raises(TypeError):
        packb({"t": torch.zeros(2)})
