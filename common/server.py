"""An OpenAI-compatible HTTP server over any engine: this file builds the app.

HTTP and JSON in, token ids to the engine, token ids back, text and JSON out:

    event loop: read the body (413, 429)      api_state.py
    prepare thread: parse and check it,       api_json.py, api_protocol.py (pydantic models),
        render the template, tokenize         api_chat.py, api_completions.py (one router each)
    engine thread: add_request, step, abort   engine_loop.py (engine_process.py: in a child)
    event loop: detokenize, stop strings,     api_generation.py
        <think>/<tool_call> parsing, SSE

Input a client controls never gets a 5xx: every limit (docs/server.md) answers with a
4xx that names the field. Only /v1 is behind --api-key: /docs and /openapi.json stay
open (a browser cannot send a bearer token, and the schema holds no data). The command
line is common/serve_cli.py; each stage's serve.py only builds its engine.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from common import api_chat, api_completions, api_models
from common.api_protocol import APIError, ChatCompletionRequest, CompletionRequest, invalid_field
from common.api_state import Limits, ServerState, require_api_key

log = logging.getLogger("qwen3-stages.server")
__all__ = ["Limits", "ServerState", "build_app", "create_app"]


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="qwen3-stages", version="0.1.0", summary="OpenAI-compatible API over a qwen3-stages engine")
    app.state.server = state
    state.pools = state.pools or {"small": ThreadPoolExecutor(2, thread_name_prefix="prepare-small"), "large":
                                  ThreadPoolExecutor(state.limits.prepare_threads, thread_name_prefix="prepare-large")}
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    for module in (api_chat, api_completions, api_models):
        v1.include_router(module.router)
    app.include_router(v1)

    @app.get("/healthz", summary="200 when the model is loaded (503 while it loads or its engine restarts)")
    async def healthz():
        if state.loop is None:
            body = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(body, status_code=503)
        body, engine = {"status": "ok", "model": state.model_name}, state.loop.engine
        if hasattr(engine, "restarts"):          # an engine in a child process (--engine-process)
            body["engine_restarts"] = engine.restarts
            if not engine.up:
                return JSONResponse({**body, "status": "restarting"}, status_code=503)
        return body

    # errors, all in OpenAI's shape
    def handler(to_error):
        async def handle(request, e):
            error = to_error(e)
            return JSONResponse(error.body(), status_code=error.status)
        return handle

    app.add_exception_handler(APIError, handler(lambda e: e))
    app.add_exception_handler(RequestValidationError, handler(lambda e: invalid_field(
        {**e.errors()[0], "loc": e.errors()[0]["loc"][1:]})))     # FastAPI's loc starts with "query", "header"...
    app.add_exception_handler(HTTPException, handler(lambda e: APIError(
        e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404 else "invalid_request_error")))

    def crash(e: Exception) -> APIError:
        log.exception("request failed")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")

    app.add_exception_handler(Exception, handler(crash))

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
    """An app serving `engine` at once (tests run it in-process with any engine);
    app.state.server.loop is its EngineLoop."""
    state = ServerState(model_name=model_name, api_key=api_key, limits=limits or Limits())
    state.set_ready(engine, tokenizer, template, folder, max_ctx)
    return build_app(state)
