"""Synthetic data kept in files (shared/data/synthetic_files.py): the same numbers as the generator,
generated once per cache folder, even when several callers ask at once, and never half written."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from shared.data import synthetic_files
from shared.data.synthetic import generate_synthetic
from shared.data.synthetic_files import data_cache_folder, synthetic_arrays


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SFL_DATA_CACHE", str(folder))
    return folder


def _count_generations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = synthetic_files.device_parts

    def counted(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(synthetic_files, "device_parts", counted)
    return calls


def test_files_hold_the_generators_draw_as_float32(cache: Path) -> None:
    arrays = synthetic_arrays(12, 0.5, 0.5, False, 3)
    gen = generate_synthetic(12, 0.5, 0.5, False, 3)
    assert arrays.samples.tolist() == gen.samples_per_device.tolist()
    for mapped, parts in ((arrays.x_train.array, gen.x_train), (arrays.x_test.array, gen.x_test)):
        assert mapped.dtype == np.float32 and np.array_equal(mapped, np.concatenate(parts).astype(np.float32))
    for mapped, parts in ((arrays.y_train.array, gen.y_train), (arrays.y_test.array, gen.y_test)):
        assert mapped.dtype == np.int64 and np.array_equal(mapped, np.concatenate(parts))
    assert arrays.x_train.array.flags.writeable


def test_a_second_call_maps_the_files_without_generating(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = synthetic_arrays(6, 0.5, 0.5, True, 1)
    calls = _count_generations(monkeypatch)
    again = synthetic_arrays(6, 0.5, 0.5, True, 1)
    assert calls == [] and np.array_equal(first.x_train.array, again.x_train.array)
    synthetic_arrays(6, 0.5, 0.5, False, 1)   # other settings: their own files
    assert calls == [1]
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [
        "synthetic-v1-n6-a0.5-b0.5-iid-s1", "synthetic-v1-n6-a0.5-b0.5-niid-s1"]


def test_callers_asking_at_once_generate_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_generations(monkeypatch)
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(synthetic_arrays(40, 0.5, 0.5, False, 2).y_test.array))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len(results) == 4 and all(np.array_equal(r, results[0]) for r in results)


def test_a_failed_generation_leaves_nothing_behind(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> object:
        samples, devices = generate_parts(*args)  # type: ignore[arg-type]

        def failing():  # type: ignore[no-untyped-def]
            yield next(devices)
            raise RuntimeError("disk full")
        return samples, failing()

    generate_parts = synthetic_files.device_parts
    monkeypatch.setattr(synthetic_files, "device_parts", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        synthetic_arrays(5, 0.5, 0.5, False, 1)
    assert [p for p in cache.iterdir() if p.is_dir()] == []
    monkeypatch.setattr(synthetic_files, "device_parts", generate_parts)
    assert len(synthetic_arrays(5, 0.5, 0.5, False, 1).samples) == 5


def test_an_unusable_cache_setting_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SFL_DATA_CACHE", str(blocker / "cache"))
    with pytest.raises(OSError, match="SFL_DATA_CACHE=.* cannot be created"):
        data_cache_folder()


def test_without_a_setting_the_home_cache_is_used_else_the_temporary_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SFL_DATA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_cache_folder() == tmp_path / "xdg" / "sfl-data"
    (tmp_path / "ro").write_text("a file where the cache home should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    monkeypatch.setattr(synthetic_files.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert data_cache_folder().parent == tmp_path / "tmp"


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.split()[-1] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_released_rows_leave_memory_and_read_the_same_again(cache: Path) -> None:
    arrays = synthetic_arrays(60, 0.5, 0.5, False, 4)
    rows = arrays.x_train
    path = next(cache.glob("synthetic-*/x_train.npy"))
    before = rows.array.copy()
    assert _resident_kib(path) >= before.nbytes // 1024 - 8
    rows.release(0, len(before) - 1)
    assert _resident_kib(path) <= 8
    middle = rows.array[1000:1100].copy()    # a read maps the pages again
    assert np.array_equal(middle, before[1000:1100]) and _resident_kib(path) > 0
    rows.release(1000, 1099)
    assert _resident_kib(path) <= 8 and np.array_equal(rows.array, before)


def test_a_subset_of_a_mapped_data_set_gives_its_rows_back(cache: Path) -> None:
    from shared.data import DataSpec, device_shard, load_dataset

    spec = DataSpec(dataset="synthetic", partition="natural", num_devices=60, seed=4)
    train, _ = load_dataset(spec)
    path = next(cache.glob("synthetic-v1-n60-*/x_train.npy"))
    shard = device_shard(spec, train, 7)
    assert len(shard) > 0 and _resident_kib(path) <= 8
    assert np.array_equal(shard.x.numpy(), device_shard(spec, train, 7).x.numpy())
