"""`python -m stageN.serve`: the server's command line; each stage's serve.py calls main() with its
engine builder. The socket is bound first, so /healthz answers 503 while the weights load."""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import uvicorn

from common.api_state import Limits, ServerState
from common.chat_template import ChatTemplate
from common.engine_process import EngineProcess
from common.models import resolve_model
from common.server import build_app
from common.tokenizer import Tokenizer

log = logging.getLogger("qwen3-stages.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add, limits = parser.add_argument, Limits()
    add("--model", default=None,
        help="a Hugging Face model folder, or a known name (default: smollm2-135m)")
    add("--addr", default="127.0.0.1:8000",
        help="HOST:PORT to listen on (default 127.0.0.1:8000; 0.0.0.0:PORT to accept other "
        "machines)")
    add("--max-ctx", type=int, default=4096,
        help="prompt + output tokens per sequence (default 4096)")
    add("--slots", type=int, default=None, help="sequences run together (batching stages)")
    add("--token-budget", type=int, default=None, help="tokens per step (batching stages)")
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    add("--served-model-name", default=None,
        help="the model name clients send (default: the --model value)")
    add("--max-body-mb", type=float, default=limits.max_body_bytes / 2**20, metavar="MB",
        help="largest request body in MiB; a larger one gets 413 before it is parsed "
        "(default %(default)g)")
    add("--max-concurrent", type=int, default=limits.max_concurrent, metavar="N",
        help="generation requests served at once; one more gets 429 (default %(default)d)")
    add("--engine-process", action=argparse.BooleanOptionalAction, default=False,
        help="run the engine in a child process, restarted if it dies: a crash in compiled code "
        "then fails only the requests in flight (docs/server.md measures its cost; default off)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="what the server logs (default info)")


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"--addr {addr!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def main(build_engine: Callable[[Path, argparse.Namespace], Any], argv: list[str] | None = None,
         prog: str | None = None,
         add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the command line, bind the socket, load the engine in the background, serve until
    Ctrl-C. build_engine(folder, args) -> Engine is a module-level function (--engine-process
    imports it in the child); add_args(parser) adds the stage's own options."""
    parser = argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible server (chat, completions, models)")
    add_server_args(parser)
    if add_args:
        add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(message)s")
    if args.max_ctx < 2:
        raise SystemExit("--max-ctx must be at least 2")
    if not args.max_body_mb > 0 or args.max_concurrent < 1:
        raise SystemExit("--max-body-mb must be positive and --max-concurrent at least 1")
    limits = Limits(max_body_bytes=max(1, int(args.max_body_mb * 2**20)),
                    max_concurrent=args.max_concurrent)
    host, port = parse_addr(args.addr)
    try:
        folder = Path(resolve_model(args.model))
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot use --model {args.model!r}: {e}") from None
    name = args.served_model_name or args.model or folder.name
    state = ServerState(model_name=name, api_key=args.api_key, aliases={folder.name, str(folder)},
                        limits=limits)

    # bind first, so clients can poll /healthz while the weights load
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; "
                         "pick another --addr") from None
    sock.listen(128)
    bound = sock.getsockname()
    print(f"listening on http://{host}:{bound[1]} (model {name!r} loading from {folder})",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=args.log_level,
                                           timeout_keep_alive=30))

    failed = []                      # a failed load's exit code: 2 for a bad model, 1 for a bug

    def load():
        try:
            # tokenizer and template first: they are quick and fail with the clearest message
            tokenizer, template = Tokenizer(folder), ChatTemplate.from_folder(folder)
            if args.engine_process:
                engine = EngineProcess(build_engine, folder, args)
            else:
                engine = build_engine(folder, args)
            state.set_ready(engine, tokenizer, template, folder, args.max_ctx)
            # stage 1's kernels and how idle threads wait (--engine-process: the child has them)
            kernels = engine.describe_kernels() if hasattr(engine, "describe_kernels") else ""
            print(f"ready: http://{host}:{bound[1]}/v1 serves {name!r} (max ctx {state.max_ctx})"
                  + f" · {kernels}" * bool(kernels), flush=True)
        except Exception as e:
            bad_model = isinstance(e, (ValueError, OSError))
            if not bad_model:                       # a bug, not a bad folder: keep the traceback
                log.exception("loading the model failed")
            state.load_error = f"loading the model failed: {type(e).__name__}: {e}"
            failed.append(2 if bad_model else 1)
            server.should_exit = True

    threading.Thread(target=load, name="model-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if state.loop is not None:
            state.loop.stop()
        for pool in state.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
    if state.load_error:
        print(f"error: {state.load_error}", file=sys.stderr)
        sys.exit(failed[0] if failed else 1)
