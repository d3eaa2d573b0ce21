"""The server as a process (days 44, 46, 56): `serve()` and its graceful stop.

    serve(EngineConfig(model=...), host="127.0.0.1", port=8000)   # the CLI's `nanoserve serve`

`serve()` checks what can be checked before listening (the model directory, the port), builds
the app (serve.create_app) with the engine built and warmed on a background thread, and runs it
under uvicorn until a signal. The first SIGTERM or SIGINT drains (`drain`): new requests get 503
with Retry-After, requests in flight run to the end for up to `drain_timeout` seconds, what is
left then ends with an error event, and the process exits 0. A second signal stops at once. A
stop while the engine is still loading leaves with `os._exit(0)`: the build thread is inside
torch, and finalizing the interpreter under it aborts the process.

What it leaves to others: the routes (serve.py), what /health says (status.py), the engine
loop's own `cut` and `in_flight` (loop.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from nanoserve.api import MAX_BODY_BYTES, MAX_SCORE_ENTRIES
from nanoserve.errors import NanoserveError
from nanoserve.status import ServerState


def drain(state: ServerState, timeout: float) -> int:
    """A graceful stop's first half: refuse new work, let what is in flight finish for up to
    `timeout` seconds, then end the rest with an error. Returns how many were cut."""
    loop = state.loop
    if loop is None or state.phase != "ready":
        return 0  # still loading or warming, or failed: nothing was admitted
    state.phase = "draining"
    loop.accepting = False
    deadline = time.monotonic() + timeout
    while loop.in_flight and loop.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    left = loop.in_flight
    if left and loop.alive:
        loop.cut(f"the server shut down before this request finished (the drain timeout is {timeout:g} s)")
        deadline = time.monotonic() + 5
        while loop.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
    return left


def _draining_server(config, state: ServerState, drain_timeout: float):
    """A uvicorn server whose first SIGTERM/SIGINT drains (`drain`) and then exits; a second
    stops at once. The signal is not re-raised afterwards, so a drained process exits 0."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drainer: threading.Thread | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.drainer is not None:  # a second signal: stop now
                if state.loop is not None:
                    state.loop.cut("the server was stopped before this request finished")
                self.should_exit = True
                return
            if state.phase != "ready":
                print(f"nanoserve: stopping (the engine was {state.phase})", file=sys.stderr, flush=True)
                self.should_exit = True
                return
            print(
                f"nanoserve: draining {state.loop.in_flight} request(s), up to {drain_timeout:g} s; "
                "signal again to stop now",
                file=sys.stderr,
                flush=True,
            )
            self.drainer = threading.Thread(target=self._drain, name="nanoserve-drain", daemon=True)
            self.drainer.start()

        def _drain(self) -> None:
            cut = drain(state, drain_timeout)
            if cut:
                print(f"nanoserve: {cut} request(s) cut at the drain timeout", file=sys.stderr, flush=True)
            self.should_exit = True

    return DrainingServer(config)


def serve(
    config,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_score_entries: int = MAX_SCORE_ENTRIES,
    served_model_names: list[str] | None = None,
    drain_timeout: float = 30.0,
    log_level: str = "warning",
    app_options: dict | None = None,
) -> None:
    """Build, warm and serve until a signal (the CLI's `nanoserve serve`). Mistakes that can be
    found before listening (a bad model directory, a port in use) raise NanoserveError; an engine
    that fails to build after the socket is open stops the server, also as a NanoserveError.
    `app_options`: more of create_app's options (CORS, the access log). uvicorn's own access log
    stays off: the app writes its own line per request, with the request id."""
    import socket

    import uvicorn

    from nanoserve.engine import build_engine
    from nanoserve.serve import create_app
    from nanoserve.weights import resolve_model_dir

    config.validate()
    resolve_model_dir(config.model)  # fetch (first run) or check the directory before listening
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as e:
            raise NanoserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    failed: list[str] = []

    def on_failure(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    app = create_app(
        lambda on_phase: build_engine(config, on_phase),
        api_key=api_key,
        address=f"{host}:{port}",
        max_waiting=max_waiting,
        max_body_bytes=max_body_bytes,
        max_score_entries=max_score_entries,
        served_model_names=served_model_names,
        on_failure=on_failure,
        **(app_options or {}),
    )
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5
    )
    server = _draining_server(uv_config, app.state.nanoserve, drain_timeout)
    print(
        f"nanoserve: loading and warming; http://{host}:{port}/health says 503 until ready",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if failed:
        raise NanoserveError(f"the engine failed to start ({failed[0]})")
    builder = app.state.build_thread
    if builder is not None and builder.is_alive():
        # stopped while loading or warming: the build thread is inside torch, and letting the
        # interpreter finalize under it aborts the process; nothing was admitted, so leave now
        sys.stderr.flush()
        os._exit(0)
