"""The prose is the project's own: no run of eight consecutive words of the original Day 55
entry (kept outside the repo, in the shared folder beside it) appears in a journal entry, a
notebook, the README or a docstring. Case and punctuation are folded before comparing, so a
copied sentence with a changed comma or capital is still caught.

    python -m pytest tests/test_prose.py -q         # which file, and the eight words it shares
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORIGINAL = REPO.parent / "shared" / "seed" / "000_1eaec716dc892425.txt"
RUN = 8


# A journal entry's headings and its date line are the format every entry shares (COURSE.md),
# not prose: they separate runs instead of joining the words around them.
FORMAT_LINE = re.compile(r"^\s*(#+ |Date: )")


def words(text: str) -> list[str]:
    """Lower-cased words with punctuation folded away; an identifier is one word:
    "Warm-up, it's `write_slots`" -> ['warm', 'up', 'it', 's', 'write_slots']."""
    return re.findall(r"[a-z0-9_]+", text.lower())


def passages(text: str) -> list[list[str]]:
    """The words of text, cut at format lines (headings, a journal entry's date line)."""
    out, current = [], []
    for line in text.splitlines():
        if FORMAT_LINE.match(line):
            out.append(current)
            current = []
        else:
            current.extend(words(line))
    return [*out, current]


def runs(text: str, n: int = RUN) -> set[tuple[str, ...]]:
    return {tuple(w[i : i + n]) for w in passages(text) for i in range(len(w) - n + 1)}


def shared_runs(text: str, original: str, n: int = RUN) -> list[str]:
    """Every n-word run of text that also occurs in original, in text's order, joined by spaces."""
    theirs = runs(original, n)
    hits = []
    for w in passages(text):
        i = 0
        while i <= len(w) - n:
            if tuple(w[i : i + n]) in theirs:
                hits.append(" ".join(w[i : i + n]))
                i += n  # a long copied passage is reported once every n words, not once a word
            else:
                i += 1
    return hits


def docstrings(source: str) -> str:
    """Every module, class and function docstring of a Python file, joined."""
    tree = ast.parse(source)
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    return "\n".join(d for n in nodes if (d := ast.get_docstring(n)))


def checked_texts() -> dict[str, str]:
    """What the rule covers: journal entries, notebooks (their .py source, prose and code
    comments alike), every README, and the docstrings of the package, the day scripts and the
    tests."""
    texts = {}
    for path in sorted(REPO.glob("journal/*.md")) + sorted(REPO.glob("notebooks/*.py")):
        texts[str(path.relative_to(REPO))] = path.read_text()
    for path in sorted(REPO.glob("**/README.md")):
        if ".venv" not in path.parts:
            texts[str(path.relative_to(REPO))] = path.read_text()
    for folder in ("nanoserve", "days", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            texts[str(path.relative_to(REPO))] = docstrings(path.read_text())
    for path in sorted(REPO.glob("book/**/*.md")):  # the book's own pages
        texts[str(path.relative_to(REPO))] = path.read_text()
    return texts


@pytest.fixture(scope="module")
def original() -> str:
    if not ORIGINAL.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{ORIGINAL} is missing: CI runs beside the shared folder and needs it")
        pytest.skip(f"{ORIGINAL} is not beside this checkout; the prose rule cannot be checked")
    return ORIGINAL.read_text()


def test_no_eight_word_run_of_the_original_entry(original):
    found = {name: hits for name, text in checked_texts().items() if (hits := shared_runs(text, original))}
    report = "\n".join(f"{name}: {' | '.join(hits[:3])}" for name, hits in found.items())
    assert not found, f"eight-word runs of the original Day 55 entry:\n{report}"


def test_the_check_catches_a_planted_copy(original):
    w = original.split()
    planted = " ".join(w[100:110])
    # the same words with the case changed and punctuation moved are still a copy
    disguised = planted.upper().replace(" ", ", ", 2)
    entry = f"# Day 99\n\nSome words of our own. {disguised} And more of ours.\n"
    assert shared_runs(entry, original), "a planted ten-word copy went unnoticed"
    assert not shared_runs("# Day 99\n\nSome words of our own, and nothing of theirs.\n", original)


def test_seven_words_are_not_a_run(original):
    seven = " ".join(words(original)[200:207])
    assert not shared_runs(seven, original)
    assert shared_runs(" ".join(words(original)[200:208]), original)


def test_a_heading_cuts_a_run_but_a_line_break_does_not(original):
    eight = words(original)[300:308]
    assert shared_runs(" ".join(eight[:4]) + "\n" + " ".join(eight[4:]), original)
    assert not shared_runs(" ".join(eight[:4]) + "\n## What I added\n" + " ".join(eight[4:]), original)


def test_docstrings_are_read_and_code_is_not():
    source = 'def f():\n    """Warm the list first."""\n    return "not prose"\n'
    assert docstrings(source) == "Warm the list first."
