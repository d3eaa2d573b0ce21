"""Every figure the course's prose states is one its outputs show.

A "figure" is a number in a journal entry's prose or a notebook's markdown that has a decimal
point (1.59x, 3.8e-06, 0.83) or three or more digits (11,455; 2048). It must be found, at the
precision it is printed with, in that day's evidence or an earlier day's: the executed notebooks'
outputs, the CSVs under days/, and the code that produced them (the notebook's and the day
script's sources: a figure the reader can see typed into the code is one they can check).
"found at its printed precision": 1.6 is found where an output prints 1.59 or 1.6034; 3.8e-06
where one prints 3.812e-06; 11,455 where one prints 11455; a percentage also where a fraction
is printed (31% of 0.3125).

Not figures: numbers inside code spans, code blocks, tables (test_course holds a journal's tables
to its CSVs), links and images, the header's date, and parts of names (Qwen2.5, SmolLM2-135M,
torch 2.13.0, day-17). A sentence that quotes a figure from elsewhere (a paper, another engine's
documentation) says so with the marker "(quoted)", and its figures are not looked up.

Every written day is held to it (a new day's entry and notebook are, from the day they land).
"""

from __future__ import annotations

import csv
import json
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOURNAL, NOTEBOOKS, DAYS = REPO / "journal", REPO / "notebooks", REPO / "days"
MARKER = "(quoted)"

# every written day: a journal entry and its notebook
DAYS_WRITTEN = sorted(int(p.stem.split("-")[1]) for p in JOURNAL.glob("day-*.md"))

UNITS = r"(?:x|ms|us|µs|s|ns|MB|GB|KB|MiB|GiB|KiB|GB/s|tok/s|%)?"
FIGURE = re.compile(r"^(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(e[-+]?\d+)?" + UNITS + "$")
# what stands before a paper's year: "et al.," or a venue (SOSP, OSDI, NeurIPS, arXiv)
CITATION = re.compile(r"(et al\.,?|\b[A-Z]{3,}[A-Za-z]*,?|NeurIPS,?|arXiv,?)\s*$")
# a number, not the digits after another's decimal point (0..351 is two numbers, 2.13 one)
EVIDENCE_NUMBER = re.compile(r"(?<!\w)(?<!\d\.)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?(e[-+]?\d+)?")


