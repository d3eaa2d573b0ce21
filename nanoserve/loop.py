"""The engine loop (day 47): one thread owns the engine; the server only talks to it.

The engine is not thread-safe and does not need to be. `EngineLoop` is the only code that
touches it: it drains its inbox (adds, aborts, a cut), runs one step whenever there is work,
and hands each step's outputs to the request handlers through their sinks (thread-safe
callables that put an item on a handler's asyncio queue). What a handler's queue receives:

    Accepted                        the engine took the request
    RequestOutput                   tokens and text; finish_reason set on the last one
                                    ("error" with .error when this request alone failed)
    Refused(message, status)        the request was not taken, or ended without finishing

Faults are contained at three levels:
* one row: the engine ends a row it cannot sample or detokenize with finish_reason "error";
  the rest of its step goes on (engine.py);
* one request's admission: `add_request` raising anything (a bad request's ValueError, or a
  bug) refuses that request alone, 400 or 500, and gives back whatever the engine took of it;
* one step: a step that raises (a bug, not a bad request) ends the requests in flight with a
  500 and the loop goes on, unless the error says no later step can run (`fatal`, as a lost
  tensor-parallel rank's `tp.RankLost` does): then the loop dies, as below;
* the loop itself: anything that escapes it (its own hand-off code, say) marks it dead with
  the reason, ends every request in flight and every request still in the inbox, and calls
  `on_death(reason)` so the server can turn /health to 503 "failed". `submit` on a dead loop
  answers at once, and a handler waiting on its queue checks `alive` between waits, so no
  handler waits forever.

Draining (a graceful shutdown) is `accepting = False` (new submits are refused with 503), then
waiting for `in_flight` to reach 0, then `cut(message)` for whatever is left.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from nanoserve.api import APIError
from nanoserve.engine import Engine, RequestOutput
from nanoserve.errors import NanoserveError
from nanoserve.sampling import SamplingParams


@dataclasses.dataclass
class _Stream:
    sink: Callable[[Any], None]  # thread-safe: puts an item on the handler's asyncio queue
    arrival: float
    prompt_tokens: int
    last: float | None = None  # when its previous token came out
    generated: int = 0


class Accepted:
    """The first item on a handler's queue when the engine took its request."""


@dataclasses.dataclass
class Refused:
    """The engine loop's answer when it cannot take or finish a request."""

    message: str
    status: int = 400
    retry_after: int | None = None  # seconds, for a 503 a client may retry

    def error(self) -> APIError:
        kind = "server_busy" if self.status == 429 else "server_error" if self.status >= 500 else None
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return APIError(self.status, self.message, type=kind or "invalid_request_error", headers=headers)


