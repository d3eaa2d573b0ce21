"""`make book`: the course as a static site, built from what the repository holds right now.

    python book/build.py                       # pages into build/book/docs, the site into build/site
    python book/build.py --out DIR --site DIR  # elsewhere (tests/test_book.py builds into a tmp dir)
    python book/build.py --pages-only          # lay out the pages and the config, skip mkdocs

Two stages. First this script lays out a docs tree under --out, and nothing of it is committed:

* a day with a journal entry (`journal/day-NN.md`) is a written day. Its page is the entry, with
  the diagram(s) its Diagram section names shown under that heading, followed by its executed
  notebook (`notebooks/dayNN_*.ipynb`) cell by cell as Markdown: code, then the committed
  outputs (text, and images written next to the page). Notebooks are read, never executed;
* every other day of `book/daymap.md` (the days planned but not written yet) gets a short
  page: title, phase, date, "not written yet", and what the day map says it will cover;
* one page per phase, the day map, the calendar (`journal/README.md` with each day linked to its
  page), and the hand-written pages of `book/` (start here, glossary, how we time things);
* `days/`, `diagrams/`, the notebooks and `nanoserve/*.py` are copied beside the pages, so an
  entry's or a notebook's relative links (`../days/day55/warmbench.py`) resolve in the book too.

Then it writes a config that inherits `mkdocs.yml` and adds the navigation, and runs
`mkdocs build --strict` on it: a broken link, a missing anchor or a nav entry without its page
fails the build (mkdocs.yml's `validation` settings make them warnings, `--strict` errors).
Before that, this script refuses a written day that lacks its notebook (or a notebook without
its entry) and an entry that names a diagram `diagrams/` does not have. After the build it
checks that no page asks a browser to fetch anything from the network.
"""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import yaml

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
HANDWRITTEN = ["index.md", "glossary.md", "timing.md", "extra.css"]  # copied as they are


class BookError(Exception):
    """Something the book cannot be built from; the message says what and where."""


# --- what the course holds ------------------------------------------------------------------


@dataclasses.dataclass
class Day:
    number: int | None  # None: a planned phase-6 day, numbered when it lands
    title: str  # short, for the navigation
    covers: str  # the day map's whole line, as Markdown
    phase: int
    slug: str  # the page's name under days/, without .md

    @property
    def label(self) -> str:
        return f"Day {self.number} · {self.title}" if self.number else self.title


@dataclasses.dataclass
class Phase:
    number: int
    name: str
    blurb: str
    days: list[Day]

    @property
    def page(self) -> str:
        return f"phase-{self.number}/index.md"  # index.md: the page of its section in the nav

    @property
    def label(self) -> str:
        return f"Phase {self.number} · {self.name}"


def read_daymap(path: Path = BOOK / "daymap.md") -> tuple[str, list[Phase]]:
    """The intro paragraph(s) and the phases of book/daymap.md, in order."""
    text = re.sub(r"<!--.*?-->\n?", "", path.read_text(), flags=re.S)
    intro, *blocks = re.split(r"^## Phase ", text, flags=re.M)
    phases = []
    for block in blocks:
        head, *lines = block.splitlines()
        m = re.fullmatch(r"(\d) — (.+)", head.strip())
        if not m:
            raise BookError(f"{path}: a phase heading is '## Phase N — Name', got '## Phase {head}'")
        number, name = int(m[1]), m[2]
        days, blurb = [], []
        for line in lines:
            item = re.fullmatch(r"(?:(\d+)\.|-) \*\*(.+?)\*\*:?\s*(.*)", line.strip())
            if item:
                n = int(item[1]) if item[1] else None
                title, rest = item[2], item[3]
                covers = (
                    f"{title}: {rest}" if rest and not rest.startswith("(") else f"{title} {rest}".strip()
                )
                slug = (
                    f"day-{n:02d}" if n else "beyond-" + re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
                )
                days.append(Day(n, title.replace("`", ""), covers, number, slug))
            elif line.strip() and not days:
                blurb.append(line.strip())
        phases.append(Phase(number, name, " ".join(blurb), days))
    numbers = [d.number for p in phases for d in p.days if d.number]
    if numbers != list(range(1, len(numbers) + 1)):
        raise BookError(f"{path}: the days must be numbered 1, 2, ... in order; got {numbers}")
    return intro.split("\n", 1)[1].strip(), phases


CALENDAR_ROW = re.compile(r"^\| (\d+) \| (\S+) \| (\w+) \| (\d+) \| (\d) ([^|]+?) \| ([^|]+?) \|$", re.M)


