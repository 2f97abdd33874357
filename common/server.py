"""An OpenAI-compatible HTTP server over any engine: this file builds the app from the modules
beside it (docs/server.md, "Where the work happens", says which thread runs what, in which file).
Only /v1 is behind --api-key: /docs and /openapi.json stay open (docs/server.md says why)."""
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from common import api_chat, api_completions
from common.api_protocol import (APIError, ChatCompletionRequest, CompletionRequest, ModelCard,
                                 ModelList, invalid_field)
from common.api_state import Limits, ServerState, require_api_key
from common.engine_loop import log

def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="qwen3-stages", version="0.1.0",
                  summary="OpenAI-compatible API over a qwen3-stages engine")
    app.state.server = state
    state.pools = state.pools or {
        "small": ThreadPoolExecutor(2, thread_name_prefix="prepare-small"),
        "large": ThreadPoolExecutor(state.limits.prepare_threads,
                                    thread_name_prefix="prepare-large")}
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    v1.include_router(api_chat.router)
    v1.include_router(api_completions.router)

    @v1.get("/models", response_model=ModelList, summary="The model this server serves")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         max_model_len=state.max_ctx or None)])

    app.include_router(v1)

    @app.get("/healthz",
             summary="200 when the model is loaded (503 while it loads or its engine restarts)")
    async def healthz():
        if state.loop is None:
            body = ({"status": "error", "error": state.load_error} if state.load_error
                    else {"status": "loading"})
            return JSONResponse(body, status_code=503)
        body, loop = ({"status": "ok", "model": state.model_name, "idle": state.loop.idle()},
                      state.loop)
        # a paged KV cache in this process: a soak checks its pages
        if hasattr(e := loop.engine, "num_free_pages"):
            body.update(kv_pages=e.num_total_pages(), kv_pages_free=e.num_free_pages(),
                        preemptions=e.num_preemptions)
        if hasattr(loop, "restarts"):            # an engine in a child process (--engine-process)
            body["engine_restarts"] = loop.restarts
            if not loop.up:
                return JSONResponse({**body, "status": "restarting"}, status_code=503)
        return body

    def crash(e: Exception) -> APIError:
        log.exception("request failed")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")

    # every error in OpenAI's shape; FastAPI's loc starts with "query", "header"...
    for kind, to_error in [
            (APIError, lambda e: e), (Exception, crash),
            (RequestValidationError,
             lambda e: invalid_field({**e.errors()[0], "loc": e.errors()[0]["loc"][1:]})),
            (HTTPException, lambda e: APIError(e.status_code, str(e.detail),
                                               type="not_found_error" if e.status_code == 404
                                               else "invalid_request_error"))]:
        async def handle(request: Request, e, to_error=to_error):
            error = to_error(e)
            return JSONResponse(error.body, status_code=error.status)
        app.add_exception_handler(kind, handle)

    # FastAPI's schema (made once, then served as it is), plus the request models the endpoints read
    # themselves
    _, defs = models_json_schema([(m, "validation")
                                  for m in (ChatCompletionRequest, CompletionRequest)],
                                 ref_template="#/components/schemas/{model}")
    app.openapi().setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return app

def create_app(engine, tokenizer, template, model_name: str, folder=None,
               max_ctx: int | None = None, api_key: str | None = None,
               limits: Limits | None = None) -> FastAPI:
    """An app serving `engine` at once (tests run it in-process); app.state.server.loop is its
    EngineLoop."""
    state = ServerState(model_name=model_name, api_key=api_key, limits=limits or Limits())
    state.set_ready(engine, tokenizer, template, folder, max_ctx)
    return build_app(state)
