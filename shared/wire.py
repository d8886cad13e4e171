"""Wire format: msgpack bodies with tensors as ``{dtype, shape, data}`` maps.

Every byte that crosses the network goes through this module. Tensors travel as their raw
little-endian bytes: :func:`encode_tensor` snapshots them, :func:`pack_body` packs a message
around the snapshots without copying them (clients and servers send its pieces as they are) and
:func:`packb` joins them into one ``bytes`` (a checkpoint, a cached answer);
:func:`decode_tensor` views the bytes msgpack parsed (``numpy.frombuffer`` -> ``torch.from_numpy``)
and reads them once for the finiteness check. Nothing here (or anywhere in the project)
unpickles received bytes.
"""
from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import numpy as np
import torch

# Zero-copy decoding hands torch a read-only numpy view over the message bytes. Torch warns about
# that once per call; the tensors we decode are only ever read (fed into forward, copied into
# parameters with load_state_dict, or used as gradients), never written in place.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "float64": (torch.float64, np.dtype("<f8")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_NAME_OF: dict[torch.dtype, str] = {t: name for name, (t, _) in _DTYPES.items()}
DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES)

#: Largest accepted rank, element count and single dimension of one tensor (guards against absurd shapes).
MAX_RANK = 8
MAX_ELEMENTS = 1 << 31


class WireError(ValueError):
    """A received message or tensor is malformed; the text says what is wrong."""


class _EntryBudget:
    """Counts the map entries and array elements of one message as the parser builds them, and
    stops it past ``limit`` (:func:`unpackb`'s ``max_entries``)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def _spend(self, entries: int) -> None:
        self.used += entries
        if self.used > self.limit:
            raise WireError(f"body holds more than {self.limit} entries")

    def mapping(self, pairs: list[tuple[Any, Any]]) -> dict:
        self._spend(len(pairs))
        return dict(pairs)

    def array(self, items: list) -> list:
        self._spend(len(items))
        return items


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPE_NAMES)}") from None


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """Tensor -> ``{"dtype", "shape", "data"}`` with ``data`` the raw little-endian bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    name = dtype_name(t.dtype)
    arr = t.contiguous().numpy()
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        arr = arr.astype(_DTYPES[name][1])
    # A copy on purpose, the snapshot: the sender may go on updating the tensor in place (the next
    # training step, the Fed Server's next aggregation into a model whose encoded weights it keeps
    # for later answers) before the body is written, and WireTensor holds ``bytes``. It is the only
    # copy of the data on the way out: a Body (pack_body) sends this very object.
    return {"dtype": name, "shape": list(t.shape), "data": arr.tobytes()}


