"""GET /v1/models: the one model this server serves."""
from __future__ import annotations

from fastapi import APIRouter, Request

from common.api_protocol import ModelCard, ModelList
from common.api_state import server_state

router = APIRouter()


@router.get("/models", response_model=ModelList, summary="The model this server serves")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_ctx or None)])
