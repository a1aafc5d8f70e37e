"""The model's routes: /v1/models, and /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

from fastapi import APIRouter

from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.server.serving import (
    State,
    encode_chat,
)
from kvserve.models.paths import DEFAULT_MODEL

router = APIRouter()


@router.get("/v1/models", response_model=None,
            responses=schemas.responses(schemas.ModelList))
async def models(state: State) -> dict:
    state.ready()
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "kvserve",
        "root": str(state.engine_args.model or DEFAULT_MODEL),
        "max_model_len": state.max_model_len}]}

@router.post("/tokenize", response_model=None,
             responses=schemas.responses(schemas.Tokenized))
async def tokenize(state: State, body: TokenizeRequest) -> dict:
    state.check_model(body.model)
    tok = state.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'")
    if body.messages is not None:
        ids = encode_chat(state.processor, body.messages, body.add_generation_prompt)
    else:
        ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

@router.post("/detokenize", response_model=None,
             responses=schemas.responses(schemas.Detokenized))
async def detokenize(state: State, body: DetokenizeRequest) -> dict:
    state.check_model(body.model)
    vocab = state.llm_engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}