def read_calendar(path: Path = REPO / "journal" / "README.md") -> dict[int, str]:
    """day -> "2026-09-09 · Wed · Week 13" from the calendar table of journal/README.md."""
    return {int(n): f"{d} · {wd} · Week {w}" for n, d, wd, w, *_ in CALENDAR_ROW.findall(path.read_text())}


def day_files(n: int) -> tuple[Path | None, Path | None]:
    """(journal entry, executed notebook) of day n, each None when the repository lacks it."""
    entry = REPO / "journal" / f"day-{n:02d}.md"
    notebooks = sorted((REPO / "notebooks").glob(f"day{n:02d}_*.ipynb"))
    if len(notebooks) > 1:
        raise BookError(
            f"day {n} has {len(notebooks)} notebooks ({', '.join(p.name for p in notebooks)}); keep one"
        )
    return (entry if entry.is_file() else None), (notebooks[0] if notebooks else None)


# --- Markdown helpers -----------------------------------------------------------------------

FOLD_PLOTS = 20  # a code cell this long that draws a figure is folded, the figure shown open below it
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def fence(text: str, lang: str, css: str | None = None) -> str:
    """A fenced block that no backtick run inside text can close early."""
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    info = f"{{.{lang} .{css}}}" if css else lang
    return f"{ticks}{info}\n{text.rstrip()}\n{ticks}"


def outside_fences(text: str, edit) -> str:
    """Apply edit(line) to every line of Markdown text that is not inside a code fence."""
    out, fenced = [], None
    for line in text.splitlines():
        m = re.match(r"\s*(`{3,}|~{3,})", line)
        if m and (fenced is None or m[1].startswith(fenced)):
            fenced = None if fenced else m[1]
            out.append(line)
        else:
            out.append(line if fenced else edit(line))
    return "\n".join(out)


def numbers_stay_text(text: str) -> str:
    """A wrapped line inside a list item that happens to start with a number ("...1536 rows of
    / 576. Every shape...") continues the item's paragraph in CommonMark, which the entries and
    notebooks are written for, but starts a new item in Python-Markdown. Escape its period."""
    out, content_col, prev = [], None, ""
    for line in text.splitlines():
        m = re.match(r"( *)(\d+)\. ", line)
        if m and prev.strip() and content_col is not None and len(m[1]) >= content_col and m[2] != "1":
            line = f"{m[1]}{m[2]}\\. {line[m.end() :]}"
        else:
            item = re.match(r"( *)(\d+\.|[*+-]) +", line)
            if item:
                content_col = item.end()
            elif not line.strip() and not prev.strip():
                content_col = None
        out.append(line)
        prev = line
    return "\n".join(out)