def decode_tensor(
    obj: Any,
    *,
    expect_shape: tuple[int, ...] | list[int] | None = None,
    expect_dtype: str | None = None,
    require_finite: bool = True,
    what: str = "tensor",
) -> torch.Tensor:
    """``{"dtype", "shape", "data"}`` (or a WireTensor) -> read-only tensor viewing the message bytes (no copy).

    Checks structure, byte length, an expected shape/dtype when given, and (for floating types)
    that every value is finite. Raises :class:`WireError` with a reason naming ``what``.
    """
    if hasattr(obj, "dtype") and hasattr(obj, "shape") and hasattr(obj, "data") and not isinstance(obj, (Mapping, torch.Tensor)):
        obj = {"dtype": obj.dtype, "shape": obj.shape, "data": obj.data}  # a validated WireTensor schema object
    if not isinstance(obj, Mapping) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError(f"{what}: expected a map with exactly the keys dtype, shape, data")
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if name not in _DTYPES:
        raise WireError(f"{what}: unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES)}")
    # Each dimension is bounded on its own, not only the product: a shape such as [0, 2**63] has
    # zero elements and zero bytes, so it passes the element and byte checks, yet torch cannot
    # view it (its dimensions overflow int64) and code downstream would index a bogus size.
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in shape
    ):
        raise WireError(f"{what}: shape must be a list of at most {MAX_RANK} integers, each in 0..{MAX_ELEMENTS}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what}: data must be raw bytes")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise WireError(f"{what}: {numel} elements is more than the limit {MAX_ELEMENTS}")
    torch_dtype, np_dtype = _DTYPES[name]
    if len(data) != numel * np_dtype.itemsize:
        raise WireError(
            f"{what}: {len(data)} data bytes do not match shape {list(shape)} of {name} "
            f"({numel * np_dtype.itemsize} bytes expected)"
        )
    if expect_dtype is not None and name != expect_dtype:
        raise WireError(f"{what}: dtype {name} where {expect_dtype} was expected")
    if expect_shape is not None and list(shape) != list(expect_shape):
        raise WireError(f"{what}: shape {list(shape)} where {list(expect_shape)} was expected")
    arr = np.frombuffer(data, dtype=np_dtype) if numel else np.empty(0, dtype=np_dtype)
    tensor = torch.from_numpy(arr).view(*shape) if shape else torch.from_numpy(arr).reshape(())
    if require_finite and tensor.is_floating_point() and numel and not all_finite(tensor):
        raise WireError(f"{what}: contains NaN or Inf")
    return tensor


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a non-empty floating tensor is finite: exact, in one pass, no temporary.

    ``torch.aminmax`` propagates NaN to both results, and an infinity anywhere is the minimum or the
    maximum, so both are finite exactly when every element is; finite values near the dtype's max
    stay finite (unlike a sum, which could overflow). It reads the tensor once and allocates two
    scalars, where ``torch.isfinite(t).all()`` writes a full-size bool tensor and reads it again
    (measured: benchmarks/why-the-code-is-as-it-is.md, "Finiteness in one aminmax pass"). The two
    scalars are read as Python floats (float16's infinities and NaN stay what they are): two 0-d
    ``torch.isfinite`` calls cost more than the pass itself over a step's activation, and each
    torch call on a server's event loop gives up the GIL to the training threads and waits to get
    it back.
    """
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def encode_state(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Ordered map of parameter name -> tensor, in the model's state_dict order."""
    return {name: encode_tensor(t) for name, t in state.items()}


def decode_state(
    obj: Any,
    *,
    expect: Mapping[str, torch.Tensor] | None = None,
    what: str = "state",
) -> dict[str, torch.Tensor]:
    """Decode a model portion; with ``expect``, its keys, shapes and dtypes must match exactly."""
    if not isinstance(obj, Mapping):
        raise WireError(f"{what}: expected a map of parameter name -> tensor")
    if expect is not None:
        check_names(obj, expect, what)
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise WireError(f"{what}: parameter names must be strings")
        ref = expect[key] if expect is not None else None
        out[key] = decode_tensor(
            value,
            expect_shape=tuple(ref.shape) if ref is not None else None,
            expect_dtype=dtype_name(ref.dtype) if ref is not None else None,
            what=f"{what}[{key}]",
        )
    return out


def check_names(obj: Mapping[str, Any], expect: Mapping[str, Any], what: str) -> None:
    """:class:`WireError` unless ``obj`` has exactly ``expect``'s names, in its order."""
    if list(obj) != list(expect):
        missing = [k for k in expect if k not in obj]
        extra = [k for k in obj if k not in expect]
        raise WireError(
            f"{what}: parameter names do not match the expected portion "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )


def check_tensors(state: Mapping[str, torch.Tensor], expect: Mapping[str, torch.Tensor] | None = None,
                  what: str = "state") -> None:
    """The checks :func:`decode_state` makes, on tensors that were never encoded (built by this
    process): each of a dtype the wire carries, finite when floating, and with ``expect`` its names
    (in order), shapes and dtypes. :class:`WireError` naming ``what`` and the tensor otherwise."""
    if expect is not None:
        check_names(state, expect, what)
    for key, t in state.items():
        name = dtype_name(t.dtype)
        ref = expect[key] if expect is not None else None
        if ref is not None and name != dtype_name(ref.dtype):
            raise WireError(f"{what}[{key}]: dtype {name} where {dtype_name(ref.dtype)} was expected")
        if ref is not None and t.shape != ref.shape:
            raise WireError(f"{what}[{key}]: shape {list(t.shape)} where {list(ref.shape)} was expected")
        if t.is_floating_point() and t.numel() and not all_finite(t.detach()):
            raise WireError(f"{what}[{key}]: contains NaN or Inf")


#: Byte strings at least this long travel as their own piece of a :class:`Body` instead of being
#: copied through msgpack's buffer.
_SPLICE_BYTES = 1 << 16  # from here on msgpack's header is bin 32


class Body:
    """A packed message body as its pieces, in order: what is sent without joining them.

    ``b"".join(body)`` (:func:`packb`) is byte for byte ``msgpack.packb(obj, use_bin_type=True)``.
    Each long byte string of the message (a tensor's ``data``) is a piece by itself, the very
    ``bytes`` object :func:`encode_tensor` made, not a copy; everything between two of them is one
    piece packed by msgpack. A body is fixed once packed: its pieces are immutable ``bytes``, and
    the tensor snapshots were taken by ``encode_tensor``.

    Who sends one: ``shared.http_client.SyncClient`` gives it to httpx as ``content=`` (an iterable
    of ``bytes``, written piece by piece, h11 passing each ``bytes`` to the socket as it is) with
    the body's Content-Length (without one, httpx frames an iterable with chunked encoding, which
    joins every piece with its frame: a copy); ``shared.http_client.post_body`` does the same for
    the servers' async uploads and plans; ``http_api.server.MsgpackResponse`` sends each piece as
    an ASGI body message (Starlette's ``Response`` takes one buffer only).
    """

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: tuple[bytes, ...]) -> None:
        self.pieces = pieces
        self.size = sum(map(len, pieces))

    def __len__(self) -> int:
        """The body's length in bytes (its Content-Length)."""
        return self.size

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.pieces)


