"""Unit tests for shared.wire: bit-exact, zero-copy tensor transport and strict validation."""
from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch

from shared.schemas import WireTensor
from shared.wire import (
    DTYPE_NAMES,
    MAX_ELEMENTS,
    WireError,
    decode_state,
    decode_tensor,
    encode_state,
    encode_tensor,
    packb,
    unpackb,
)

# The zero-copy decode hands torch a read-only numpy view; torch warns once (expected, see wire.py).
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

ROUND_TRIP_DTYPES = [torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        # Include awkward values: negative zero, subnormals, extremes of the type.
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        flat = t.reshape(-1)
        if flat.numel() >= 4:
            info = torch.finfo(dtype)
            flat[0] = -0.0
            flat[1] = info.tiny / 2 if dtype != torch.float16 else 2.0 ** -24
            flat[2] = info.max
            flat[3] = info.min
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen, dtype=torch.int64).to(dtype)
    flat = t.reshape(-1)
    if flat.numel() >= 2:
        flat[0] = info.min
        flat[1] = info.max
    return t


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _round_trip(t: torch.Tensor, **kwargs) -> torch.Tensor:
    body = packb({"t": encode_tensor(t)})
    return decode_tensor(unpackb(body)["t"], **kwargs)


# ------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4), (1, 1, 5, 2)], ids=str)
def test_round_trip_is_bit_exact(dtype, shape):
    t = _sample(dtype, shape)
    out = _round_trip(t)
    assert out.dtype == dtype
    assert tuple(out.shape) == shape
    assert _bits(out) == _bits(t)
    if dtype.is_floating_point:
        # -0.0 must survive as -0.0 (bitwise check above), and values compare equal.
        assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_round_trip_of_non_contiguous_tensors(dtype):
    base = _sample(dtype, (4, 6, 5), seed=3)
    views = [base.transpose(0, 2), base[:, ::2, 1:], base[..., 1], base.expand(2, 4, 6, 5)]
    for view in views:
        assert not view.is_contiguous()
        out = _round_trip(view)
        assert tuple(out.shape) == tuple(view.shape)
        assert torch.equal(out, view)
        assert _bits(out) == _bits(view)


def test_encoded_form_is_raw_little_endian_bytes():
    t = torch.tensor([[1.0, -2.5], [3.0, 0.125]])
    enc = encode_tensor(t)
    assert set(enc) == {"dtype", "shape", "data"}
    assert enc["dtype"] == "float32" and enc["shape"] == [2, 2]
    assert enc["data"] == np.array([1.0, -2.5, 3.0, 0.125], dtype="<f4").tobytes()


def test_requires_grad_tensor_is_encoded_detached():
    t = torch.randn(3, requires_grad=True)
    out = _round_trip(t * 2)
    assert not out.requires_grad
    assert torch.equal(out, (t * 2).detach())


def test_every_advertised_dtype_round_trips():
    names = {encode_tensor(torch.zeros(2, dtype=getattr(torch, n)))["dtype"] for n in DTYPE_NAMES}
    assert names == set(DTYPE_NAMES)


def test_unsupported_torch_dtype_is_rejected_on_encode():
    with pytest.raises(WireError, match="complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


# ------------------------------------------------------------------------------------ zero copy
def _buffer_span(data: bytes) -> tuple[int, int]:
    start = np.frombuffer(data, dtype=np.uint8).ctypes.data
    return start, start + len(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool], ids=str)
def test_decode_is_zero_copy(dtype):
    t = _sample(dtype, (4, 8))
    obj = unpackb(packb(encode_tensor(t)))
    data = obj["data"]
    assert isinstance(data, bytes)
    out = decode_tensor(obj)
    lo, hi = _buffer_span(data)
    assert lo <= out.data_ptr() and out.data_ptr() + out.numel() * out.element_size() <= hi
    assert np.shares_memory(out.numpy(), np.frombuffer(data, dtype=np.uint8))