def clean_stream(text: str) -> str:
    """Terminal text as it ended up on screen: no colour codes, a \\r-rewritten line (a
    progress bar) shown as its last state."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in ANSI.sub("", text).split("\n"))


# --- pages ----------------------------------------------------------------------------------


def notebook_markdown(nb_path: Path, out_dir: Path, stem: str) -> str:
    """The executed notebook as Markdown for a page in days/: headings one level down under a
    "The notebook" heading, code as python blocks, outputs as they were committed. Images are
    written to out_dir (days/out/) as stem-cCELL-K.png."""
    nb = nbformat.read(nb_path, as_version=4)
    parts, titled = [], False

    def heading(line: str) -> str:
        nonlocal titled
        m = re.match(r"(#{1,5}) (.*)", line)
        if not m:
            return line
        if len(m[1]) == 1 and not titled:
            titled = True
            title = re.sub(r"^Day \d+\s*[—:-]\s*", "", m[2])
            return f"## The notebook: {title}"
        return "#" + line

    def links(line: str) -> str:  # a notebook's relative links, as seen from days/
        line = line.replace("](../journal/", "](")
        return re.sub(r"\]\(day(\d\d)_[\w-]+\.ipynb", r"](day-\1.md", line)

    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            parts.append(numbers_stay_text(outside_fences(cell.source, lambda ln: links(heading(ln)))))
            continue
        if cell.cell_type != "code":
            continue
        draws = any(
            m in o.get("data", {}) for o in cell.get("outputs", []) for m in ("image/png", "image/svg+xml")
        )
        lines = cell.source.count("\n") + 1
        if draws and lines >= FOLD_PLOTS:  # the figure is what a reader looks at; its code is one click away
            code = "\n".join(f"    {ln}" if ln else "" for ln in fence(cell.source, "python").splitlines())
            parts.append(f'??? example "The code that draws the figure below ({lines} lines)"\n\n{code}')
        elif cell.source.strip():
            parts.append(fence(cell.source, "python"))
        outputs: list[dict] = []
        for out in cell.get("outputs", []):  # one block for what a cell printed in a row
            last = outputs[-1] if outputs else {}
            if out.get("output_type") == "stream" and last.get("output_type") == "stream":
                if last.get("name") == out.get("name"):
                    outputs[-1] = {**last, "text": last.get("text", "") + out.get("text", "")}
                    continue
            outputs.append(out)
        for k, out in enumerate(outputs):
            kind = out.get("output_type")
            if kind == "stream":
                css = "nb-output" if out.get("name") == "stdout" else "nb-stderr"
                parts.append(fence(clean_stream(out.get("text", "")), "text", css))
            elif kind == "error":
                tb = clean_stream("\n".join(out.get("traceback", [])))
                parts.append(fence(tb or f"{out.get('ename')}: {out.get('evalue')}", "text", "nb-error"))
            elif kind in ("display_data", "execute_result"):
                data = out.get("data", {})
                image = next((m for m in ("image/png", "image/jpeg", "image/svg+xml") if m in data), None)
                if image:
                    ext = {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg"}[image]
                    name = f"{stem}-c{i}-{k}.{ext}"
                    out_dir.mkdir(parents=True, exist_ok=True)
                    raw = data[image]
                    blob = raw.encode() if ext == "svg" else base64.b64decode(raw)
                    (out_dir / name).write_bytes(blob)
                    parts.append(f"[![output of cell {i}](out/{name})](out/{name})")
                elif "text/html" in data:
                    parts.append(f'<div class="nb-html" markdown="0">\n{data["text/html"].strip()}\n</div>')
                elif "text/markdown" in data:
                    parts.append(data["text/markdown"])
                elif "text/plain" in data:
                    parts.append(fence(clean_stream(data["text/plain"]), "text", "nb-output"))
    if not titled:
        parts.insert(0, f"## The notebook: {nb_path.name}")
    return "\n\n".join(parts) + "\n"


def diagrams_named(entry_text: str) -> list[str]:
    """The PNGs an entry's Diagram section names (`name.png`), as tests/test_course.py reads them."""
    section = (
        entry_text.split("\n## Diagram", 1)[-1].split("\n## ", 1)[0] if "\n## Diagram" in entry_text else ""
    )
    return list(dict.fromkeys(re.findall(r"`([\w-]+\.png)`", section)))


def written_page(day: Day, phase: Phase, entry: Path, notebook: Path, docs: Path) -> str:
    text = numbers_stay_text(entry.read_text())
    rel = lambda p: p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(p)  # noqa: E731
    images = diagrams_named(text)
    for png in images:
        if not (REPO / "diagrams" / png).is_file():
            raise BookError(
                f"{rel(entry)} names diagrams/{png} in its Diagram section, and diagrams/ has no such file"
            )
    if images:
        shown = "\n\n".join(f"[![{png}](../diagrams/{png})](../diagrams/{png})" for png in images)
        text = re.sub(r"^## Diagram\n", lambda m: f"## Diagram\n\n{shown}\n", text, count=1, flags=re.M)
    n = day.number
    files = [
        f"[`{rel(notebook)}`](../notebooks/{notebook.name}) (executed, as committed)",
        f"its source [`{notebook.with_suffix('.py').name}`](../notebooks/{notebook.stem}.py)"
        if notebook.with_suffix(".py").is_file()
        else None,
    ]
    script_dir = REPO / "days" / f"day{n:02d}"
    scripts = sorted(script_dir.glob("*.py")) if script_dir.is_dir() else []
    csvs = sorted(script_dir.glob("*.csv")) if script_dir.is_dir() else []
    lines = [f"* notebook: {', '.join(f for f in files if f)}"]
    if scripts or csvs:
        listed = ", ".join(f"[`{rel(p)}`](day{n:02d}/{p.name})" for p in scripts + csvs)
        lines.append(f"* the day's script and what it writes: {listed}")
    if images:
        lines.append("* diagram: " + ", ".join(f"[`diagrams/{png}`](../diagrams/{png})" for png in images))
    box = '!!! abstract "This day\'s files"\n\n' + "\n".join("    " + ln for ln in lines)
    head, sep, body = text.partition("\n## ")
    notebook_md = notebook_markdown(notebook, docs / "days" / "out", f"day-{n:02d}")
    intro = "The day's journal entry, then its notebook with the outputs it was committed with."
    return f"{head.rstrip()}\n\n{intro}\n\n{box}\n\n{sep.strip()} {body.rstrip()}\n\n---\n\n{notebook_md}"


