"""Small helpers the course's notebooks and day scripts share; nothing the engine uses.

* `diagram_path(name)`: where a notebook saves a figure. Under `make notebooks`
  (NANOSERVE_WRITE_DIAGRAMS=1) that is the repo's `diagrams/`; otherwise, and so under
  `pytest --nbval`, a temporary folder, so running a notebook never changes a tracked file.
* `write_csv(rows, path)`: a day script's table, written the same way every time.
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def diagram_path(name: str) -> Path:
    if os.environ.get("NANOSERVE_WRITE_DIAGRAMS"):
        folder = REPO / "diagrams"
    else:
        folder = Path(tempfile.gettempdir()) / "nanoserve-diagrams"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def write_csv(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path
