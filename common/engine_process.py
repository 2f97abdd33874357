"""An engine in a child process, behind the same Engine protocol (--engine-process).

The server's engine thread (common/engine_loop.py) calls this proxy as it would call
the engine; the proxy forwards each call over a pipe to a child process that owns the
real engine. What crosses is the contract of common/engine.py and nothing more:
Request (ids + SamplingParams) one way, TokenEvent fields (ids) the other.

    server process                            child process
    engine thread: proxy.step() --- pipe ---> engine.step() -> [(request_id, token_id, finish_reason)]

If the engine dies (a segfault or an LLVM abort in compiled code, an out-of-memory
kill, SIGKILL), the pipe closes: step() raises, the engine loop fails the requests in
flight with a server error, and the proxy starts a new child at once. /healthz says
"restarting" meanwhile and counts the restarts; the next request is served by the
new child. The child is started with "spawn" (a fork of a threaded server is not
safe), so the engine builder must be importable: the stage's serve.py build_engine.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import signal
import sys
import threading
from types import SimpleNamespace

from common.engine import Request, TokenEvent

log = logging.getLogger("qwen3-stages.server")


def builder_name(fn) -> str:
    """'package.module:function' for an engine builder, also when its module runs as __main__."""
    module = fn.__module__
    if module == "__main__":
        module = getattr(sys.modules["__main__"].__spec__, "name", None) or module
    return f"{module}:{fn.__qualname__}"


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
    """The Engine protocol, run by a child process; restarts the child when it dies."""

    def __init__(self, build_engine, folder, args):
        self.builder = build_engine if isinstance(build_engine, str) else builder_name(build_engine)
        self.folder, self.args = folder, args
        self.restarts = 0
        self.lost: EngineDied | None = None   # the child died outside step(): the next step() says so
        self.running: set[str] = set()        # request ids the child holds
        self.work = False                     # the child had work after the last call
        self.ready = threading.Event()
        self._start()

    # ---- the child's life ----
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
        self.ready.set()

    def _restart(self) -> None:
        try:
            self._start()
            self.restarts += 1
            log.warning("the engine process was restarted (%d restarts)", self.restarts)
        except Exception:
            log.exception("restarting the engine process failed; the next call tries again")
            self.ready.set()                  # calls fail on the dead pipe and start another restart

    def _died(self) -> EngineDied:
        """The pipe broke: the child is gone. Start a new one; what it held is lost."""
        self.proc.join(5)
        code = self.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.ready.clear()
        died = EngineDied(f"the engine process died ({how}); it is being restarted", self.running)
        if self.running:                              # the next step() reports the loss
            self.lost, self.work = died, True
        self.running = set()
        threading.Thread(target=self._restart, name="engine-restart", daemon=True).start()
        return died

    def _call(self, call: str, arg=None):
        self.ready.wait()                     # a restart in progress: wait for the new child
        try:
            self.conn.send((call, arg))
            return self.conn.recv() if call != "abort" else None
        except (EOFError, OSError):
            raise self._died() from None

    # ---- the Engine protocol ----
    def add_request(self, req: Request) -> None:
        try:
            error = self._call("add", req)   # the child's engine checks the prompt
        except EngineDied:                   # found dead: the new child takes it (the requests
            error = self._call("add", req)   # the old one held fail at the next step, alone)
        if error is not None:
            raise ValueError(error)
        self.running.add(req.id)
        self.work = True

    def abort(self, request_id: str) -> None:
        if request_id in self.running and self.ready.is_set():
            try:
                self._call("abort", request_id)
                self.work = True              # the child reports the abort at its next step
            except EngineDied:
                pass                          # the next step() reports the loss

    def step(self) -> list[TokenEvent]:
        lost, self.lost = self.lost, None
        if lost is not None:                  # the child died outside a step: fail what it held
            self.work = bool(self.running)    # (what the new child holds goes on)
            raise lost
        try:
            events, self.work = self._call("step")
        except EngineDied:
            self.lost, self.work = None, False
            raise
        out = [TokenEvent(*e) for e in events]
        self.running -= {e.request_id for e in out if e.finish_reason is not None}
        return out

    def has_work(self) -> bool:
        return self.work

    def close(self) -> None:
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