def test_decode_zero_d_is_zero_copy():
    obj = unpackb(packb(encode_tensor(torch.tensor(3.5))))
    out = decode_tensor(obj)
    lo, hi = _buffer_span(obj["data"])
    assert out.shape == () and float(out) == 3.5
    assert lo <= out.data_ptr() < hi


# ------------------------------------------------------------------------------------ finiteness
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_is_rejected_by_default(dtype, bad):
    t = torch.ones(5, dtype=dtype)
    t[3] = bad
    with pytest.raises(WireError, match="NaN or Inf"):
        _round_trip(t)


def test_non_finite_zero_d_is_rejected():
    with pytest.raises(WireError, match="NaN or Inf"):
        _round_trip(torch.tensor(float("nan")))


@pytest.mark.parametrize("payload", [0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001], ids=hex)
def test_nan_payload_bits_are_irrelevant(payload):
    # Any NaN, whatever its payload or sign bits (quiet or signalling), is rejected; with
    # require_finite=False the exact bits come through untouched.
    bits = np.array([0x3F800000, payload], dtype="<u4")
    t = torch.from_numpy(bits.view("<f4").copy())
    assert torch.isnan(t[1])
    with pytest.raises(WireError, match="NaN or Inf"):
        _round_trip(t)
    out = _round_trip(t, require_finite=False)
    assert out.numpy().view("<u4").tolist() == bits.tolist()


def test_require_finite_false_lets_inf_and_nan_through():
    t = torch.tensor([1.0, math.inf, -math.inf, math.nan])
    out = _round_trip(t, require_finite=False)
    assert _bits(out) == _bits(t)


def test_integers_are_never_checked_for_finiteness():
    out = _round_trip(torch.tensor([torch.iinfo(torch.int64).max, -1]))
    assert out.tolist() == [torch.iinfo(torch.int64).max, -1]


# ------------------------------------------------------------------------------------ decode errors
def _good() -> dict:
    return encode_tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3))


@pytest.mark.parametrize(
    "obj",
    [
        {"dtype": "float32", "shape": [2, 3]},
        {**_good(), "extra": 1},
        {"type": "float32", "shape": [2, 3], "data": b"\0" * 24},
        [1, 2, 3],
        b"\0" * 24,
        None,
    ],
    ids=["missing", "extra", "renamed", "list", "bytes", "none"],
)
def test_wrong_keys_or_type_is_rejected(obj):
    with pytest.raises(WireError, match="exactly the keys dtype, shape, data"):
        decode_tensor(obj, what="fx")


def test_error_names_what():
    with pytest.raises(WireError, match=r"^activation: "):
        decode_tensor({"dtype": "float32"}, what="activation")


@pytest.mark.parametrize("name", ["complex64", "float", "bfloat16", "", 5, None])
def test_unknown_dtype_is_rejected(name):
    with pytest.raises(WireError, match="unsupported dtype"):
        decode_tensor({**_good(), "dtype": name})


@pytest.mark.parametrize("delta", [-1, 1, -24, 4])
def test_byte_length_mismatch_is_rejected(delta):
    obj = _good()
    data = obj["data"]
    obj["data"] = data[:delta] if delta < 0 else data + b"\0" * delta
    with pytest.raises(WireError, match=r"data bytes do not match shape \[2, 3\] of float32 \(24 bytes expected\)"):
        decode_tensor(obj)


def test_byte_length_mismatch_for_zero_d_and_empty():
    with pytest.raises(WireError, match="do not match"):
        decode_tensor({"dtype": "float32", "shape": [], "data": b""})
    with pytest.raises(WireError, match="do not match"):
        decode_tensor({"dtype": "int64", "shape": [0, 4], "data": b"\0" * 8})


@pytest.mark.parametrize(
    "shape",
    [[-1, 6], [2, -3], [2.0, 3], ["2", 3], [True, 6], [None], "23", 6, [1] * 9],
    ids=["neg0", "neg1", "float", "str", "bool", "none", "string", "int", "rank9"],
)
def test_bad_shape_is_rejected(shape):
    with pytest.raises(WireError, match="shape must be a list"):
        decode_tensor({**_good(), "shape": shape})


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
@pytest.mark.parametrize("shape", [[0, 1 << 63], [1 << 63, 0], [0, (1 << 64) - 1], [0, MAX_ELEMENTS + 1],
                                   [MAX_ELEMENTS + 1, 0, 0]], ids=str)