DAYS_NAMED = re.compile(r"\b[Dd]ays? (\d+(?:\s*(?:-|,|and)\s*\d+)*)")


def package_days() -> dict[int, list[tuple[str, str]]]:
    """day -> [(module file, its docstring's first paragraph)] for every module of nanoserve/
    whose first paragraph names the day ("(day 16)", "(days 14-15, prefix caching days 19-20)")."""
    found: dict[int, list[tuple[str, str]]] = {}
    for path in sorted((REPO / "nanoserve").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        for m in DAYS_NAMED.finditer(summary):
            for part in re.split(r"\s*(?:,|and)\s*", m[1]):
                first, _, last = part.partition("-")
                for n in range(int(first), int(last or first) + 1):
                    if (path.name, summary) not in found.setdefault(n, []):
                        found[n].append((path.name, summary))
    return found


def planned_page(day: Day, phase: Phase, calendar: dict[int, str], modules: list[tuple[str, str]]) -> str:
    if day.number:
        when = calendar.get(day.number, "")
        head = f"# Day {day.number}: {day.title}\n\n{when} · {phase.label} · *planned*"
    else:
        head = f"# {day.title}\n\n{phase.label} · *planned*: numbered from 57 in the order it lands"
    return (
        f"{head}\n\n"
        '!!! note "Not written yet"\n\n'
        "    This day has no journal entry and no notebook yet. From the day map, it will cover:\n\n"
        f"    {day.covers}\n\n"
        + (
            "The package already holds the code; the module docstrings that name this day:\n\n"
            + "".join(
                f"* [`nanoserve/{name}`](../nanoserve/{name}): {summary}\n" for name, summary in modules
            )
            + "\n"
            if modules
            else ""
        )
        + f"Back to [{phase.label}](../{phase.page}), or to [the day map](../daymap.md).\n"
    )


def status(day: Day) -> str:
    return "written" if day.number and day_files(day.number)[0] else "planned"


def phase_page(phase: Phase, calendar: dict[int, str]) -> str:
    rows = ["| day | date | what it covers | entry |", "|---|---|---|---|"]
    for d in phase.days:
        name = f"[Day {d.number}](../days/{d.slug}.md)" if d.number else f"[{d.title}](../days/{d.slug}.md)"
        date = calendar.get(d.number, "").split(" · ")[0] if d.number else "—"
        rows.append(f"| {name} | {date} | {d.covers} | {status(d)} |")
    return f"# {phase.label}\n\n{phase.blurb}\n\n" + "\n".join(rows) + "\n"


def daymap_page(intro: str, phases: list[Phase]) -> str:
    out = [f"# The day map\n\n{intro}\n"]
    for p in phases:
        out.append(f"## [{p.label}]({p.page})\n\n{p.blurb}\n")
        for d in p.days:
            mark = "" if status(d) == "written" else " *(planned)*"
            out.append(f"* [{d.label}](days/{d.slug}.md){mark}: {d.covers}")
        out.append("")
    return "\n".join(out) + "\n"


def calendar_page(path: Path, days: dict[int, Day]) -> str:
    """journal/README.md with every day number linked to its page (all in days/, beside it)."""

    def link(m: re.Match) -> str:
        n = int(m[1])
        return f"| [{n}]({days[n].slug}.md) |" if n in days else m[0]

    return re.sub(r"^\| (\d+) \|", link, path.read_text(), flags=re.M)


# --- the docs tree, the config, the build ---------------------------------------------------


def copy_tree(src: Path, dst: Path, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        for p in sorted(src.glob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                target = dst / p.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, target)


def lay_out(out: Path, site: Path) -> Path:
    """Write the docs tree under out/docs and out/mkdocs.yml; return the config's path."""
    docs = out / "docs"
    if docs.exists():
        shutil.rmtree(docs)
    (docs / "days").mkdir(parents=True)
    intro, phases = read_daymap()
    calendar = read_calendar()
    numbers = [d.number for p in phases for d in p.days if d.number]
    missing = [n for n in numbers if n not in calendar]
    if missing:
        raise BookError(
            f"journal/README.md's calendar has no row for day {missing[0]} (of {len(missing)} missing)"
        )
    numbered = {d.number: d for p in phases for d in p.days if d.number}
    mentions = package_days()
    for name in HANDWRITTEN:
        shutil.copyfile(BOOK / name, docs / name)
    copy_tree(REPO / "diagrams", docs / "diagrams", ("*.png", "*.svg"))
    copy_tree(REPO / "days", docs / "days", ("*/*.py", "*/*.csv"))
    copy_tree(REPO / "notebooks", docs / "notebooks", ("day*.ipynb", "day*.py"))
    copy_tree(REPO / "nanoserve", docs / "nanoserve", ("*.py",))

    entries = {int(p.stem[4:]) for p in (REPO / "journal").glob("day-*.md")}
    unmapped = sorted(entries - set(numbered))
    if unmapped:
        n = unmapped[0]
        raise BookError(f"journal/day-{n:02d}.md has no day {n} in book/daymap.md; add it there")
    nav: list = [
        {
            "Start here": [
                "index.md",
                {"The day map": "daymap.md"},
                {"Glossary": "glossary.md"},
                {"How we time things": "timing.md"},
                {"Calendar": "days/README.md"},
            ]
        }
    ]
    for phase in phases:
        (docs / phase.page).parent.mkdir()
        (docs / phase.page).write_text(phase_page(phase, calendar))
        items: list = [phase.page]
        for day in phase.days:
            entry, notebook = day_files(day.number) if day.number else (None, None)
            if entry and not notebook:
                raise BookError(
                    f"day {day.number} has a journal entry but no notebooks/day{day.number:02d}_*.ipynb"
                )
            if notebook and not entry:
                raise BookError(
                    f"day {day.number} has {notebook.name} but no journal/day-{day.number:02d}.md"
                )
            if entry:
                page = written_page(day, phase, entry, notebook, docs)
            else:  # the status marks it "planned" in the navigation (mkdocs.yml, extra.css)
                modules = mentions.get(day.number, []) if day.number else []
                page = f"---\nstatus: planned\n---\n\n{planned_page(day, phase, calendar, modules)}"
            (docs / "days" / f"{day.slug}.md").write_text(page)
            items.append({day.label: f"days/{day.slug}.md"})
        nav.append({phase.label: items})
    (docs / "daymap.md").write_text(daymap_page(intro, phases))
    (docs / "days" / "README.md").write_text(calendar_page(REPO / "journal" / "README.md", numbered))

    config = out / "mkdocs.yml"
    settings = {
        "INHERIT": os.path.relpath(REPO / "mkdocs.yml", out),
        "docs_dir": "docs",
        "site_dir": os.path.relpath(site, out),
        "nav": nav,
    }
    config.write_text(
        "# Written by book/build.py for this build; the settings are in mkdocs.yml.\n"
        + yaml.safe_dump(settings, sort_keys=False, allow_unicode=True, width=200)
    )
    return config


FETCHES = re.compile(
    r"<(?:script|img|iframe|source)\b[^>]*\bsrc=\"(https?:)?//|<link\b[^>]*\bhref=\"(https?:)?//", re.I
)


def check_offline(site: Path) -> None:
    """No page may make a browser fetch a script, a style sheet, a font or an image from the network."""
    for page in sorted(site.rglob("*.html")):
        m = FETCHES.search(page.read_text(errors="replace"))
        if m:
            snippet = page.read_text(errors="replace")[m.start() : m.start() + 120]
            raise BookError(f"{page.relative_to(site)} fetches from the network: {snippet}")


def build(out: Path, site: Path, capture: bool = False) -> subprocess.CompletedProcess:
    config = lay_out(out, site)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(config)]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # material's end-of-life banner, once per build
    run = subprocess.run(cmd, capture_output=capture, text=True, env=env)
    if run.returncode == 0:
        check_offline(site)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "build" / "book", help="the docs tree and config")
    ap.add_argument("--site", type=Path, default=REPO / "build" / "site", help="the rendered site")
    ap.add_argument("--pages-only", action="store_true", help="lay out the pages, do not run mkdocs")
    args = ap.parse_args(argv)
    try:
        if args.pages_only:
            print(lay_out(args.out.resolve(), args.site.resolve()))
            return 0
        run = build(args.out.resolve(), args.site.resolve())
    except BookError as e:
        print(f"book: error: {e}", file=sys.stderr)
        return 1
    if run.returncode == 0:
        print(f"book: {args.site.resolve() / 'index.html'}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
