"""uvicorn on a background thread: `ServerThread(app)` and `served(engine)`, for the benchmarks
(`bench.py` serves nanoserve next to its peers), the tests and the course's notebooks."""

from __future__ import annotations

import contextlib
import io
import threading
import time


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
