"""Local data loaders (shared/data/local.py): each source, the input transform, each bad input."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shared.data.limits import FileLimits
from shared.data.local import (
    DataError, apply_input_transform, data_sources, device_sources, load_csv, load_image_folder, load_local, load_npz,
    to_layout,
)
from shared.data.spec import DataSpec, InputTransform


def spec(input_shape: list[int], num_classes: int = 3, label_column: str = "label", **transform) -> DataSpec:
    return DataSpec(dataset="local", num_classes=num_classes, input_shape=input_shape, label_column=label_column,
                    input_transform=InputTransform(**transform))


def write_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def write_png(path: Path, value: int, size: tuple[int, int] = (4, 4), mode: str = "L") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, value, value)).save(path)


# --- npz ------------------------------------------------------------------------------------------
def test_npz_tabular_with_mean_std(tmp_path):
    x = np.arange(12, dtype=np.float64).reshape(4, 3)
    f = write_npz(tmp_path / "d.npz", x=x, y=np.array([0, 1, 2, 1]))
    ds = load_npz(f, spec([3], mean=[1.0], std=[2.0]))
    assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    assert torch.allclose(ds.x, torch.from_numpy((x - 1.0) / 2.0).float())
    assert ds.label_counts().tolist() == [1, 2, 1]


@pytest.mark.parametrize("raw_shape", [(5, 6, 7), (5, 6, 7, 3), (5, 3, 6, 7)])
def test_npz_image_layouts_become_channels_first(tmp_path, raw_shape):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=raw_shape).astype(np.uint8)
    channels = 1 if len(raw_shape) == 3 else 3
    f = write_npz(tmp_path / "d.npz", x=x, y=np.zeros(5, dtype=np.int32))
    ds = load_npz(f, spec([channels, 6, 7], scale=1 / 255))
    assert tuple(ds.x.shape) == (5, channels, 6, 7)
    expect = x if len(raw_shape) == 3 else (np.moveaxis(x, 3, 1) if raw_shape[3] == 3 else x)
    assert torch.allclose(ds.x.reshape(5, -1), torch.from_numpy(expect.reshape(5, -1) / 255).float())


def test_npz_resize_and_per_channel_normalisation(tmp_path):
    x = np.full((2, 8, 8, 3), 255, dtype=np.uint8)
    x[..., 1] = 0
    f = write_npz(tmp_path / "d.npz", x=x, y=np.array([0, 1]))
    ds = load_npz(f, spec([3, 4, 4], resize=(4, 4), scale=1 / 255, mean=[0.5, 0.5, 0.0], std=[0.5, 0.5, 1.0]))
    assert tuple(ds.x.shape) == (2, 3, 4, 4)
    assert torch.allclose(ds.x[:, 0], torch.ones(2, 4, 4)) and torch.allclose(ds.x[:, 1], -torch.ones(2, 4, 4))
    assert torch.allclose(ds.x[:, 2], torch.ones(2, 4, 4))


def test_apply_input_transform_rejects_resize_of_tabular():
    with pytest.raises(DataError, match="resize"):
        apply_input_transform(torch.zeros(2, 5), InputTransform(resize=(2, 2)))


def test_to_layout_refuses_other_image_ranks():
    with pytest.raises(DataError, match="'x'"):
        to_layout(np.zeros((2, 3, 4, 5, 6)), [3, 4, 5], "f.npz")


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((3, 2))}, r"missing array 'y'"),
    ({"y": np.zeros(3, dtype=int)}, r"missing array 'x'"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(3)}, r"field 'y' must hold integer class labels, got dtype float64"),
    ({"x": np.zeros((3, 2)), "y": np.zeros((3, 1), dtype=int)}, r"field 'y' must be one label per sample"),
    ({"x": np.zeros((3, 2)), "y": np.array([0, 1, 3])}, r"field 'y' has labels 0\.\.3, outside 0\.\.2"),
    ({"x": np.zeros((3, 2)), "y": np.array([0, -1, 1])}, r"field 'y' has labels -1\.\.1"),
    ({"x": np.array([[0.0, 1.0], [np.nan, 0.0], [0.0, 0.0]]), "y": np.zeros(3, dtype=int)},
     r"field 'x' holds NaN or infinite values \(first in sample 1\)"),
    ({"x": np.array([[0.0, np.inf]]), "y": np.zeros(1, dtype=int)}, r"NaN or infinite"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(2, dtype=int)}, r"'x' and 'y' differ in length \(3 samples, 2 labels\)"),
    ({"x": np.zeros((0, 2)), "y": np.zeros(0, dtype=int)}, r"no samples"),
    ({"x": np.zeros((3, 4)), "y": np.zeros(3, dtype=int)}, r"field 'x' has shape \[3, 4\], expected \[N, 2\]"),
    ({"x": np.array([["a", "b"]]), "y": np.zeros(1, dtype=int)}, r"field 'x' must be numeric"),
])
def test_npz_bad_contents_name_file_and_field(tmp_path, arrays, message):
    f = write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=message) as info:
        load_npz(f, spec([2]))
    assert str(f) in str(info.value)


def test_npz_missing_empty_corrupt_and_npy(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_npz(tmp_path / "nope.npz", spec([2]))
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(DataError, match="empty.npz: data file is empty"):
        load_npz(tmp_path / "empty.npz", spec([2]))
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match="junk.npz: not a readable .npz file"):
        load_npz(tmp_path / "junk.npz", spec([2]))
    np.save(tmp_path / "one.npy", np.zeros((3, 2)))
    with pytest.raises(DataError, match="one.npy: not an .npz archive"):
        load_npz(tmp_path / "one.npy", spec([2]))


def test_npz_object_array_is_refused_not_unpickled(tmp_path):
    f = tmp_path / "obj.npz"
    np.savez(f, x=np.array([object(), object()], dtype=object), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match="obj.npz: array 'x' has dtype object, which holds Python objects: refused"):
        load_npz(f, spec([2]))


def test_image_shape_mismatch_names_field(tmp_path):
    f = write_npz(tmp_path / "d.npz", x=np.zeros((2, 5, 5), dtype=np.uint8), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match=r"d.npz: field 'x' has shape \[2, 1, 5, 5\], expected \[N, 1, 6, 6\]"):
        load_npz(f, spec([1, 6, 6]))
    # With a resize any height and width will do, but not another channel count; a resize to
    # another size than input_shape's is still caught after the transform.
    assert tuple(load_npz(f, spec([1, 6, 6], resize=(6, 6))).x.shape) == (2, 1, 6, 6)
    g = write_npz(tmp_path / "rgb.npz", x=np.zeros((2, 2, 5, 5), dtype=np.uint8), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match=r"has shape \[2, 2, 5, 5\], expected \[N, 3, H, W\] .*any H and W"):
        load_npz(g, spec([3, 6, 6], resize=(6, 6)))
    with pytest.raises(DataError, match=r"gives samples of shape \[1, 4, 4\] after data.input_transform"):
        load_npz(f, spec([1, 6, 6], resize=(4, 4)))


def test_a_transposed_table_is_blamed_on_its_shape_before_the_transform(tmp_path):
    # 5 features of 3 samples saved as [5, 3]: y has 3 labels, so only the shape is wrong. The
    # transform's per-feature mean would have refused it first, naming itself.
    f = write_npz(tmp_path / "t.npz", x=np.zeros((5, 3)), y=np.zeros(5, dtype=int))
    with pytest.raises(DataError, match=r"t.npz: field 'x' has shape \[5, 3\], expected \[N, 5\]"):
        load_npz(f, spec([5], mean=[0.0] * 5, std=[1.0] * 5))


# --- csv -----------------------------------------------------------------------------------------
def write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_csv_features_in_header_order_around_the_label_column(tmp_path):
    f = write_csv(tmp_path / "d.csv", "a, kind ,b\n1.5,2,-3\n\n4,0,5e-1\n")
    ds = load_csv(f, spec([2], label_column="kind", mean=[1.0], std=[0.5]))
    assert ds.y.tolist() == [2, 0]
    assert torch.allclose(ds.x, (torch.tensor([[1.5, -3.0], [4.0, 0.5]]) - 1.0) / 0.5)
    assert load_local(str(f), spec([2], label_column="kind"), {}).y.tolist() == [2, 0]


def test_csv_rows_become_samples_of_input_shape(tmp_path):
    # A flattened 2x2 grey image per row (the usual layout of image data sets as CSV).
    f = write_csv(tmp_path / "d.csv", "label,p0,p1,p2,p3\n1,0,255,255,0\n")
    ds = load_csv(f, spec([1, 2, 2], scale=1 / 255))
    assert tuple(ds.x.shape) == (1, 1, 2, 2) and ds.x[0, 0].tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_csv_reads_more_rows_than_one_block(tmp_path, monkeypatch):
    monkeypatch.setattr("shared.data.local._CSV_BLOCK_CELLS", 9)
    f = write_csv(tmp_path / "d.csv", "x,label\n" + "".join(f"{i},{i % 3}\n" for i in range(10)) + "7,oops\n")
    with pytest.raises(DataError, match=r"line 12, column 'label': 'oops' is not an integer class label"):
        load_csv(f, spec([1]))
    f = write_csv(tmp_path / "d.csv", "x,label\n" + "".join(f"{i},{i % 3}\n" for i in range(10)))
    ds = load_csv(f, spec([1]))
    assert ds.x[:, 0].tolist() == list(range(10)) and ds.y.tolist() == [i % 3 for i in range(10)]


@pytest.mark.parametrize("text, message", [
    ("a,b\n1,2\n", r"no label column 'label' \(data.label_column\); the header row names \['a', 'b'\]"),
    ("label,a,b\n1,2,3\n", r"2 feature columns \(all but 'label'\), but one sample of data.input_shape \[3\] is 3"),
    ("label,a,a,b\n1,2,3,4\n", r"the header names column\(s\) \['a'\] more than once"),
    ("label,a,b,c\n1,2,3,4\n0,1,2\n", r"line 3 has 3 cells, the header 4"),
    ("label,a,b,c\n1,2,3,4\n0,1,x,3\n", r"line 3, column 'b': 'x' is not a number"),
    ("label,a,b,c\n1,2,,4\n", r"line 2, column 'b': '' is not a number"),
    ("label,a,b,c\n1.0,2,3,4\n", r"line 2, column 'label': '1.0' is not an integer class label"),
    ("label,a,b,c\n5,2,3,4\n", r"field 'y' has labels 5\.\.5, outside 0\.\.2"),
    ("label,a,b,c\n1,2,nan,4\n", r"field 'x' holds NaN or infinite values \(first in sample 0\)"),
    ("label,a,b,c\n1,2,1e99,4\n", r"field 'x' holds NaN or infinite values"),
    ("label,a,b,c\n", r"no samples"),
    ("\n", r"no label column 'label' \(data.label_column\); the header row names \[\]"),
    ("label,a,b,c\n1,2," + "3" * 200_000 + ",4\n", r"not a readable .csv file \(line 2: field larger than field limit"),
])
def test_csv_bad_contents_are_one_line_naming_the_file(tmp_path, text, message):
    f = write_csv(tmp_path / "bad.csv", text)
    with pytest.raises(DataError, match=message) as info:
        load_csv(f, spec([3]))
    assert str(info.value).startswith(f"{f}: ") and "\n" not in str(info.value)


def test_csv_names_at_most_a_dozen_columns_and_refuses_non_utf8_and_oversized_files(tmp_path):
    f = write_csv(tmp_path / "wide.csv", ",".join(f"c{i}" for i in range(40)) + "\n")
    with pytest.raises(DataError, match=r"names \['c0', .*'c11', '... \(40 columns\)'\]"):
        load_csv(f, spec([39]))
    g = tmp_path / "bin.csv"
    g.write_bytes(b"label,a\n\xff\xfe\x00")
    with pytest.raises(DataError, match="bin.csv: not a UTF-8 text .csv file"):
        load_csv(g, spec([1]))
    h = write_csv(tmp_path / "big.csv", "label,a\n" + "0,1\n" * 100)
    assert len(load_csv(h, spec([1]), FileLimits(max_bytes=408))) == 100
    with pytest.raises(DataError, match=r"big.csv: 408 bytes, over the limit of 407 bytes \(--max-data-bytes\)"):
        load_csv(h, spec([1]), FileLimits(max_bytes=407))


def test_the_fed_servers_test_file_may_be_a_csv_like_a_devices(tmp_path):
    from shared.evaluation import server_test_set
    f = write_csv(tmp_path / "test.csv", "a,label,b\n1,2,3\n4,0,6\n")
    test = server_test_set(spec([2]).model_copy(update={"test_file": str(f)}))
    assert test is not None and test.y.tolist() == [2, 0] and test.x.tolist() == [[1.0, 3.0], [4.0, 6.0]]
    notes = write_csv(tmp_path / "test.txt", "a,label\n1,0\n")
    with pytest.raises(DataError, match=r"test.txt: unsupported data file 'test.txt': use .npz, .csv$"):
        server_test_set(spec([1]).model_copy(update={"test_file": str(notes)}))


def test_a_file_that_is_neither_npz_nor_csv_is_refused_by_name(tmp_path):
    for name in ("notes.txt", "one.npy", "data"):
        f = write_csv(tmp_path / name, "label,a\n0,1\n")
        with pytest.raises(DataError, match=rf"{name}: unsupported data file '{name}': use .npz, .csv, an image "
                                            rf"folder, or package.module:function"):
            load_local(str(f), spec([1]), {})
    with pytest.raises(DataError, match="not found"):
        load_local(str(tmp_path / "gone.csv"), spec([1]), {})


def test_label_column_is_a_local_setting():
    with pytest.raises(ValueError, match="label_column"):
        DataSpec(label_column="class")
    with pytest.raises(ValueError, match="label_column"):
        spec([1], label_column="")


# --- image folders --------------------------------------------------------------------------------
def test_image_folder_numeric_classes_grey(tmp_path):
    write_png(tmp_path / "dev" / "0" / "a.png", 0)
    write_png(tmp_path / "dev" / "2" / "b.png", 255)
    write_png(tmp_path / "dev" / "2" / "c.png", 255)
    (tmp_path / "dev" / "2" / "notes.txt").write_text("ignored")
    ds = load_image_folder(tmp_path / "dev", spec([1, 4, 4], scale=1 / 255))
    assert ds.y.tolist() == [0, 2, 2] and tuple(ds.x.shape) == (3, 1, 4, 4)
    assert float(ds.x[0].max()) == 0.0 and float(ds.x[1].min()) == 1.0


def test_image_folder_named_classes_rgb_and_resize(tmp_path):
    write_png(tmp_path / "dev" / "cat" / "a.png", 10, size=(8, 6), mode="RGB")
    write_png(tmp_path / "dev" / "dog" / "b.png", 20, size=(4, 4), mode="L")  # converted to RGB
    (tmp_path / "dev" / "eel").mkdir()  # a class this device lacks
    ds = load_image_folder(tmp_path / "dev", spec([3, 4, 4], resize=(4, 4)))
    assert ds.y.tolist() == [0, 1] and tuple(ds.x.shape) == (2, 3, 4, 4)
    assert torch.allclose(ds.x[1], torch.full((3, 4, 4), 20.0))


def test_image_folder_named_classes_need_every_class(tmp_path):
    write_png(tmp_path / "dev" / "cat" / "a.png", 0)
    with pytest.raises(DataError, match="1 class sub-folders with names, but data.num_classes = 3"):
        load_image_folder(tmp_path / "dev", spec([1, 4, 4]))


def test_image_folder_bad_inputs(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="no class sub-folders"):
        load_image_folder(tmp_path / "none", spec([1, 4, 4]))
    write_png(tmp_path / "big" / "7" / "a.png", 0)
    with pytest.raises(DataError, match=r"class folder\(s\) \['7'\] outside 0..2"):
        load_image_folder(tmp_path / "big", spec([1, 4, 4]))
    (tmp_path / "empty" / "0").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        load_image_folder(tmp_path / "empty", spec([1, 4, 4]))
    write_png(tmp_path / "broken" / "0" / "a.png", 0)
    (tmp_path / "broken" / "1").mkdir()
    (tmp_path / "broken" / "1" / "b.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match=r"b.png: unreadable image"):
        load_image_folder(tmp_path / "broken", spec([1, 4, 4]))
    with pytest.raises(DataError, match=r"samples of shape \[1, 4, 4\] .* \[1, 5, 5\]"):
        load_image_folder(tmp_path / "big", spec([1, 5, 5], num_classes=8))


def test_image_folder_without_pillow_says_how_to_install(tmp_path, monkeypatch):
    write_png(tmp_path / "dev" / "0" / "a.png", 0)
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match=r"needs Pillow: pip install 's2fl-testbed\[images\]'"):
        load_image_folder(tmp_path / "dev", spec([1, 4, 4]))


# --- user functions -------------------------------------------------------------------------------
@pytest.fixture
def data_module(tmp_path, monkeypatch):
    (tmp_path / "my_data_mod.py").write_text(
        "import numpy as np, torch\n"
        "from shared.data import ArrayDataset\n"
        "def pairs(n='4'):\n"
        "    return np.ones((int(n), 2)), np.arange(int(n)) % 3\n"
        "def dataset():\n"
        "    return ArrayDataset(x=torch.ones(2, 2), y=torch.tensor([0, 1]), num_classes=3)\n"
        "def broken():\n"
        "    raise RuntimeError('disk on fire')\n"
        "def nothing():\n"
        "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_data_mod"
    sys.modules.pop("my_data_mod", None)


def test_function_with_data_args_and_dataset_result(data_module):
    ds = load_local(f"{data_module}:pairs", spec([2], scale=2.0), {"n": "5"})
    assert len(ds) == 5 and float(ds.x.max()) == 2.0
    assert len(load_local(f"{data_module}:dataset", spec([2]), {})) == 2


@pytest.mark.parametrize("ref, message", [
    ("no_such_module_xyz:load", "cannot import module 'no_such_module_xyz'"),
    ("my_data_mod:absent", "has no attribute 'absent'"),
    ("my_data_mod:broken", "the data function failed: RuntimeError: disk on fire"),
    ("my_data_mod:nothing", r"must return \(x, y\) or an ArrayDataset, got NoneType"),
])
def test_function_bad_inputs(data_module, ref, message):
    with pytest.raises(DataError, match=message):
        load_local(ref, spec([2]), {})


def test_local_source_needs_a_local_run(tmp_path):
    f = write_npz(tmp_path / "d.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match="needs a run with data.dataset: local"):
        load_local(str(f), DataSpec(), {})


# --- --data PATH -> devices -----------------------------------------------------------------------
def test_data_sources(tmp_path):
    f = write_npz(tmp_path / "one.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    assert [(s.name, s.ref) for s in data_sources(str(f))] == [("one", str(f))]
    assert [s.name for s in data_sources("pkg.mod:load_it")] == ["load_it"]
    many = tmp_path / "many"
    many.mkdir()
    for n in ("b", "a"):
        write_npz(many / f"{n}.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    (many / "c.CSV").write_text("label,a\n0,1\n")
    (many / "notes.txt").write_text("not data")
    assert [s.name for s in data_sources(str(many))] == ["a", "b", "c"]
    write_png(tmp_path / "dev" / "0" / "a.png", 0)
    (tmp_path / "dev" / "1").mkdir()
    assert [s.name for s in data_sources(str(tmp_path / "dev"))] == ["dev"]
    for d in ("site1", "site2"):
        write_png(tmp_path / "sites" / d / "0" / "a.png", 0)
    assert [(s.name, Path(s.ref).name) for s in data_sources(str(tmp_path / "sites"))] == [("site1", "site1"), ("site2", "site2")]


def test_data_sources_refuses_ambiguous_or_missing(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data_sources(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither .npz or .csv files nor sub-folders"):
        data_sources(str(tmp_path / "empty"))
    write_png(tmp_path / "mixed" / "site1" / "0" / "a.png", 0)
    write_png(tmp_path / "mixed" / "3" / "a.png", 0)
    with pytest.raises(DataError, match="some sub-folders hold images and some hold folders"):
        data_sources(str(tmp_path / "mixed"))
    write_png(tmp_path / "both" / "0" / "a.png", 0)
    write_npz(tmp_path / "both" / "d.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match="both data files and sub-folders"):
        data_sources(str(tmp_path / "both"))


def test_transform_errors_name_the_file(tmp_path):
    f = write_npz(tmp_path / "tab.npz", x=np.zeros((2, 3)), y=np.zeros(2, dtype=int))
    with pytest.raises(DataError, match=r"tab.npz: input_transform.mean has 2 values; the samples have 3 channels"):
        load_npz(f, spec([3], mean=[0.0, 0.0], std=[1.0, 1.0]))


# --- symbolic links: a device reads only its own folder ----------------------------------------------
def _device_folder(folder: Path) -> Path:
    """A device folder with one image in each of classes 0 and 1."""
    write_png(folder / "0" / "a.png", 0)
    write_png(folder / "1" / "b.png", 255)
    return folder


def test_links_inside_the_device_folder_are_followed(tmp_path):
    dev = _device_folder(tmp_path / "dev")
    (dev / "2").symlink_to("1", target_is_directory=True)      # a class that reuses another's images
    (dev / "0" / "c.png").symlink_to(dev / "1" / "b.png")       # an absolute link that stays inside
    assert load_image_folder(dev, spec([1, 4, 4])).y.tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("link, target", [("2", "outside"), ("0/c.png", "outside/z.png")])
def test_a_link_out_of_the_device_folder_is_refused_naming_it(tmp_path, link, target):
    write_png(tmp_path / "outside" / "z.png", 9)
    dev = _device_folder(tmp_path / "dev")
    (dev / link).symlink_to(tmp_path / target)
    with pytest.raises(DataError) as refused:
        load_image_folder(dev, spec([1, 4, 4]))
    assert str(refused.value) == (f"{dev / link}: a symbolic link to {tmp_path / target}, outside the data folder {dev}")


@pytest.mark.parametrize("links, message", [
    ({"2": "."}, "a symbolic link that loops (to {dev}, a folder that holds it)"),
    ({"2": "../dev"}, "a symbolic link that loops (to {dev}, a folder that holds it)"),
    ({"0/up": ".."}, "a symbolic link that loops (to {dev}, a folder that holds it)"),
    ({"2": "2"}, "a symbolic link that loops (to 2, which never leads to a file or folder)"),
    ({"2": "3", "3": "2"}, "a symbolic link that loops (to 3, which never leads to a file or folder)"),
    ({"2": "gone"}, "a symbolic link that cannot be followed (to gone: No such file or directory)"),
])
def test_a_link_that_loops_or_leads_nowhere_is_refused_naming_it(tmp_path, links, message):
    dev = _device_folder(tmp_path / "dev")
    for link, target in links.items():
        (dev / link).symlink_to(target)
    first = sorted(links)[0]
    with pytest.raises(DataError) as refused:
        load_image_folder(dev, spec([1, 4, 4]))
    assert str(refused.value) == f"{dev / first}: " + message.format(dev=dev)


def test_hidden_entries_are_not_read(tmp_path):
    dev = _device_folder(tmp_path / "dev")
    (dev / ".snapshot").symlink_to(tmp_path, target_is_directory=True)
    (dev / "0" / ".b.png").symlink_to(dev)
    assert load_image_folder(dev, spec([1, 4, 4])).y.tolist() == [0, 1]


def test_a_device_folder_with_a_loop_is_one_device_its_load_refuses(tmp_path):
    """The loop does not make the folder read as a folder of devices (nor as an ambiguous one)."""
    dev = _device_folder(tmp_path / "dev")
    (dev / "2").symlink_to(".")
    [source] = data_sources(str(dev))
    assert (source.name, source.ref, source.refused) == ("dev", str(dev), None)
    with pytest.raises(DataError, match="loops"):
        source.load(spec([1, 4, 4]))


def test_a_bad_link_in_a_folder_of_devices_is_a_refused_device_of_its_own(tmp_path):
    sites = tmp_path / "sites"
    _device_folder(sites / "a")
    _device_folder(tmp_path / "elsewhere")
    (sites / "b").symlink_to(tmp_path / "elsewhere")
    (sites / "c").symlink_to(".")
    sources = data_sources(str(sites))
    assert [(s.name, s.refused) for s in sources] == [
        ("a", None),
        ("b", f"{sites / 'b'}: a symbolic link to {tmp_path / 'elsewhere'}, outside the data folder {sites}"),
        ("c", f"{sites / 'c'}: a symbolic link that loops (to {sites}, a folder that holds it)")]
    assert len(sources[0].load(spec([1, 4, 4]))) == 2
    with pytest.raises(DataError, match="outside the data folder"):
        sources[1].load(spec([1, 4, 4]))


def test_a_data_file_linked_from_outside_its_folder_is_a_refused_device(tmp_path):
    many = tmp_path / "many"
    many.mkdir()
    write_npz(many / "a.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    write_npz(tmp_path / "b.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    (many / "b.npz").symlink_to(tmp_path / "b.npz")
    (many / "notes.txt").symlink_to(tmp_path / "b.npz")   # not data: never read
    assert [(s.name, s.refused is not None) for s in data_sources(str(many))] == [("a", False), ("b", True)]


def test_device_sources_make_an_unreadable_data_value_one_refused_device(tmp_path):
    assert [(s.name, s.refused) for s in device_sources(str(tmp_path / "nope.npz"))] == [
        ("nope", f"{tmp_path / 'nope.npz'}: data file or folder not found (nor an import path package.module:function)")]
    with pytest.raises(DataError, match="not found"):
        device_sources(str(tmp_path / "nope.npz"))[0].load(spec([2]))
    f = write_npz(tmp_path / "one.npz", x=np.zeros((2, 2)), y=np.zeros(2, dtype=int))
    assert device_sources(str(f)) == data_sources(str(f))
