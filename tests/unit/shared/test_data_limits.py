"""Size limits on a device's files (shared/data/limits.py, shared/data/local.py): what a file
declares is refused in one line before it is decompressed or decoded."""
from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npformat
from PIL import Image, ImageFile

from shared.data.limits import DEFAULT_MAX_IMAGE_PIXELS, FileLimits, default_max_data_bytes
from shared.data.local import DataError, data_sources, load_image_folder, load_npz
from shared.data.spec import DataSpec, InputTransform

MB = 2 ** 20


def spec(input_shape: list[int], **transform) -> DataSpec:
    return DataSpec(dataset="local", num_classes=3, input_shape=input_shape, input_transform=InputTransform(**transform))


def npy_bytes(header: dict, data: bytes) -> bytes:
    """An npy member: ``header`` (descr, fortran_order, shape) as written by numpy, then ``data``."""
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


def write_members(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def labels(n: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros(n, dtype=np.int64))
    return buf.getvalue()


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The array reads and image decodes that happen (none must, for a refused file)."""
    done: list[str] = []
    read_array, load = npformat.read_array, ImageFile.ImageFile.load
    monkeypatch.setattr(npformat, "read_array", lambda *a, **k: (done.append("read_array"), read_array(*a, **k))[1])
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: (done.append("decode"), load(self))[1])
    return done


# --- .npz -----------------------------------------------------------------------------------------
def test_a_zip_bomb_is_refused_from_its_entry_before_it_is_decompressed(tmp_path, reads):
    # 50 MB of zeros deflate to about 50 KB; the limit is 10 MB.
    f = tmp_path / "bomb.npz"
    np.savez_compressed(f, x=np.zeros((50 * 1024, 1024), dtype=np.uint8), y=np.zeros(50 * 1024, dtype=np.int64))
    assert f.stat().st_size < MB
    with pytest.raises(DataError, match=rf"bomb.npz: array 'x' unpacks to {50 * MB} bytes, over the limit of "
                                        rf"{10 * MB} bytes \(--max-data-bytes\)"):
        load_npz(f, spec([1024]), FileLimits(max_bytes=10 * MB))
    assert reads == []


def test_a_header_claiming_two_to_the_forty_elements_is_one_clear_error(tmp_path, reads):
    # numpy.load allocates what the header declares: 4 TiB, a MemoryError.
    f = write_members(tmp_path / "huge.npz", {
        "x.npy": npy_bytes({"descr": "<f4", "fortran_order": False, "shape": (2 ** 40,)}, b"\0" * 16),
        "y.npy": labels(4)})
    with pytest.raises(DataError, match=r"huge.npz: array 'x' declares shape \[1099511627776\] of float32 "
                                        r"\(4398046511104 bytes\), over the limit of \d+ bytes"):
        load_npz(f, spec([2]))
    assert reads == []


@pytest.mark.parametrize("data, stored", [(b"\0" * 16, 16), (b"\0" * 80, 80)], ids=["short", "long"])
def test_a_header_that_disagrees_with_its_entry_is_refused(tmp_path, reads, data, stored):
    f = write_members(tmp_path / "lies.npz", {
        "x.npy": npy_bytes({"descr": "<f8", "fortran_order": False, "shape": (4, 2)}, data), "y.npy": labels(4)})
    with pytest.raises(DataError, match=rf"lies.npz: array 'x': its header declares 64 bytes \(shape \[4, 2\] of "
                                        rf"float64\) but the archive holds {stored}"):
        load_npz(f, spec([2]))
    assert reads == []


def test_the_limit_is_on_x_and_y_together(tmp_path):
    f = tmp_path / "pair.npz"
    np.savez(f, x=np.zeros((100, 2), dtype=np.float32), y=np.zeros(100, dtype=np.int64))   # 800 + 800 bytes
    assert len(load_npz(f, spec([2]), FileLimits(max_bytes=1600)).y) == 100
    with pytest.raises(DataError, match=r"pair.npz: arrays 'x' and 'y' hold 1600 bytes together, over the limit of 1599"):
        load_npz(f, spec([2]), FileLimits(max_bytes=1599))


def test_a_member_that_is_not_npy_or_damaged_is_one_clear_error(tmp_path):
    f = write_members(tmp_path / "raw.npz", {"x": b"just bytes", "y.npy": labels(2)})
    with pytest.raises(DataError, match=r"raw.npz: array 'x' is not readable \(the magic string is not correct"):
        load_npz(f, spec([2]))
    f = tmp_path / "crc.npz"
    np.savez(f, x=np.arange(64, dtype=np.float64).reshape(32, 2), y=np.zeros(32, dtype=np.int64))
    blob = bytearray(f.read_bytes())
    blob[blob.index(np.arange(64, dtype=np.float64).tobytes()) + 200] ^= 0xFF   # inside x's data: its CRC fails
    f.write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"crc.npz: array 'x' is not readable \(Bad CRC-32"):
        load_npz(f, spec([2]))


def test_the_sources_of_a_data_path_carry_its_limits(tmp_path):
    f = tmp_path / "site.npz"
    np.savez(f, x=np.zeros((100, 2), dtype=np.float32), y=np.zeros(100, dtype=np.int64))
    [source] = data_sources(str(f), FileLimits(max_bytes=1000))
    with pytest.raises(DataError, match="over the limit of 1000 bytes"):
        source.load(spec([2]))
    [source] = data_sources(str(f))
    assert len(source.load(spec([2])).y) == 100


def test_the_byte_limit_defaults_to_a_sixteenth_of_the_memory(monkeypatch):
    mem_total_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:"))
    assert FileLimits().max_bytes == default_max_data_bytes() == mem_total_kib * 1024 // 16

    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr("os.sysconf", unknown)
    assert default_max_data_bytes() == 2 ** 30


# --- images ---------------------------------------------------------------------------------------
def png_claiming(path: Path, width: int, height: int) -> None:
    """A real 4 x 4 PNG whose header (IHDR) says ``width`` x ``height``, its CRC recomputed: it
    cannot be decoded, so a loader that decodes it before checking the size fails otherwise."""
    buf = io.BytesIO()
    Image.new("L", (4, 4), 0).save(buf, format="PNG")
    blob = bytearray(buf.getvalue())
    assert blob[12:16] == b"IHDR"
    blob[16:24] = struct.pack(">II", width, height)
    blob[29:33] = struct.pack(">I", zlib.crc32(bytes(blob[12:29])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(blob))


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(tmp_path, reads):
    png_claiming(tmp_path / "dev" / "0" / "huge.png", 12000, 12000)
    with pytest.raises(DataError, match=r"huge.png: image of 12000 x 12000 = 144000000 pixels, over the limit of "
                                        rf"{DEFAULT_MAX_IMAGE_PIXELS} pixels \(--max-image-pixels\)"):
        load_image_folder(tmp_path / "dev", spec([1, 28, 28], resize=(28, 28)))
    assert reads == []


def test_the_pixel_limit_is_configurable(tmp_path):
    (tmp_path / "dev" / "0").mkdir(parents=True)
    Image.new("L", (40, 30), 0).save(tmp_path / "dev" / "0" / "a.png")
    assert len(load_image_folder(tmp_path / "dev", spec([1, 4, 4], resize=(4, 4)), FileLimits(max_pixels=1200)).y) == 1
    with pytest.raises(DataError, match=r"a.png: image of 40 x 30 = 1200 pixels, over the limit of 1199 pixels"):
        load_image_folder(tmp_path / "dev", spec([1, 4, 4], resize=(4, 4)), FileLimits(max_pixels=1199))


def test_without_resize_an_image_of_another_size_is_refused_from_its_header(tmp_path, reads):
    png_claiming(tmp_path / "dev" / "0" / "wide.png", 3000, 2000)
    with pytest.raises(DataError, match=r"wide.png: field 'x' gives samples of shape \[1, 2000, 3000\] after "
                                        r"data.input_transform, but data.input_shape is \[1, 28, 28\]"):
        load_image_folder(tmp_path / "dev", spec([1, 28, 28]))
    assert reads == []
