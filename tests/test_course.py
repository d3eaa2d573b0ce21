"""The course's artifacts agree with each other: calendar, journal headers, tables and CSVs,
and every notebook's .py source with its executed .ipynb."""

import csv
import datetime as dt
import json
import re
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[1]
JOURNAL = REPO / "journal"
NOTEBOOKS = REPO / "notebooks"
SECTIONS = ["What I added", "Why it matters", "What I learned", "Diagram", "Tomorrow", "Post angle"]
PHASES = [
    (1, 12, 1, "A model that talks"),
    (13, 21, 2, "Paged memory"),
    (22, 33, 3, "Batching"),
    (34, 47, 4, "Serving"),
    (48, 56, 5, "Benchmark and optimize"),
    (57, 999, 6, "Beyond"),
]


def calendar(n_days=None):
    """The rule in journal/README.md: weekdays from Mon 2026-06-15, less three holidays and a
    one-week break; weeks counted Monday to Sunday from the first. By default as many days as
    the README's table has (56, and each phase-6 day as it lands)."""
    if n_days is None:
        n_days = max(56, max(calendar_rows(), default=56))
    start = dt.date(2026, 6, 15)
    off = {dt.date(2026, 6, 19), dt.date(2026, 7, 3), dt.date(2026, 9, 7)}
    off |= {dt.date(2026, 7, 27) + dt.timedelta(i) for i in range(5)}
    days, day = {}, start
    while len(days) < n_days:
        if day.weekday() < 5 and day not in off:
            n = len(days) + 1
            phase = next(p for p in PHASES if p[0] <= n <= p[1])
            days[n] = (day, (day - start).days // 7 + 1, phase[2], phase[3])
        day += dt.timedelta(1)
    return days


def test_day_55_falls_on_its_fixed_date():
    assert calendar()[55] == (dt.date(2026, 9, 9), 13, 5, "Benchmark and optimize")


def calendar_rows():
    """journal/README.md's table: day -> (date, week, phase, phase name, entry column)."""
    rows = re.findall(
        r"^\| (\d+) \| (\S+) \| \w+ \| (\d+) \| (\d) ([^|]+?) \| ([^|]+?) \|$",
        (JOURNAL / "README.md").read_text(),
        re.M,
    )
    return {
        int(n): (dt.date.fromisoformat(d), int(w), int(p), name, entry) for n, d, w, p, name, entry in rows
    }


def test_journal_readme_table_is_the_rule():
    got = {n: row[:4] for n, row in calendar_rows().items()}
    assert got == calendar()


def test_journal_readme_marks_planned_exactly_the_days_without_an_entry():
    for n, (*_, entry) in calendar_rows().items():
        if (JOURNAL / f"day-{n:02d}.md").is_file():
            assert entry == f"[written](day-{n:02d}.md)", (
                f"journal/README.md: day {n} is written, not {entry!r}"
            )
        else:
            assert entry == "planned", (
                f"journal/README.md: day {n} has no entry; mark it planned, not {entry!r}"
            )


def entries():
    return sorted(JOURNAL.glob("day-*.md"))


def test_there_are_entries():
    assert entries(), "no journal entries found"


@pytest.mark.parametrize("path", entries(), ids=lambda p: p.name)
def test_entry_header_and_sections(path):
    text = path.read_text()
    n = int(re.fullmatch(r"day-(\d\d)\.md", path.name).group(1))
    date, week, phase, name = calendar()[n]
    assert re.match(rf"# Day {n}: \S", text), f"{path.name} must start with '# Day {n}: <title>'"
    assert f"Date: {date.isoformat()} · Week {week} · Phase {phase} {name}" in text
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == SECTIONS, f"{path.name} sections {headings}"
    learned = text.split("## What I learned")[1].split("## Diagram")[0]
    assert re.search(r"^1\. ", learned, re.M), "What I learned is a numbered list"
    for png in re.findall(r"`([\w-]+\.png)`", text.split("## Diagram")[1].split("## Tomorrow")[0]):
        assert (REPO / "diagrams" / png).is_file(), f"{path.name} names diagrams/{png}, which does not exist"


def markdown_tables(text):
    """(csv path, columns, rows as dicts) for every table marked with a <!-- table: ... --> line."""
    out = []
    for m in re.finditer(r"<!-- table: (\S+) columns=(\S+) -->\n((?:\|.*\|\n?)+)", text):
        lines = [ln.strip().strip("|").split("|") for ln in m.group(3).strip().splitlines()]
        header = [c.strip() for c in lines[0]]
        rows = [dict(zip(header, (c.strip() for c in ln))) for ln in lines[2:]]
        out.append((m.group(1), m.group(2).split(","), rows))
    return out


def normalize(cell: str) -> str:
    """1,953 and 1953 are the same number; 0.50 and 0.5 too."""
    cell = cell.replace(",", "").strip("` ")
    try:
        return repr(float(cell))
    except ValueError:
        return cell


def table_disagreements(name: str, text: str) -> list[str]:
    """Every way the marked tables of an entry's text differ from their CSVs, one line each."""
    found = []
    for csv_path, columns, rows in markdown_tables(text):
        with open(REPO / csv_path) as f:
            expected = list(csv.DictReader(f))
        if len(rows) != len(expected):
            found.append(f"{name}: {csv_path} has {len(expected)} rows, the table {len(rows)}")
        for i, (got, want) in enumerate(zip(rows, expected)):
            for col in columns:
                if col not in got or normalize(got[col]) != normalize(want[col]):
                    found.append(
                        f"{name} {csv_path} row {i + 1} {col}: {got.get(col)!r}, the CSV {want[col]!r}"
                    )
    return found


@pytest.mark.parametrize("path", entries(), ids=lambda p: p.name)
def test_journal_tables_equal_their_csvs(path):
    assert not table_disagreements(path.name, path.read_text())


def test_normalize_folds_thousands_separators_and_trailing_zeros():
    assert normalize("1,953") == normalize("1953") == normalize("`1953.0`")
    assert normalize("0.50") == normalize("0.5")
    assert normalize("1,953") != normalize("1954")


def test_a_table_that_disagrees_with_its_csv_is_caught():
    """A real entry whose table is checked against its CSV, with one compared cell changed in
    memory (the file is not touched): the check the real entries pass must fail on it."""
    agree = [
        p
        for p in entries()
        if markdown_tables(p.read_text()) and not table_disagreements(p.name, p.read_text())
    ]
    if not agree:
        pytest.skip("no journal entry has a marked table that equals its CSV")
    path = agree[0]
    text = path.read_text()
    m = re.search(r"<!-- table: (\S+) columns=(\S+) -->\n((?:\|.*\|\n?)+)", text)
    csv_path, columns, table = m[1], m[2].split(","), m[3]
    with open(REPO / csv_path) as f:
        want = next(csv.DictReader(f))
    numeric = [c for c in columns if normalize(want[c]) != want[c].strip()]  # a number, if any is
    column = (numeric or columns)[0]
    header, _, first, *_ = table.splitlines()
    cells = first.split("|")
    k = [c.strip() for c in header.split("|")].index(column)
    right = want[column]
    cells[k] = f" {float(right.replace(',', '')) + 1:g} " if numeric else f" not-{right} "
    planted = text[: m.start(3)] + table.replace(first, "|".join(cells), 1) + text[m.end(3) :]
    found = table_disagreements(path.name, planted)
    assert found, f"a wrong {column} in {path.name}'s table of {csv_path} went unnoticed"
    assert f"{csv_path} row 1 {column}" in found[0], found


def notebook_pairs():
    return sorted(NOTEBOOKS.glob("day*.py"))


@pytest.mark.parametrize("py", notebook_pairs(), ids=lambda p: p.name)
def test_notebook_source_and_ipynb_agree(py):
    nb_path = py.with_suffix(".ipynb")
    assert nb_path.is_file(), f"{py.name} has no paired .ipynb"
    src = jupytext.read(py)
    nb = jupytext.read(nb_path)
    a = [(c.cell_type, c.source.strip()) for c in src.cells]
    b = [(c.cell_type, c.source.strip()) for c in nb.cells]
    assert a == b, f"{py.name} and {nb_path.name} disagree; run `make notebooks`"


@pytest.mark.parametrize("py", notebook_pairs(), ids=lambda p: p.name)
def test_notebook_is_executed(py):
    cells = [c for c in json.loads(py.with_suffix(".ipynb").read_text())["cells"] if c["cell_type"] == "code"]
    assert cells and all(c.get("execution_count") for c in cells), f"{py.name}: run `make notebooks`"


def sanitized(text: str) -> str:
    """`text` as nbval compares it: notebooks/sanitize.cfg's substitutions, read by nbval's own
    parser and applied in order, as its `sanitize` does."""
    from nbval.plugin import get_sanitize_patterns

    for regex, replace in get_sanitize_patterns((NOTEBOOKS / "sanitize.cfg").read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_sanitizer_masks_rounding_sized_figures_and_nothing_larger():
    # what differs between an AVX2 and an AVX-512 run of the same cell: masked alike
    for avx2, avx512 in [
        ("max |difference| 0.0e+00", "max |difference| 3.7e-09"),
        ("= 2e-05", "= 1e-05"),
        ("diff 8.4e-05 (logits", "diff 1.1e-04 (logits"),
        ("{1: '0.0e+00', 2: '2.4e-07'}", "{1: '0.0e+00', 2: '3.6e-07'}"),
        ("3.8e-06 = 2 fp32 ulp at 24.60", "9.5e-06 = 5 fp32 ulp at 24.60"),
        ("inner_product, brg_matmul:avx2, weights", "inner_product, brg_matmul:avx512_core, weights"),
    ]:
        assert sanitized(avx2) == sanitized(avx512), (avx2, avx512)
    # figures a wrong build would change are still compared
    for a, b in [
        ("off by 6.74e-01", "off by 6.75e-01"),
        ("gap of 1.11e-02", "gap of 1.12e-02"),
        ("max |difference| 2.19e+00", "max |difference| 0.0e+00"),
        ("tokens [15944, 48357]", "tokens [15944, 48358]"),
        ("package 7.7e-03", "package 7.8e-03"),
        ("3.04e-02 at most", "3.05e-02 at most"),
        ("rank2e-05x", "rank3e-05x"),
    ]:
        assert sanitized(a) != sanitized(b), (a, b)
