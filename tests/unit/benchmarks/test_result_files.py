"""Where benchmark runs write: one dated folder per measurement under ``benchmarks/results/``, and
every results path the documentation and code cite exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import attacks, http_floor, population, run
from benchmarks.result_files import RESULTS, default_out, write, write_json

ROOT = Path(__file__).resolve().parents[3]
DATE = "2026-01-02T03:04:05+00:00"


def test_a_run_writes_into_its_dated_folder_and_a_repeat_beside_it(tmp_path: Path) -> None:
    first = default_out(DATE, "attacks_own-deadlines", tmp_path)
    assert first == tmp_path / "2026-01-02_attacks_own-deadlines" / "results.json"
    markdown = write({"a": 1}, first, lambda results: f"| a | {results['a']} |")
    assert markdown == first.with_suffix(".md") and markdown.read_text() == "| a | 1 |\n"
    second = default_out(DATE, "attacks_own-deadlines", tmp_path)
    assert second == first.parent / "results_2.json"
    write_json({"a": 2}, second)
    assert default_out(DATE, "attacks_own-deadlines", tmp_path).name == "results_3.json"
    assert first.read_text() == '{\n  "a": 1\n}\n'
    assert default_out(DATE, "x").parent.parent == RESULTS


def test_the_default_folder_names_say_what_ran() -> None:
    assert run.default_name(set(run.DEFAULT_PARTS), quick=False) == "parts-a-b-c-e-f"
    assert run.default_name({"c", "b"}, quick=True) == "parts-b-c_quick"


@pytest.mark.parametrize("name", ["", "Own deadlines", "../x", "a/b", "-x"])
def test_a_bad_name_is_refused_before_the_run(name: str, capsys) -> None:
    for command in (lambda argv: attacks.parse_selection(argv), run.main, population.main, http_floor.main):
        with pytest.raises(SystemExit) as stopped:
            command([f"--name={name}"])
        assert stopped.value.code == 2
        assert "a results folder's name takes lower-case letters" in capsys.readouterr().err
    with pytest.raises(ValueError, match="results folder's name"):
        default_out(DATE, name)


def test_a_good_name_and_no_out_by_default() -> None:
    _, args = attacks.parse_selection(["--name", "attacks_silent"])
    assert (args.name, args.out) == ("attacks_silent", None)


def _cited_paths() -> list[tuple[str, Path]]:
    """Every ``benchmarks/results/...`` path written out in the repository's Markdown and Python, and
    every Markdown link into a results folder, with the file that cites it."""
    found = []
    sources = [p for p in [*ROOT.glob("**/*.md"), *ROOT.glob("**/*.py")]
               if not any(part.startswith(".") or part in ("cells", "runs", "__pycache__")
                          for part in p.relative_to(ROOT).parts)]
    for source in sources:
        text = source.read_text(errors="replace")
        for path in re.findall(r"benchmarks/results/[\w./-]*[\w/]", text):
            found.append((str(source.relative_to(ROOT)), ROOT / path))
        if source.suffix == ".md":
            for link in re.findall(r"\]\(([\w./-]+)(?:#[\w-]+)?\)", text):
                target = (source.parent / link).resolve()
                if target.is_relative_to(RESULTS):
                    found.append((str(source.relative_to(ROOT)), target))
    return found


def test_the_probe_finds_the_cited_results() -> None:
    cited = {path for _, path in _cited_paths()}
    assert RESULTS / "2026-12-01_attacks_label-flip" / "results.md" in cited


def test_every_cited_results_path_exists() -> None:
    missing = [f"{source}: {path.relative_to(ROOT)}" for source, path in _cited_paths() if not path.exists()]
    assert missing == []
