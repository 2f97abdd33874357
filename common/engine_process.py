"""An engine in a child process behind the same Engine protocol (--engine-process): a Request
crosses the pipe one way, TokenEvent fields (ids) the other. While it has work the child steps
and sends each step's events in one message, so the pipe is off the critical path. If it dies,
the pipe closes: what it held fails at the next step(), and the step after starts a new child
("spawn": a fork of a threaded server is not safe, so the builder must be importable)."""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import signal
import sys
from contextlib import suppress
from types import SimpleNamespace

from common.engine import Request, TokenEvent

log = logging.getLogger("qwen3-stages.server")

def _child(conn, builder: str, folder, args) -> None:
    """Build the engine, then step it while it has work and answer calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C stops the server, which closes the pipe
    module, name = builder.split(":")
    engine = getattr(importlib.import_module(module), name)(folder, args)
    config = getattr(engine, "config", None)
    conn.send((engine.max_ctx, getattr(config, "vocab_size", 0), list(getattr(config, "eos_token_ids", []) or [])))
    told = False          # the server was told this child has work: it waits for one more step message
    with suppress(EOFError, OSError):
        while True:
            busy = engine.has_work()
            if not (busy or told) or conn.poll():     # idle: block for a call; busy: take what came
                call, arg = conn.recv()
                if call == "add":
                    try:
                        engine.add_request(arg)
                        told = True
                        conn.send(("added", None))
                    except ValueError as e:           # a prompt this engine cannot take
                        conn.send(("added", str(e)))
                else:
                    engine.abort(arg)
                continue
            events = engine.step() if busy else []
            told = engine.has_work()
            conn.send(("step", [(e.request_id, e.token_id, e.finish_reason) for e in events], told))

class EngineDied(RuntimeError):
    """The child died; request_ids (set by _io) are the requests it held, which are lost."""
    request_ids: set[str]

class EngineProcess:
    """The Engine protocol, run by a child process; a new child replaces one that died."""

    def __init__(self, build_engine, folder, args):
        if not isinstance(build_engine, str):     # 'package.module:function', also when run as __main__
            module = build_engine.__module__
            if module == "__main__":
                module = getattr(sys.modules["__main__"].__spec__, "name", None) or module
            build_engine = f"{module}:{build_engine.__qualname__}"
        self.builder, self.folder, self.args = build_engine, folder, args
        self.restarts = 0
        self.lost: EngineDied | None = None   # the child died: the next step() raises this
        self.running: set[str] = set()        # request ids the child holds
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_end, self.builder, self.folder, self.args),
                                name="engine", daemon=True)
        self.proc.start()
        child_end.close()          # so that the child's death closes the pipe for us
        try:
            self.max_ctx, vocab, eos = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self.proc.exitcode})") from None
        self.config = SimpleNamespace(vocab_size=vocab, eos_token_ids=eos)
        self.work, self.events = False, []    # the child has work; events read but not yet returned
        self.up = True                        # False from a death until the new child answers (/healthz)

    def _alive(self) -> None:
        if not self.up:                       # the child died: start a new one (a failure: the next call retries)
            self.work = False
            self._start()
            self.restarts += 1
            log.warning("the engine process was restarted (%d restarts)", self.restarts)

    def _io(self, fn, *args):     # a pipe call; a closed pipe means the child is dead: what it held is lost
        try:
            return fn(*args)
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self.up, self.work, self.events = False, True, []   # the loop steps again: raise, then restart
            self.lost = EngineDied(f"the engine process died ({how}); it is being restarted")
            self.lost.request_ids, self.running = self.running, set()
            raise self.lost from None

    def _read(self):     # one message: a step's events are kept for step(); an add's answer is returned
        kind, *body = self._io(self.conn.recv)
        if kind == "added":
            return body
        self.events += [TokenEvent(*e) for e in body[0]]
        self.work = body[1]

    def _add(self, req: Request) -> str | None:
        self._alive()
        self._io(self.conn.send, ("add", req))
        while (answer := self._read()) is None:
            pass
        return answer[0]

    # ---- the Engine protocol ----
    def add_request(self, req: Request) -> None:
        try:                                 # the child's engine checks the prompt; found dead, the new child
            error = self._add(req)           # takes it (what the old one held fails at the next step, alone)
        except EngineDied:
            error = self._add(req)
        if error is not None:
            raise ValueError(error)
        self.running.add(req.id)
        self.work = True

    def abort(self, request_id: str) -> None:
        if request_id in self.running and self.up:
            self.running.discard(request_id)
            with suppress(EngineDied):        # the next step() reports the loss
                self._io(self.conn.send, ("abort", request_id))

    def step(self) -> list[TokenEvent]:
        if self.lost is not None:
            lost, self.lost = self.lost, None
            raise lost
        self._alive()
        with suppress(EngineDied):            # blocks (no polling) until the child's next step
            if self.work and not self.events:
                self._read()
        out, self.events = self.events, []
        self.running -= {e.request_id for e in out if e.finish_reason is not None}
        return out

    def has_work(self) -> bool:
        return self.work or bool(self.events)

    def close(self) -> None:
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
