"""An OpenAI-compatible HTTP server over any engine: this file builds the app and runs it.

HTTP and JSON in, token ids to the engine, token ids back, text and JSON out:

    event loop: read the body (413, 429)      api_state.py
    prepare thread: parse and check it,       api_json.py, api_protocol.py (pydantic models),
        render the template, tokenize         api_chat.py, api_completions.py (one router each)
    engine thread: add_request, step, abort   engine_loop.py (engine_process.py: in a child)
    event loop: detokenize, stop strings,     api_generation.py
        <think>/<tool_call> parsing, SSE

Input a client controls never gets a 5xx: every limit (docs/server.md lists them)
answers with a 4xx that names the field. /docs and /openapi.json stay open with
--api-key (a browser cannot send a bearer token, and the schema holds no data); only
/v1 is behind the key. Each stage's serve.py only builds its engine and calls main().
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import api_chat, api_completions, api_models
from common.api_protocol import APIError, ChatCompletionRequest, CompletionRequest, invalid_field
from common.api_state import Limits, ServerState, require_api_key

log = logging.getLogger("qwen3-stages.server")
__all__ = ["Limits", "ServerState", "build_app", "create_app", "main"]


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="qwen3-stages", version="0.1.0", summary="OpenAI-compatible API over a qwen3-stages engine")
    app.state.server = state
    if not state.pools:
        state.pools = {"small": ThreadPoolExecutor(2, thread_name_prefix="prepare-small"),
                       "large": ThreadPoolExecutor(state.limits.prepare_threads, thread_name_prefix="prepare-large")}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    for module in (api_chat, api_completions, api_models):
        v1.include_router(module.router)
    app.include_router(v1)

    @app.get("/healthz", summary="200 when the model is loaded (503 while it loads or its engine restarts)")
    async def healthz():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        body = {"status": "ok", "model": state.model_name}
        engine = state.loop.engine
        if hasattr(engine, "restarts"):          # an engine in a child process (--engine-process)
            body["engine_restarts"] = engine.restarts
            if not engine.ready.is_set():
                return JSONResponse({**body, "status": "restarting"}, status_code=503)
        return body

    # ---- errors, all in OpenAI's shape ----
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        err = exc.errors()[0]
        exc = invalid_field({**err, "loc": err["loc"][1:]})     # FastAPI's loc starts with "query", "header"...
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     type="server_error").body(), status_code=500)

    def openapi() -> dict:
        """FastAPI's schema, plus the request models the endpoints read themselves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in (ChatCompletionRequest, CompletionRequest)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def create_app(engine, tokenizer, template, model_name: str, folder=None, max_ctx: int | None = None,
               api_key: str | None = None, limits: Limits | None = None) -> FastAPI:
    """An app serving `engine` at once (tests run it in-process with any engine).
    app.state.server.loop is the EngineLoop (its .idle() tells when all is settled)."""
    state = ServerState(model_name=model_name, api_key=api_key, limits=limits or Limits())
    state.set_ready(engine, tokenizer, template, folder, max_ctx)
    return build_app(state)


# ============================================================================
# Command line
# ============================================================================
def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model folder, or a known name (default: smollm2-135m)")
    parser.add_argument("--addr", default="127.0.0.1:8000",
                        help="HOST:PORT to listen on (default 127.0.0.1:8000; 0.0.0.0:PORT to accept other machines)")
    parser.add_argument("--max-ctx", type=int, default=4096, help="longest prompt + output per sequence")
    parser.add_argument("--slots", type=int, default=None, help="sequences run together (batching stages)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (batching stages)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the --model value)")
    parser.add_argument("--max-body-mb", type=float, default=Limits.max_body_bytes / 2**20, metavar="MB",
                        help="largest request body in MiB; a larger one gets 413 before it is parsed "
                        "(default %(default)g)")
    parser.add_argument("--max-concurrent", type=int, default=Limits.max_concurrent, metavar="N",
                        help="generation requests served at once; one more gets 429 (default %(default)d)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine in a child process that is restarted if it dies (a crash in "
                        "compiled code then fails only the requests in flight; docs/server.md measures its "
                        "cost; default: on for stage 1, off for stages 2 and 3)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"--addr {addr!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def main(build_engine: Callable[[Path, argparse.Namespace], Any], argv: list[str] | None = None,
         prog: str | None = None, add_args: Callable[[argparse.ArgumentParser], None] | None = None,
         engine_process: bool = False) -> None:
    """Parse the command line, bind the socket, load the engine in the background
    (/healthz answers 503 meanwhile), then serve until Ctrl-C.

    build_engine(folder, args) -> Engine is the only stage-specific part (a module-level
    function, so that --engine-process can import it in the child); add_args(parser)
    adds the stage's own options; engine_process is the stage's default for --engine-process."""
    import uvicorn

    from common.chat_template import ChatTemplate
    from common.models import resolve_model
    from common.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server (chat, completions, models)")
    add_server_args(parser)
    if add_args:
        add_args(parser)
    parser.set_defaults(engine_process=engine_process)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.max_ctx < 2:
        raise SystemExit("--max-ctx must be at least 2")
    if not args.max_body_mb > 0 or args.max_concurrent < 1:
        raise SystemExit("--max-body-mb must be positive and --max-concurrent at least 1")
    limits = Limits(max_body_bytes=max(1, int(args.max_body_mb * 2**20)), max_concurrent=args.max_concurrent)
    host, port = parse_addr(args.addr)

    try:
        folder = Path(resolve_model(args.model))
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot use --model {args.model!r}: {e}") from None
    name = args.served_model_name or args.model or folder.name
    state = ServerState(model_name=name, api_key=args.api_key, aliases={folder.name, str(folder)}, limits=limits)

    # bind first, so clients can poll /healthz while the weights load
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; pick another --addr") from None
    sock.listen(128)
    bound = sock.getsockname()
    print(f"listening on http://{host}:{bound[1]} (model {name!r} loading from {folder})", flush=True)

    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=args.log_level, timeout_keep_alive=30))

    def load():
        try:
            # tokenizer and template first: they are quick and fail with the clearest message
            tokenizer, template = Tokenizer(folder), ChatTemplate.from_folder(folder)
            if args.engine_process:
                from common.engine_process import EngineProcess
                engine = EngineProcess(build_engine, folder, args)
            else:
                engine = build_engine(folder, args)
            state.set_ready(engine, tokenizer, template, folder, args.max_ctx)
            print(f"ready: http://{host}:{bound[1]}/v1 serves {name!r} (max ctx {state.max_ctx})", flush=True)
        except Exception as e:
            if not isinstance(e, (ValueError, OSError)):   # a bug, not a bad folder: keep the traceback
                log.exception("loading the model failed")
            state.load_error = f"loading the model failed: {type(e).__name__}: {e}"
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
        sys.exit(state.load_error)
