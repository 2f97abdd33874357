"""An engine in a child process, behind the same Engine protocol (--engine-process).

The engine thread (common/engine_loop.py) calls this proxy as it would call the engine;
the proxy forwards each call over a pipe to a child process that owns the real engine.
What crosses is the contract of common/engine.py and nothing more: Request (ids +
SamplingParams) one way, TokenEvent fields (ids) the other.

    server process                            child process
    engine thread: proxy.step() --- pipe ---> engine.step() -> [(request_id, token_id, finish_reason)]

If the child dies (a segfault or an LLVM abort in compiled code, an out-of-memory kill,
SIGKILL), the pipe closes: the next step() raises EngineDied, the engine loop fails the
requests the child held, and the step after it starts a new child (/healthz says
"restarting" until it is up, and counts the restarts). The child is started with "spawn"
(a fork of a threaded server is not safe), so the engine builder must be importable:
the stage's serve.py build_engine.
"""
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
    """The child's whole life: build the engine, then answer calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C stops the server, which closes the pipe
    module, name = builder.split(":")
    engine = getattr(importlib.import_module(module), name)(folder, args)
    config = getattr(engine, "config", None)
    conn.send((engine.max_ctx, getattr(config, "vocab_size", 0), list(getattr(config, "eos_token_ids", []) or [])))
    while True:
        try:
            call, arg = conn.recv()
        except EOFError:
            return
        if call == "step":
            events = engine.step() if engine.has_work() else []
            conn.send(([(e.request_id, e.token_id, e.finish_reason) for e in events], engine.has_work()))
        elif call == "add":
            try:
                engine.add_request(arg)
                conn.send(None)
            except ValueError as e:
                conn.send(str(e))
        else:
            engine.abort(arg)


class EngineDied(RuntimeError):
    """The child died; request_ids are the requests it held (they are lost)."""

    def __init__(self, message: str, request_ids: set[str]):
        super().__init__(message)
        self.request_ids = request_ids


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
        self.work = False                     # the child had work after the last call
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
        self.up = True                        # False from a death until the new child answers (/healthz)

    def _call(self, call: str, arg=None):
        if not self.up:                       # the child died: start a new one (a failure: the next call retries)
            self.work = False
            self._start()
            self.restarts += 1
            log.warning("the engine process was restarted (%d restarts)", self.restarts)
        try:
            self.conn.send((call, arg))
            return self.conn.recv() if call != "abort" else None
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self.up, self.work = False, True  # the engine loop steps again, which starts the new child
            self.lost = EngineDied(f"the engine process died ({how}); it is being restarted", self.running)
            self.running = set()
            raise self.lost from None

    # ---- the Engine protocol ----
    def add_request(self, req: Request) -> None:
        try:
            error = self._call("add", req)   # the child's engine checks the prompt
        except EngineDied:                   # found dead: the new child takes it (what the old one
            error = self._call("add", req)   # held fails at the next step, alone)
        if error is not None:
            raise ValueError(error)
        self.running.add(req.id)
        self.work = True

    def abort(self, request_id: str) -> None:
        if request_id in self.running and self.up:
            with suppress(EngineDied):        # the next step() reports the loss
                self._call("abort", request_id)
                self.work = True              # the child reports the abort at its next step

    def step(self) -> list[TokenEvent]:
        if self.lost is None:
            with suppress(EngineDied):
                events, self.work = self._call("step")
                out = [TokenEvent(*e) for e in events]
                self.running -= {e.request_id for e in out if e.finish_reason is not None}
                return out
        lost, self.lost = self.lost, None
        raise lost

    def has_work(self) -> bool:
        return self.work

    def close(self) -> None:
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
