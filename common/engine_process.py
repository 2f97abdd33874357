"""An engine in a child process (--engine-process), in the server as its EngineLoop would be
(submit, abort, idle, stop). The child runs an EngineLoop of its own: it steps while it has work and
sends each step's events in one message. A Request crosses the pipe one way, TokenEvents (ids) the
other. If the child dies, the pipe closes: what it held fails, and a new child starts ("spawn": a
fork of a threaded server is not safe, so the builder is pickled by name and must be a module-level
function)."""
import functools
import multiprocessing
import signal
import threading
import time
from contextlib import suppress

from common.engine import Request, TokenEvent
from common.engine_loop import EngineLoop, Sink, log

def _child(conn, build_engine, folder, args) -> None:
    """Build the engine and run an EngineLoop on it, with the calls that come down the pipe."""
    # Ctrl-C stops the server, which stops the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = build_engine(folder, args)
    # what the server reads of the engine
    conn.send((engine.max_ctx, getattr(engine, "config", None)))
    # this step's (request id, event), on the engine thread
    out: list[tuple[str, TokenEvent | Exception]] = []

    # an error crosses as what it is to the server: a ValueError (400) or not
    def sink(rid: str, item) -> None:
        out.append((rid, item if isinstance(item, TokenEvent) else
                    (ValueError if isinstance(item, ValueError) else RuntimeError)(str(item))))

    def send() -> None:
        if out:
            conn.send(out[:])
            out.clear()

    loop = EngineLoop(engine, on_step=send)
    with suppress(EOFError, OSError):
        while (call := conn.recv())[0] != "stop":
            if call[0] == "add":
                loop.submit(call[1], functools.partial(sink, call[1].id))
            else:
                loop.abort(call[1])
    loop.stop()

class EngineProcess:
    """The server's side: submit() and abort() go down the pipe, and a reader thread (_read) hands
    events back."""
    engine = None                             # it is in the child (usage has no prefix-cache count)

    def __init__(self, build_engine, folder, args):
        # build_engine(folder, args) runs in the child
        self.child_args = (build_engine, folder, args)
        self.lock, self.restarts, self.stopping = threading.RLock(), 0, False
        # False from a death until the new child has loaded (/healthz)
        self.up = True
        self.sinks: dict[str, Sink] = {}      # the requests sent to this child
        # submitted while there was no child to take them
        self.waiting: dict[str, tuple[Request, Sink]] = {}
        self._start()
        threading.Thread(target=self._read, name="engine-process", daemon=True).start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_end, *self.child_args), name="engine",
                                daemon=True)
        self.proc.start()
        child_end.close()          # so that the child's death closes the pipe for us
        try:
            self.max_ctx, self.config = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError("the engine process exited while loading "
                               f"(exit code {self.proc.exitcode})") from None

    def submit(self, req: Request, sink: Sink) -> None:
        with self.lock:
            if self.up:
                self.sinks[req.id] = sink
                try:
                    self.conn.send(("add", req))
                    return
                # a child that has just died: the reader thread starts the next
                except OSError:
                    del self.sinks[req.id]
            self.waiting[req.id] = (req, sink)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.waiting.pop(request_id, None)
            if self.sinks.pop(request_id, None) is not None and self.up:
                with suppress(OSError):
                    self.conn.send(("abort", request_id))

    def idle(self) -> bool:
        """No request in the child or waiting for one (for tests)."""
        return not (self.sinks or self.waiting)

    def stop(self) -> None:
        self.stopping = True
        with self.lock, suppress(OSError):
            self.conn.send(("stop", None))
        self.proc.join(10)
        self.proc.kill()                      # (a child that has exited is not signalled)

    def _read(self) -> None:
        """The reader thread: each event to its request's sink, until the pipe closes (the child
        died). Then what the dead child held fails, and a new child starts (retried each second) and
        takes what waits."""
        while not self.stopping:
            with suppress(EOFError, OSError):
                while True:
                    for rid, item in self.conn.recv():
                        ended = not isinstance(item, TokenEvent) or item.finish_reason is not None
                        sink = self.sinks.pop(rid, None) if ended else self.sinks.get(rid)
                        if sink is not None:
                            sink(item)
            if self.stopping:
                return
            self._restart()

    def _restart(self) -> None:
        self.proc.join(5)
        code = self.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        with self.lock:
            self.up, lost, self.sinks = False, list(self.sinks.values()), {}
        log.warning("the engine process died (%s); starting a new one", how)
        for sink in lost:
            sink(RuntimeError(f"the engine process died ({how}); it is being restarted"))
        while not self.stopping:
            try:
                self._start()
                break
            except Exception as e:            # /healthz says "restarting" meanwhile
                log.error("starting the engine process failed: %s", e)
                time.sleep(1)
        if self.stopping:
            return
        with self.lock:                       # (an RLock: submit() takes it too)
            waiting, self.waiting, self.up, self.restarts = (self.waiting, {}, True,
                                                             self.restarts + 1)
            for req, sink in waiting.values():
                # if this child has died already, they wait for the next
                self.submit(req, sink)
