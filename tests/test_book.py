"""The book (`make book`, book/build.py): it builds from what the repository holds, and the same
strict build fails on a broken link or a nav entry whose page is missing.

Each build is a few seconds (the notebooks are read, never executed): one good build, one with a
planted broken link and a removed page in a copy of the generated pages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("book_build", REPO / "book" / "build.py")
book = sys.modules["book_build"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(book)


def mkdocs(config: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    run = book.build(out / "src", out / "site", capture=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def written_days() -> list[int]:
    return sorted(int(p.stem[4:]) for p in (REPO / "journal").glob("day-*.md"))


def test_every_day_has_a_page(built):
    site = built / "site"
    assert (site / "index.html").is_file() and (site / "glossary.html").is_file()
    for n in range(1, 57):
        assert (site / "days" / f"day-{n:02d}.html").is_file(), f"day {n} has no page"
    assert len(list((site / "days").glob("beyond-*.html"))) >= 1, "no planned phase-6 page"


def test_a_written_day_shows_its_entry_notebook_and_diagram(built):
    site = built / "site"
    for n in written_days():
        html = (site / "days" / f"day-{n:02d}.html").read_text()
        entry = (REPO / "journal" / f"day-{n:02d}.md").read_text()
        assert "What I learned" in html and "The notebook" in html, f"day {n}: entry or notebook missing"
        for png in book.diagrams_named(entry):
            assert f'src="../diagrams/{png}"' in html, f"day {n} does not show diagrams/{png}"
            assert (site / "diagrams" / png).is_file()
        assert 'class="nb-output' in html, f"day {n}: no notebook output on the page"


def test_a_planned_day_says_so(built):
    days = built / "site" / "days"
    unwritten = [days / f"day-{n:02d}.html" for n in range(1, 57) if n not in written_days()]
    for page in unwritten[:1] + sorted(days.glob("beyond-*.html"))[:1]:
        assert "Not written yet" in page.read_text(), page.name


def test_a_broken_link_and_a_missing_page_fail_the_build(tmp_path):
    config = book.lay_out(tmp_path / "src", tmp_path / "site")
    docs = config.parent / "docs"
    glossary = docs / "glossary.md"  # the generated copy; book/glossary.md is not touched
    glossary.write_text(glossary.read_text() + "\nSee [day 99](days/day-99.md).\n")
    (docs / "days" / "day-03.md").unlink()  # the nav still lists it
    run = mkdocs(config)
    log = run.stdout + run.stderr
    assert run.returncode != 0, "a strict build passed over a broken link and a missing page"
    assert re.search(r"glossary\.md.*days/day-99\.md", log), log
    assert re.search(r"days/day-03\.md.*nav|nav.*days/day-03\.md", log), log


def test_a_diagram_the_entry_names_must_exist(tmp_path):
    entry = tmp_path / "day-55.md"
    entry.write_text("# Day 55: x\n\n## Diagram\n\n`no-such-diagram.png`, one panel.\n\n## Tomorrow\n")
    notebook = next((REPO / "notebooks").glob("day*.ipynb"))
    day = book.Day(55, "x", "x", 5, "day-55")
    phase = book.Phase(5, "Benchmark and optimize", "", [day])
    with pytest.raises(book.BookError, match="no-such-diagram.png"):
        book.written_page(day, phase, entry, notebook, tmp_path / "docs")


def test_the_book_pages_are_our_own_prose():
    """tests/test_prose.py's rule over the pages written for the book."""
    from tests.test_prose import ORIGINAL, shared_runs

    if not ORIGINAL.exists():
        pytest.skip(f"{ORIGINAL} is not beside this checkout")
    original = ORIGINAL.read_text()
    found = {
        p.name: hits
        for p in sorted((REPO / "book").glob("*.md"))
        if (hits := shared_runs(p.read_text(), original))
    }
    assert not found, found
