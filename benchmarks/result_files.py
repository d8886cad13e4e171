"""Where a benchmark run writes its results: ``benchmarks/results/<UTC date>_<name>/``, one folder per
measurement, named by the day it ran and what it measured (``results.json``, and ``results.md``
where the part renders Markdown), unless the command's ``--out FILE`` names another file."""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def check_name(name: str) -> str:
    """``name`` if it can name a results folder: lower-case letters, digits, ``-`` and ``_``
    (ValueError otherwise), so that a folder's name says what it measured and nothing else."""
    if not NAME.fullmatch(name):
        raise ValueError(f"a results folder's name takes lower-case letters, digits, '-' and '_', "
                         f"e.g. attacks_own-deadlines; got {name!r}")
    return name


def _name_argument(text: str) -> str:
    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_name_option(parser: argparse.ArgumentParser, default: str | None, shown: str | None = None) -> None:
    """``--name``: what a run measured, naming its folder ``benchmarks/results/<UTC date>_<name>/``
    (``shown`` describes a default the command works out itself); a bad name is refused before the run."""
    parser.add_argument("--name", type=_name_argument, default=default,
                        help="what the run measured: its results go to benchmarks/results/<UTC date>_<name>/ "
                             f"(default {shown or default})")


def default_out(date_utc: str, name: str, root: Path = RESULTS) -> Path:
    """``<root>/<UTC date>_<name>/results.json``; when a run of that name on that day already wrote
    there, ``results_2.json``, ``results_3.json``, ...: repeats of one measurement sit side by side
    and none overwrites another."""
    folder = root / f"{date_utc[:10]}_{check_name(name)}"
    out, repeat = folder / "results.json", 2
    while out.exists() or out.with_suffix(".md").exists():
        out, repeat = folder / f"results_{repeat}.json", repeat + 1
    return out


def write_json(results: dict, out: Path) -> Path:
    """``out`` with the results as JSON, its folder made if need be; ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return out


def write(results: dict, out: Path, render: Callable[[dict], str]) -> Path:
    """``out`` (JSON) and the Markdown ``render`` makes of the results beside it with ``.md``; the
    Markdown file's path."""
    write_json(results, out)
    markdown = out.with_suffix(".md")
    markdown.write_text(render(results) + "\n")
    return markdown


def replace_between(text: str, begin: str, end: str, lines: list[str]) -> str:
    """``text`` with what lies between its lines ``begin`` and ``end`` replaced by ``lines`` (the
    markers kept); ValueError when either marker is missing, so a page without a place for a table
    is never written."""
    if begin not in text or end not in text:
        raise ValueError(f"no place for the table: add the lines {begin} and {end}")
    before, rest = text.split(begin, 1)
    after = rest.split(end, 1)[1]
    return before + "\n".join([begin, *lines, end]) + after


def finish(results: dict, out: Path, render: Callable[[dict], str], docs: Path | None = None,
           update_docs: Callable[[dict, Path, Path], None] | None = None) -> None:
    """The end of a benchmark command: print what ``render`` makes of ``results``, write them to
    ``out`` (:func:`write`), and where ``docs`` names a page, write the table there with
    ``update_docs(results, docs, out)``."""
    print()
    print(render(results))
    markdown = write(results, out, render)
    print(f"\nresults: {out}, {markdown}")
    if docs is not None and update_docs is not None:
        update_docs(results, docs, out)
        print(f"table written into {docs}")


def markdown_table(lines: list[list[str]]) -> list[str]:
    """A Markdown table's lines: ``lines[0]`` the header, the rest its rows (the benchmarks' tables)."""
    return ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])] + [
        "| " + " | ".join(line) + " |" for line in lines[1:]]


Number = TypeVar("Number", int, float)


def comma_separated(convert: Callable[[str], Number], flag: str, valid: Callable[[Number], bool], what: str
                    ) -> Callable[[str], tuple[Number, ...]]:
    """An argparse type for ``flag``: comma-separated values, each ``convert``-ed and ``valid``;
    ArgumentTypeError saying ``flag`` takes comma-separated ``what`` otherwise."""
    def parse(text: str) -> tuple[Number, ...]:
        try:
            values = tuple(convert(part) for part in text.split(",") if part.strip())
        except ValueError:
            values = ()
        if not values or not all(valid(v) for v in values):
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated {what}")
        return values
    return parse

