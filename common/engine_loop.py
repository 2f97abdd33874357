"""The engine-facing half of the server: one thread that drives engine.step().

Only this thread calls the engine, through the four calls of common/engine.py, token ids
only. The HTTP side hands requests in (submit, abort); each request's TokenEvents go back
through the sink it gave, a function that puts them on its asyncio queue:

    submit(Request, sink), abort(id) --> lock --> engine.add_request() / engine.abort()
                                                  while engine.has_work(): events = engine.step()
    the request's queue <------------------ sink(ev) for each event, by ev.request_id

For a stage-2 reader it is the outer loop of LLMEngine: the scheduler runs inside step().
With --engine-process this loop runs in the child (common/engine_process.py).
"""
import contextlib
import logging
import threading
from typing import Callable

from common.engine import Request, TokenEvent

log = logging.getLogger("qwen3-stages.server")   # the server's logger (all its files)
Sink = Callable[[TokenEvent | Exception], None]

class EngineLoop:
    """Owns the engine; submit() and abort() append under a lock, the thread applies them between
    steps."""
    def __init__(self, engine, on_step: Callable[[], None] = lambda: None):
        # on_step(): after a step
        self.engine, self.cond, self.on_step = engine, threading.Condition(), on_step
        self._adds: list[tuple[Request, Sink]] = []
        self._aborts: list[str] = []
        self._stop = self.busy = False       # busy: the engine had work after the last step
        self.sinks: dict[str, Sink] = {}     # requests in the engine (engine thread only)
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

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

    def _run(self) -> None:
        while True:
            with self.cond:       # 1. wait for work, then take what the HTTP side handed in
                self.cond.wait_for(lambda: self._adds or self._aborts or self._stop or self.busy)
                if self._stop:
                    return
                (adds, self._adds), (aborts, self._aborts) = (self._adds, []), (self._aborts, [])
            # 2. new requests join the engine; a prompt it cannot take fails alone
            for req, sink in adds:
                try:
                    self.engine.add_request(req)
                    self.sinks[req.id] = sink
                except Exception as e:
                    sink(e)
            for rid in aborts:          # 3. clients that left: free their sequences
                if self.sinks.pop(rid, None) is not None:
                    self.engine.abort(rid)
            try:                        # 4. one step: every running sequence advances by a token
                events = self.engine.step() if self.engine.has_work() else []
            except Exception as e:
                self._fail(e)
                events = []
            # 5. each token to its request; "error": the engine made none for it
            for ev in events:
                sink = (self.sinks.pop(ev.request_id, None) if ev.finish_reason
                        else self.sinks.get(ev.request_id))
                if sink is not None:    # (stage 3's sampler on a row of non-finite logits)
                    sink(RuntimeError("the engine could not produce a token for this request "
                                      "(its logits were not finite)")
                         if ev.finish_reason == "error" else ev)
            with self.cond:
                self.busy = self.engine.has_work()
            self.on_step()

    def _fail(self, e: Exception) -> None:
        """A bug or an out-of-memory fails the requests in flight (a server error) and drops them;
        the loop goes on."""
        log.error("engine step failed: %s: %s", type(e).__name__, e, exc_info=e)
        for rid in list(self.sinks):
            self.sinks.pop(rid)(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
            # a broken engine may fail to abort: the loss is reported
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
