"""The documentation is self-contained: every ``docs/<page>.md#<section>`` that code, tests, docs or
experiment files cite exists, and nothing cites material outside the repository (an implementation spec's sections,
an absolute path, a ``../`` path out of the project)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Cell data of committed experiment results is output, not documentation.
SOURCES = sorted(p for p in [*ROOT.glob("**/*.py"), *ROOT.glob("**/*.md"), *ROOT.glob("**/*.yaml")]
                 if not any(part.startswith(".") or part in ("cells", "__pycache__", "runs") for part in
                            p.relative_to(ROOT).parts))
CITATION = re.compile(r"docs/([\w./-]+\.md)#([\w-]+)")
MD_LINK = re.compile(r"\]\(([\w./-]+\.md)#([\w-]+)\)")
OUTSIDE = re.compile(r"spec §|Spec §|specs/|/work/|\]\(\.\./\.\./\.\./|`\.\./shared/")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    headings = {_slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}
    return headings | set(re.findall(r'<a id="([\w-]+)"></a>', text))


def _citations() -> list[tuple[str, Path, str]]:
    found = []
    for source in SOURCES:
        text = source.read_text(errors="replace")
        for page, anchor in CITATION.findall(text):
            found.append((str(source.relative_to(ROOT)), ROOT / "docs" / page, anchor))
        if source.suffix == ".md":
            for page, anchor in MD_LINK.findall(text):
                found.append((str(source.relative_to(ROOT)), (source.parent / page).resolve(), anchor))
    return found


def test_the_probe_finds_citations():
    # Positive control: the algorithm modules cite their pages' sections.
    cited = {(str(page.relative_to(ROOT)), anchor) for _, page, anchor in _citations() if page.is_relative_to(ROOT)}
    assert ("docs/algorithms/hics.md", "warm-up") in cited and ("docs/algorithms/fedbc.md", "synthetic-generator") in cited


@pytest.mark.parametrize("source, page, anchor", _citations(), ids=lambda v: str(v)[-60:])
def test_cited_section_exists(source, page, anchor):
    assert page.is_file(), f"{source} cites a missing page {page}"
    assert anchor in _anchors(page), f"{source} cites {page.name}#{anchor}, which has no such section"


def test_nothing_cites_material_outside_the_repository():
    this = Path(__file__).resolve()
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in SOURCES if p.resolve() != this
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert offenders == []


def test_slug_matches_github():
    assert _slug("How a group's loss is combined (Eq. 3)") == "how-a-groups-loss-is-combined-eq-3"
    assert _slug("S2FL Table 2 analogue: accuracy (`table2_cnn`, `table2_models`)") == \
        "s2fl-table-2-analogue-accuracy-table2_cnn-table2_models"


def test_outside_pattern_catches_the_old_citations():
    for line in ("(spec §7.1 ``differentiable_sq``)", "Spec: ``specs/fedipg.md``", "/work/shared/specs/hics-fl.md §8",
                 "| `../shared/machine.py` |"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("docs/algorithms/hics.md#warm-up")
