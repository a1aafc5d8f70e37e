"""/v1/embeddings: the model's pooled final hidden states, one per input."""

from __future__ import annotations

import base64
import struct
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import EmbeddingRequest
from kvserve.entrypoints.server.serving import (
    ClientGone,
    State,
    add_requests,
    check_prompt_tokens,
    collect,
    prompt_lists,
    raise_failed,
)
from kvserve.sample.sampling_params import SamplingParams

router = APIRouter()


@router.post("/v1/embeddings", responses=schemas.responses(schemas.EmbeddingList))
async def embeddings(state: State, body: EmbeddingRequest, raw: Request) -> Response:
    state.check_model(body.model)
    engine = state.ready()
    hidden = state.llm_engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"dimensions {body.dimensions} is not supported: this model's "
                       f"embeddings have {hidden}", "dimensions")
    inputs = prompt_lists(body.input, "input")
    state.args.limits.check_prompts(len(inputs), "input")
    check_prompt_tokens(state, inputs, "input")
    try:
        params = SamplingParams(max_tokens=1, pooling=state.args.pooling,
                                truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    rid = f"embd-{uuid.uuid4().hex}"
    streams = await add_requests(engine, rid, inputs, params, None, False)
    try:
        outs = await collect(streams, raw)
    except ClientGone:
        return Response(status_code=499)
    raise_failed(outs)
    data = []
    for i, out in enumerate(outs):
        vec = out.embedding or []
        emb: list[float] | str = vec
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(o.prompt_token_ids) for o in outs)
    return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