def test_zero_element_shape_with_a_huge_dimension_is_rejected(dtype, shape):
    # Zero elements and zero bytes pass the element and byte checks; the dimension itself must not.
    with pytest.raises(WireError, match="shape must be a list"):
        decode_tensor({"dtype": dtype, "shape": shape, "data": b""})


def test_largest_dimension_with_zero_elements_decodes():
    out = decode_tensor({"dtype": "float32", "shape": [0, MAX_ELEMENTS], "data": b""})
    assert tuple(out.shape) == (0, MAX_ELEMENTS) and out.numel() == 0


def test_data_must_be_bytes():
    with pytest.raises(WireError, match="raw bytes"):
        decode_tensor({**_good(), "data": list(range(24))})
    with pytest.raises(WireError, match="raw bytes"):
        decode_tensor({**_good(), "data": "x" * 24})


def test_huge_element_count_is_rejected_before_allocation():
    with pytest.raises(WireError, match="more than the limit"):
        decode_tensor({"dtype": "uint8", "shape": [1 << 16, 1 << 16], "data": b""})


def test_expect_shape_mismatch():
    with pytest.raises(WireError, match=r"shape \[2, 3\] where \[3, 2\] was expected"):
        decode_tensor(_good(), expect_shape=(3, 2))
    assert decode_tensor(_good(), expect_shape=(2, 3)).shape == (2, 3)
    assert decode_tensor(_good(), expect_shape=[2, 3]).shape == (2, 3)


def test_expect_dtype_mismatch():
    with pytest.raises(WireError, match="dtype float32 where float16 was expected"):
        decode_tensor(_good(), expect_dtype="float16")
    assert decode_tensor(_good(), expect_dtype="float32").dtype == torch.float32


def test_inf_is_rejected_with_a_named_message():
    with pytest.raises(WireError, match=r"^dfx: contains NaN or Inf$"):
        decode_tensor(encode_tensor(torch.tensor([0.0, math.inf])), what="dfx")