class EngineLoop:
    """Owns the engine: drains the inbox, steps, hands out the outputs (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        metrics=None,
        max_waiting: int = 1024,
        on_death: Callable[[str], None] | None = None,
    ):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.on_death = on_death
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.steps = 0
        self.failure: str | None = None  # why the loop died, once it has
        self.accepting = True  # False while draining: new requests are refused
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    # --- the handlers' side (any thread) -------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.failure is None and self.thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests taken and not yet finished, plus requests still in the inbox."""
        return len(self.streams) + self.inbox.qsize()

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink, after: str | None = None
    ) -> None:
        """Hand a request to the engine; `after` as in `Engine.add_request` (a sample that
        shares an earlier one's prompt)."""
        if self.failure is not None:
            sink(Refused(f"the engine is not running ({self.failure})", 503))
        elif not self.accepting:
            sink(Refused("the server is shutting down and takes no new requests", 503, retry_after=5))
        else:
            self.inbox.put(("add", request_id, prompt_ids, params, sink, time.perf_counter(), after))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def cut(self, message: str) -> None:
        """End every request in flight with `message` as a 503, on the loop's next turn."""
        self.inbox.put(("cut", message))

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=30)

    # --- the loop's side ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
        except BaseException as e:  # noqa: BLE001 -- whatever it was, no handler may wait on a dead loop
            self.failure = f"the engine loop stopped: {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        finally:
            message = self.failure or "the server is shutting down; the request was aborted"
            self._fail_all(message, 500 if self.failure else 503)
            self._refuse_inbox(message)
            if self.failure is not None and self.on_death is not None:
                self.on_death(self.failure)

    def _turn(self) -> None:
        try:
            block = not self.engine.has_unfinished()
            self._handle(self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait())
            while True:  # everything else that arrived, before the next step
                self._handle(self.inbox.get_nowait())
        except queue.Empty:
            pass
        if self._stop.is_set() or not self.engine.has_unfinished():
            return
        try:
            outs = self.engine.step()
        except Exception as e:  # a bug, not a bad request: end what is in flight, keep serving
            if getattr(e, "fatal", False):  # no later step can run (a tensor-parallel rank died)
                raise
            traceback.print_exc(file=sys.stderr)
            self._fail_all("the engine failed on this step; the request was aborted", 500)
            return
        self.steps += 1
        self._deliver(outs, time.perf_counter())

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "add":
            _, rid, prompt_ids, params, sink, arrival, after = item
            if len(self.engine.scheduler.waiting) >= self.max_waiting:
                self._tell(
                    sink, Refused(f"the server has {self.max_waiting} requests waiting; try again later", 429)
                )
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, after=after)
            except (ValueError, NanoserveError) as e:  # a bad request: its sentence, as a 400
                self._tell(sink, Refused(str(e)))
                return
            except Exception as e:  # a bug met while admitting: this request ends, the loop serves on
                traceback.print_exc(file=sys.stderr)
                try:  # whatever the engine took of it goes back (a half-added request)
                    self.engine.abort(rid)
                except Exception:
                    traceback.print_exc(file=sys.stderr)
                self._tell(
                    sink, Refused(f"the server failed to admit this request ({type(e).__name__})", 500)
                )
                return
            self.streams[rid] = _Stream(sink, arrival, len(prompt_ids))
            self._send(rid, self.streams[rid], Accepted())
        elif kind == "abort":
            stream = self.streams.pop(item[1], None)
            try:
                aborted = stream is not None and self.engine.abort(item[1])
            except Exception:  # the abort of one request broke: that request is ended all the same
                traceback.print_exc(file=sys.stderr)
                aborted = stream is not None
            if aborted:
                self._send(item[1], stream, RequestOutput(item[1], [], finish_reason="abort"))
                self._count_finished(stream, "abort")
        elif kind == "cut":
            self._fail_all(item[1], 503)

    def _deliver(self, outs: list[RequestOutput], now: float) -> None:
        """Hand one step's outputs to their handlers, and count them."""
        for out in outs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                self.metrics.token(stream, now, len(out.new_token_ids))
            stream.generated += len(out.new_token_ids)
            stream.last = now
            if out.finished:
                del self.streams[out.request_id]
                self._count_finished(stream, out.finish_reason)
            self._send(out.request_id, stream, out)

    @staticmethod
    def _tell(sink, item) -> None:
        """Hand `item` to a sink whose request the loop no longer holds (refused, or being ended):
        if it raises, the traceback goes to stderr and nothing else is owed."""
        try:
            sink(item)
        except Exception:
            traceback.print_exc(file=sys.stderr)

    def _send(self, rid: str, stream: _Stream, item) -> None:
        """One handler's sink; if it raises (its event loop is gone), that request alone ends."""
        try:
            stream.sink(item)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            if rid in self.streams:
                del self.streams[rid]
                self.engine.abort(rid)
                self._count_finished(stream, "abort")

    def _count_finished(self, stream: _Stream, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.finished(stream, reason)

    def _fail_all(self, message: str, status: int) -> None:
        for rid, stream in list(self.streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                traceback.print_exc(file=sys.stderr)
            self._tell(stream.sink, Refused(message, status))
            try:
                self._count_finished(stream, "error")
            except Exception:
                traceback.print_exc(file=sys.stderr)
        self.streams.clear()

    def _refuse_inbox(self, message: str) -> None:
        """Requests submitted but never taken: told so, rather than left waiting."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._tell(item[4], Refused(message, 503))