def pack_body(obj: Any) -> Body:
    """Serialize a message body (plain data with tensors already encoded) without copying tensor data.

    Containers are walked in Python and every other value is packed by one msgpack ``Packer``
    into its buffer; each long byte string ends the current piece (with its bin 32 header) and
    becomes a piece itself. The tensor bytes are thus copied once on the way out, by
    ``encode_tensor``'s snapshot, where ``msgpack.packb`` copies them twice more (into its
    buffer, grown by reallocation, then into the result) and :func:`packb` once more. Joining
    needs a second buffer as large, and glibc returns the pair to the kernel when both are freed,
    so every call faults its 4 KB pages in again; one buffer it keeps for the next call (measured:
    benchmarks/why-the-code-is-as-it-is.md, "Bodies go out in pieces", and, with the snapshot's
    own faults in fresh memory, benchmarks/results/2026-11-24_codec-in-pieces-and-fresh-memory/).
    The walk's cost per small message is that of a Python loop over its keys.
    """
    return Body(tuple(_pieces(obj)))


def packb(obj: Any) -> bytes:
    """Serialize a message body into one ``bytes``: ``msgpack.packb(obj, use_bin_type=True)``.

    For a body that must be one buffer (a checkpoint file, an answer cached for many requests);
    what is sent at once goes as :func:`pack_body`'s pieces and saves this copy.
    """
    return b"".join(_pieces(obj))  # a body of one piece is returned as it is, not copied


def _pieces(obj: Any) -> list[bytes]:
    """The non-empty pieces of ``obj``'s msgpack encoding (see pack_body)."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    pieces: list[bytes] = []
    _pack_pieces(obj, packer, pieces)
    tail = packer.bytes()
    if tail:
        pieces.append(tail)
    return pieces


def _pack_pieces(obj: Any, packer: msgpack.Packer, pieces: list[bytes]) -> None:
    """Pack ``obj`` into ``packer``'s buffer, cutting a piece at each long byte string (see pack_body)."""
    if isinstance(obj, dict):
        packer.pack_map_header(len(obj))
        for key, value in obj.items():
            packer.pack(key)
            _pack_pieces(value, packer, pieces)
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, (dict, list, tuple, bytes)) for x in obj):
        packer.pack_array_header(len(obj))
        for value in obj:
            _pack_pieces(value, packer, pieces)
    elif isinstance(obj, bytes) and _SPLICE_BYTES <= len(obj) <= 0xFFFFFFFF:
        # bin 32, the header msgpack writes for this length, closes the piece before the data
        pieces.append(packer.bytes() + b"\xc6" + len(obj).to_bytes(4, "big"))
        packer.reset()
        pieces.append(obj)
    else:
        packer.pack(obj)


def unpackb(data: bytes | bytearray, *, max_bytes: int | None = None, max_entries: int | None = None) -> Any:
    """Parse a message body; raises :class:`WireError` for anything that is not valid msgpack, or
    that holds more than ``max_entries`` map entries and array elements in all. A message of many
    tiny entries costs the parser (and the schema after it) about as much per entry as one of full
    ones does, at a small part of the bytes: where a body's honest size is known, its entries are
    bounded too, so that no body costs far more to parse than the largest honest one."""
    if max_bytes is not None and len(data) > max_bytes:
        raise WireError(f"body of {len(data)} bytes exceeds the limit of {max_bytes}")
    options: dict[str, Any] = {}
    if max_entries is not None:
        budget = _EntryBudget(max_entries)
        options = {"max_map_len": max_entries, "max_array_len": max_entries,
                   "object_pairs_hook": budget.mapping, "list_hook": budget.array}
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **options)
    except WireError:
        raise
    except msgpack.StackError:   # its message is empty
        raise WireError("body is not valid msgpack: nested too deeply") from None
    except (msgpack.ExtraData, msgpack.FormatError, ValueError, TypeError) as exc:
        raise WireError(f"body is not valid msgpack: {exc}") from None