# ------------------------------------------------------------------------------------ WireTensor
def test_wire_tensor_schema_rejects_byte_length_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        WireTensor(dtype="float32", shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(ValueError, match="unsupported dtype"):
        WireTensor(dtype="complex64", shape=[1], data=b"\0" * 8)
    with pytest.raises(ValueError, match="non-negative"):
        WireTensor(dtype="uint8", shape=[-1], data=b"")


def test_decode_tensor_accepts_a_wire_tensor_object():
    t = torch.randn(3, 4)
    wt = WireTensor.model_validate(unpackb(packb(encode_tensor(t))))
    out = decode_tensor(wt, expect_shape=(3, 4), expect_dtype="float32")
    assert torch.equal(out, t)
    # and still validates its content
    bad = WireTensor.model_validate(encode_tensor(torch.tensor([math.nan])))
    with pytest.raises(WireError, match="NaN or Inf"):
        decode_tensor(bad)


# ------------------------------------------------------------------------------------ state
def _state() -> dict[str, torch.Tensor]:
    return {
        "blocks.a.weight": torch.randn(4, 3),
        "blocks.a.bias": torch.randn(4),
        "blocks.bn.num_batches_tracked": torch.tensor(7),
    }


def test_state_round_trip_preserves_order_and_bits():
    state = _state()
    out = decode_state(unpackb(packb(encode_state(state))), expect=state)
    assert list(out) == list(state)
    for k in state:
        assert out[k].dtype == state[k].dtype
        assert _bits(out[k]) == _bits(state[k])


def test_state_without_expect_accepts_any_keys():
    out = decode_state(unpackb(packb(encode_state({"x": torch.ones(2)}))))
    assert list(out) == ["x"]


def test_state_missing_key_is_rejected():
    state = _state()
    enc = encode_state(state)
    del enc["blocks.a.bias"]
    with pytest.raises(WireError, match=r"missing \['blocks.a.bias'\]"):
        decode_state(enc, expect=state)


def test_state_extra_key_is_rejected():
    state = _state()
    enc = encode_state({**state, "blocks.z.weight": torch.ones(1)})
    with pytest.raises(WireError, match=r"unexpected \['blocks.z.weight'\]"):
        decode_state(enc, expect=state)


def test_state_reordered_keys_are_rejected():
    state = _state()
    reordered = dict(reversed(list(state.items())))
    with pytest.raises(WireError, match="parameter names do not match"):
        decode_state(unpackb(packb(encode_state(reordered))), expect=state)


def test_state_wrong_shape_is_rejected_and_names_the_key():
    state = _state()
    enc = encode_state({**state, "blocks.a.weight": torch.randn(3, 4)})
    with pytest.raises(WireError, match=r"state\[blocks.a.weight\]: shape \[3, 4\] where \[4, 3\] was expected"):
        decode_state(enc, expect=state)


def test_state_wrong_dtype_is_rejected():
    state = _state()
    enc = encode_state({**state, "blocks.a.bias": state["blocks.a.bias"].double()})
    with pytest.raises(WireError, match="float64 where float32 was expected"):
        decode_state(enc, expect=state)


def test_state_non_finite_is_rejected():
    state = _state()
    enc = encode_state({**state, "blocks.a.bias": torch.tensor([0.0, 1.0, math.inf, 0.0])})
    with pytest.raises(WireError, match="NaN or Inf"):
        decode_state(enc, expect=state)


def test_state_must_be_a_map():
    with pytest.raises(WireError, match="expected a map"):
        decode_state([encode_tensor(torch.ones(1))])


# ------------------------------------------------------------------------------------ packb / unpackb
def test_pack_round_trip_of_plain_data():
    msg = {"a": 1, "b": [1.5, "x", None, True], "c": {"d": b"\x00\x01"}}
    assert unpackb(packb(msg)) == msg


@pytest.mark.parametrize("garbage", [b"\xc1", b"\xc1\xc1\xc1garbage", b"\xd4"], ids=["c1", "c1-more", "fixext-trunc"])
def test_unpack_rejects_garbage(garbage):
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(garbage)



def test_unpack_says_a_body_nested_too_deeply_is():
    with pytest.raises(WireError, match="^body is not valid msgpack: nested too deeply$"):
        unpackb(b"\x91" * 100_000 + b"\xc0")      # a list in a list in ... nil

def test_unpack_rejects_empty_body():
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(b"")


@pytest.mark.parametrize("cut", [1, 5, 20, -1])
def test_unpack_rejects_truncated(cut):
    body = packb({"t": encode_tensor(torch.randn(8)), "k": "value"})
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(body[:cut])


def test_unpack_rejects_trailing_data():
    body = packb({"a": 1})
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(body + b"\x00")
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(body + body)


def test_unpack_rejects_non_string_map_keys():
    with pytest.raises(WireError, match="not valid msgpack"):
        unpackb(msgpack.packb({1: 2}))


def test_unpack_enforces_max_bytes():
    body = packb({"data": b"\0" * 100})
    assert unpackb(body, max_bytes=len(body)) == {"data": b"\0" * 100}
    with pytest.raises(WireError, match=f"body of {len(body)} bytes exceeds the limit of {len(body) - 1}"):
        unpackb(body, max_bytes=len(body) - 1)


def test_rank_eight_is_the_largest_accepted():
    ones = [1] * 8
    assert decode_tensor({"dtype": "uint8", "shape": ones, "data": b"\x07"}).shape == (1,) * 8
    with pytest.raises(WireError, match="at most 8 integers"):
        decode_tensor({"dtype": "uint8", "shape": ones + [1], "data": b"\x07"})


def test_decode_options_are_keyword_only():
    obj = encode_tensor(torch.zeros(2))
    with pytest.raises(TypeError):
        decode_tensor(obj, (2,))
    with pytest.raises(TypeError):
        decode_state({"w": obj}, {"w": torch.zeros(2)})


def test_a_names_mismatch_lists_at_most_five_of_each():
    expect = {f"k{i}": torch.zeros(1) for i in range(6)}
    with pytest.raises(WireError) as info:
        decode_state({}, expect=expect)
    assert "missing ['k0', 'k1', 'k2', 'k3', 'k4'], unexpected [])" in str(info.value)


@pytest.mark.parametrize("sent, expected", [("float32", "float64"), ("float64", "float32"), ("int64", "int8"),
                                            ("int8", "int64")])
def test_a_dtype_mismatch_is_refused_in_both_directions(sent, expected):
    obj = encode_tensor(torch.zeros(2, dtype=getattr(torch, sent)))
    with pytest.raises(WireError, match=f"dtype {sent} where {expected} was expected"):
        decode_tensor(obj, expect_dtype=expected)
    with pytest.raises(WireError, match=r"shape \[2\] where \[1\] was expected"):
        decode_tensor(obj, expect_shape=[1])
    with pytest.raises(WireError, match=r"shape \[2\] where \[3\] was expected"):
        decode_tensor(obj, expect_shape=[3])


def test_the_element_limit_is_two_to_the_31():
    # 2**30 + 1 elements are within the limit: the message is about the bytes, not the count.
    with pytest.raises(WireError, match="0 data bytes do not match shape"):
        decode_tensor({"dtype": "uint8", "shape": [2**30 + 1], "data": b""})
    with pytest.raises(WireError, match="0 data bytes do not match shape"):   # the limit itself is allowed
        decode_tensor({"dtype": "uint8", "shape": [2**31], "data": b""})
    with pytest.raises(WireError, match="more than the limit 2147483648"):
        decode_tensor({"dtype": "uint8", "shape": [2**31, 2], "data": b""})


def test_a_body_below_the_byte_limit_is_parsed():
    body = packb({"a": [1, 2, 3]})
    assert unpackb(body, max_bytes=len(body) + 100) == {"a": [1, 2, 3]}
    assert unpackb(body, max_bytes=len(body)) == {"a": [1, 2, 3]}


# --- check_tensors: the checks on tensors this process built (never encoded) -------------------

def test_built_tensors_are_checked_for_names_dtypes_shapes_and_finiteness():
    from shared.wire import check_tensors
    expect = {"w": torch.zeros(3, 4), "n": torch.zeros(2, dtype=torch.int64), "e": torch.zeros(0)}
    check_tensors({"w": torch.ones(3, 4), "n": torch.tensor([1, 2]), "e": torch.zeros(0)}, expect)   # fine
    with pytest.raises(WireError, match=r"state\[w\]: shape \[3, 3\] where \[3, 4\] was expected"):
        check_tensors({"w": torch.ones(3, 3), "n": torch.tensor([1, 2]), "e": torch.zeros(0)}, expect)
    with pytest.raises(WireError, match=r"update\[w\]: contains NaN or Inf"):
        check_tensors({"w": torch.tensor([1.0, math.nan])}, what="update")
    with pytest.raises(WireError, match=r"unexpected \['a', 'b', 'c', 'd', 'e'\]\)"):
        check_tensors({k: torch.zeros(1) for k in "abcdef"}, {})


def test_a_message_of_more_entries_than_its_budget_is_refused_however_they_nest():
    message = {"a": [1, 2, {"b": [3, 4]}], "c": {}}
    assert unpackb(msgpack.packb(message), max_entries=8) == message   # 2 + 3 + 1 + 2 entries
    for too_many in ({"a": list(range(9))}, {"a": [{"b": 1}] * 4}, {format(i, "x"): 0 for i in range(9)}):
        with pytest.raises(WireError, match="8"):
            unpackb(msgpack.packb(too_many), max_entries=8)
    assert len(unpackb(msgpack.packb({"a": list(range(10_000))}))["a"]) == 10_000   # no budget, no limit
