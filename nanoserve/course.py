"""Small helpers the course's notebooks and day scripts share; nothing the engine uses.

* `diagram_path(name)`: where a notebook saves a figure. Under `make notebooks`
  (NANOSERVE_WRITE_DIAGRAMS=1) that is the repo's `diagrams/`; otherwise, and so under
  `pytest --nbval`, a temporary folder, so running a notebook never changes a tracked file.
* `write_csv(rows, path)`: a day script's table, written the same way every time.
* `tiny_config(...)`, `tiny_llama(seed, std, ...)`: the random-weight Llama the day scripts run
  when the default model would be slower than the idea needs (2 layers, hidden 64, vocab 256).
* `cpu_profile()`: `torch.profiler` over the CPU without the lines it prints from C++.
* `ServerThread(app)`: uvicorn serving an app on a background thread, for notebooks and tests;
  `served(engine)`: the same around `create_app(engine)`, its boot line kept off stderr.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
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
    """Rows to CSV; the columns are every key in order of first appearance (a row without one
    leaves it empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path


def tiny_config(max_position_embeddings: int = 512):
    """The day scripts' tiny Llama: 2 layers, hidden 64, 4 heads (2 KV, head dim 16), vocab 256."""
    from nanoserve.models import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
    )


def tiny_llama(seed: int = 0, std: float = 0.05, max_position_embeddings: int = 512):
    """`tiny_config`'s model with every weight drawn from N(0, std) after seeding torch."""
    import torch

    from nanoserve.models import Llama

    torch.manual_seed(seed)
    model = Llama(tiny_config(max_position_embeddings))
    for p in model.parameters():
        p.normal_(0, std)
    return model.eval()


@contextmanager
def _fd2_to_devnull():
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextmanager
def cpu_profile():
    """`torch.profiler.profile` over the CPU. Its start and stop each write a timestamped line
    from C++ straight to file descriptor 2 (which would land in a notebook's outputs); those
    two calls run with it pointed at /dev/null."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _fd2_to_devnull():
        prof.start()
    try:
        yield prof
    finally:
        with _fd2_to_devnull():
            prof.stop()


class ServerThread:
    """uvicorn serving `app` on a background thread, for tests and notebooks:

        with ServerThread(create_app(engine)) as url:     # url = "http://127.0.0.1:PORT"
            httpx.get(url + "/health")

    Port 0 picks a free port. Leaving the block shuts the server down (the lifespan stops the
    engine loop, aborting anything still in flight)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextlib.contextmanager
def served(engine):
    """`create_app(engine)` on a free loopback port, its boot line kept off stderr; yields the URL."""
    from nanoserve.serve import create_app

    with contextlib.redirect_stderr(io.StringIO()):
        server = ServerThread(create_app(engine))
        url = server.__enter__()
    try:
        yield url
    finally:
        server.__exit__(None, None, None)