def _strip(text: str) -> str:
    """Prose without what is not prose: code blocks and spans, tables, images and link targets,
    HTML comments."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("|")]
    return "\n".join(lines)


def sentences(text: str) -> list[str]:
    """Prose split into sentences (roughly: a full stop, ! or ? and a space before a capital)."""
    out = []
    for para in re.split(r"\n\s*\n", _strip(text)):
        para = " ".join(para.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*])", para) if s]
    return out


def figures(sentence: str) -> list[str]:
    """The figures a sentence states, as printed (units dropped)."""
    found = []
    for at in re.finditer(r"\S+", sentence):
        token, before = at.group(0), sentence[: at.start()]
        if re.fullmatch(r"\(?(19|20)\d\d[),.;]*", token) and CITATION.search(before):
            continue  # a paper's year: (Kwon et al., SOSP 2023)
        token = token.strip("()[]{}*_,;:!?\"'“”‘’~≈+−-").rstrip(".")
        if re.fullmatch(r"\d{4}-\d\d-\d\d", token):
            continue  # a date
        parts = re.split(r"(?<=[\dx%])[-–/](?=\d)", token)
        matches = [FIGURE.match(p) for p in parts]
        if not all(matches):
            continue  # a name, a version, a date, a path
        for m in matches:
            whole, frac, exp = m.group(1), m.group(2) or "", m.group(3) or ""
            if frac or exp or len(whole.replace(",", "")) >= 3:
                found.append(whole + frac + exp + ("%" if m.group(0).endswith("%") else ""))
    return found


def day_prose(day: int) -> str:
    """The journal entry (its header's lines dropped) and the notebook's markdown cells."""
    entry = (JOURNAL / f"day-{day:02d}.md").read_text()
    body = entry.split("\n## ", 1)[1] if "\n## " in entry else entry
    text = [body]
    for nb in sorted(NOTEBOOKS.glob(f"day{day:02d}_*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        text += ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return "\n\n".join(text)


@cache
def day_evidence_text(day: int) -> str:
    """What day `day` shows: its notebook's code and outputs, its scripts and their CSVs."""
    parts = []
    for nb in sorted(NOTEBOOKS.glob(f"day{day:02d}_*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            parts.append("".join(cell["source"]))
            for out in cell.get("outputs", []):
                parts.append("".join(out.get("text", "")))
                for kind in ("text/plain", "text/html", "text/markdown"):
                    parts.append("".join(out.get("data", {}).get(kind, "")))
    folder = DAYS / f"day{day:02d}"
    if folder.is_dir():
        for p in sorted(folder.rglob("*")):
            if p.suffix == ".py":
                parts.append(p.read_text(errors="replace"))
            elif p.suffix == ".csv":  # field by field: a comma between fields is no separator
                with open(p, newline="", errors="replace") as f:
                    parts += [" ; ".join(row) for row in csv.reader(f)]
    return "\n".join(parts)


@cache
def evidence_values(day: int) -> tuple[float, ...]:
    """Every number days 1..`day` show (signs dropped)."""
    values = set()
    for d in range(1, day + 1):
        for m in EVIDENCE_NUMBER.finditer(day_evidence_text(d)):
            try:
                values.add(float(m.group(1).replace(",", "") + (m.group(2) or "") + (m.group(3) or "")))
            except ValueError:
                continue
    return tuple(sorted(values))


@cache
def evidence(day: int, style: str, places: int) -> frozenset[str]:
    """The evidence of days 1..`day` printed as a claim would print it: `places` decimals
    ("f"), `places` decimals of e-notation ("e"), or a fraction as a percentage ("%")."""
    values = evidence_values(day)
    if style == "%":
        return frozenset(f"{100 * v:.{places}f}" for v in values if v <= 1)
    return frozenset(f"{v:.{places}{style}}" for v in values)


def normalized(figure: str) -> tuple[str, str, int]:
    """A claimed figure as `evidence` prints numbers, with its style and decimal places: no
    thousands separators; e-notation with a signed two-digit exponent."""
    f = figure.replace(",", "").rstrip("%")
    m = re.match(r"^(\d+)(?:\.(\d+))?e([-+]?)(\d+)$", f)
    if m:
        whole, frac, sign, exp = m.groups()
        mant = whole + ("." + frac if frac else "")
        return f"{mant}e{sign or '+'}{int(exp):02d}", "e", len(frac or "")
    return f, "f", len(f.split(".")[1]) if "." in f else 0


def found(day: int, figure: str) -> bool:
    """Whether days 1..`day` show `figure` at the precision it is printed with."""
    text, style, places = normalized(figure)
    if text in evidence(day, style, places):
        return True
    return figure.endswith("%") and text in evidence(day, "%", places)


def unfound(day: int) -> list[tuple[str, str]]:
    """(figure, sentence) for each figure of the day's prose its evidence does not show."""
    missing = []
    for s in sentences(day_prose(day)):
        if MARKER in s:
            continue
        for fig in figures(s):
            if not found(day, fig):
                missing.append((fig, s))
    return missing


@pytest.mark.parametrize("day", DAYS_WRITTEN)
def test_every_figure_in_the_prose_is_in_the_outputs(day):
    missing = unfound(day)
    assert not missing, "\n".join(f"day {day}: {fig!r} in: {s[:200]}" for fig, s in missing)


def test_figures_are_found_at_their_printed_precision():
    assert figures("gather ran at 0.83x native (11,455 of 22,912 blocks) in 3.8e-06 s") == [
        "0.83",
        "11,455",
        "22,912",
        "3.8e-06",
    ]
    # names, versions, dates, ranges of names and small counts are not figures
    assert figures("Qwen2.5 and SmolLM2-135M on torch 2.13.0, day-17, 2026-09-28, 4 rows, 31%") == []
    assert figures("4.9-5.2 ms and 1.88x/2.13x") == ["4.9", "5.2", "1.88", "2.13"]
    assert normalized("3.8e-6") == ("3.8e-06", "e", 1) and normalized("22,912") == ("22912", "f", 0)
    assert found(22, "11,455") and found(22, "0.50") and not found(22, "11,456")


def test_a_planted_wrong_figure_is_caught(monkeypatch):
    """The check on a wrongly built entry: day 17's prose (every figure found) with a sentence of
    figures no output shows fails, naming them and their sentence; the same sentence marked
    (quoted) passes, and so does one whose figure is an output's rounded (day 17 prints 0.674)."""
    day = 17
    good = day_prose(day)
    assert not unfound(day)

    def with_sentence(sentence):
        monkeypatch.setattr(f"{__name__}.day_prose", lambda d: good + "\n\n" + sentence if d == day else good)
        return unfound(day)

    missing = with_sentence("The pool held 98,765 slots, and B's logits moved by 0.98765.")
    assert [fig for fig, _ in missing] == ["98,765", "0.98765"]
    assert "98,765 slots" in missing[0][1]
    assert not with_sentence("The pool held 98,765 slots, and B's logits moved by 0.98765 (quoted).")
    assert not with_sentence("B's logits moved by 0.674 at that step.")
    assert [fig for fig, _ in with_sentence("B's logits moved by 0.6747 at that step.")] == ["0.6747"]
