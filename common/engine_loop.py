"""The engine-facing half of the server: one thread that drives engine.step().

Everything the server does with an engine happens here, on one thread, through the
four calls of common/engine.py (add_request, abort, step, has_work), token ids only.
The HTTP side never calls the engine: it hands requests in with submit() and abort(),
and each request's TokenEvents come back through the sink it gave (a function that
puts them on that request's asyncio queue):

    HTTP side (event loop)              this thread
    submit(Request, sink) ---+
    abort(request_id) -------+--> lock --> engine.add_request() / engine.abort()
                                           while engine.has_work():
                                               events = engine.step()
    request's queue <---------- sink(ev) -- for ev in events: sinks[ev.request_id](ev)

A stage-2 reader can read this as the outer loop of its own LLMEngine: the scheduler
runs inside step(); this loop only feeds it and delivers what it made.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from common.engine import Request, TokenEvent

log = logging.getLogger("qwen3-stages.server")
Sink = Callable[[TokenEvent | Exception], None]


class EngineLoop:
    """Owns the engine. submit() and abort() only append to a list under a lock and wake
    the thread; the thread adds and aborts requests between steps, runs step() while the
    engine has work, and sleeps on the condition when it has none."""

    def __init__(self, engine):
        self.engine = engine
        self.cond = threading.Condition()
        self._adds: list[tuple[Request, Sink]] = []
        self._aborts: list[str] = []
        self._stop = False
        self.sinks: dict[str, Sink] = {}   # requests in the engine (engine thread only)
        self.busy = False                   # the engine had work after the last step
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    # ---- called from the HTTP side (any thread) ----
    def submit(self, req: Request, sink: Sink) -> None:
        with self.cond:
            self._adds.append((req, sink))
            self.cond.notify()

    def abort(self, request_id: str) -> None:
        with self.cond:
            self._aborts.append(request_id)
            self.cond.notify()

    def idle(self) -> bool:
        """No request queued here or in the engine (for tests)."""
        with self.cond:
            return not (self._adds or self._aborts or self.sinks or self.busy)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        self.thread.join(timeout=10)
        getattr(self.engine, "close", lambda: None)()     # an engine in a child process ends it

    # ---- the engine thread ----
    def _run(self) -> None:
        while True:
            # 1. wait for work, then take what the HTTP side handed in
            with self.cond:
                while not (self._adds or self._aborts or self._stop or self.busy):
                    self.cond.wait()
                if self._stop:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            # 2. new requests join the engine's queue; a prompt it cannot take fails alone
            for req, sink in adds:
                try:
                    self.engine.add_request(req)
                    self.sinks[req.id] = sink
                except Exception as e:       # ValueError: a prompt the engine cannot take
                    sink(e)
            # 3. clients that left: free their sequences (only those still in the engine)
            for rid in aborts:
                if self.sinks.pop(rid, None) is not None:
                    self.engine.abort(rid)
            # 4. one step of the engine: every running sequence advances by a token
            try:
                events = self.engine.step() if self.engine.has_work() else []
            except Exception as e:
                self._fail(e)
                events = []
            # 5. each token goes to the request that asked for it (none listens to one aborted here)
            #    An "error" event is no token: the engine could not make one for that request
            #    (stage 3's sampler on a row of non-finite logits); the client gets a server error.
            for ev in events:
                sink = self.sinks.pop(ev.request_id, None) if ev.finish_reason else self.sinks.get(ev.request_id)
                if sink is not None:
                    sink(RuntimeError("the engine could not produce a token for this request (its logits "
                                      "were not finite)") if ev.finish_reason == "error" else ev)
            with self.cond:
                self.busy = self.engine.has_work()

    def _fail(self, e: Exception) -> None:
        """A bug, an out-of-memory or a dead engine process: the requests in flight (or those
        the error names, e.request_ids) get a server error and leave the engine; the loop goes on."""
        log.error("engine step failed: %s: %s", type(e).__name__, e, exc_info=e)
        touched = getattr(e, "request_ids", None)
        for rid in [r for r in self.sinks if touched is None or r in touched]:
            self.sinks.pop(rid)(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
            try:
                self.engine.abort(rid)
            except Exception:
                pass
