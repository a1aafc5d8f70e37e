"""/v1/completions: one engine request per prompt and sample group, whole or streamed."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.errors import APIError, error_body
from kvserve.entrypoints.server.protocol import CompletionRequest
from kvserve.entrypoints.server.responses import Formatter, sse, usage
from kvserve.entrypoints.server.serving import (
    ClientGone,
    State,
    add_requests,
    check_prompt_tokens,
    check_stream_options,
    close_streams,
    collect,
    failure,
    merge,
    new_logprobs,
    prompt_lists,
    raise_failed,
    sampling_params_for,
)
from kvserve.outputs import RequestOutput

router = APIRouter()
log = logging.getLogger("kvserve.entrypoints.server")


@router.post("/v1/completions", response_model=None,
             responses=schemas.responses(schemas.Completion))
async def completions(state: State, body: CompletionRequest, raw: Request) -> Response:
    state.check_model(body.model)
    engine = state.ready()
    check_stream_options(body.stream, body.stream_options)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 returns only the echoed prompt: it needs "
                       "echo: true", "max_tokens")
    echo_logprobs = body.echo and body.logprobs is not None
    prompt_lps = body.prompt_logprobs
    if echo_logprobs:  # the prompt's logprobs head the choice's logprobs
        prompt_lps = max(prompt_lps or 0, body.logprobs or 0)
    prompts = prompt_lists(body.prompt)
    state.args.limits.check(body)
    state.args.limits.check_prompts(len(prompts), "prompt")
    check_prompt_tokens(state, prompts, "prompt")
    spec, spec_field = body.structured()
    # max_tokens 0 runs the prompt with one sampled token that is never shown.
    params = sampling_params_for(body, 1 if body.max_tokens == 0 else body.max_tokens,
                                 body.logprobs, spec, prompt_lps)
    rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    log.debug("request %s user %s", rid, body.user)
    fmt = Formatter(state.tokenizer, rid, state.model_name, body.n,
                    body.return_tokens_as_token_ids, echo_logprobs, body.max_tokens == 0,
                    body.prompt_logprobs is not None)
    streams = await add_requests(engine, rid, prompts, params, body.cache_salt, body.stream,
                         spec_field)
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts]
    if body.stream:
        opts = body.stream_options
        return StreamingResponse(_completion_stream(
            fmt, streams, echo, bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats)), media_type="text/event-stream")
    try:
        outs = await collect(streams, raw)
    except ClientGone:
        return Response(status_code=499)
    raise_failed(outs)
    return JSONResponse(fmt.completion(outs, echo))


async def _completion_stream(fmt: Formatter, streams: list[RequestStream],
                             echo: list[str] | None, include_usage: bool,
                             continuous_usage: bool = False) -> AsyncIterator[str]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    offsets: dict[int, int] = {}
    closed: set[int] = set()
    try:
        async for i, out in merge(streams):
            if out.error:
                yield sse(error_body(*failure(out.error)))
                break
            for c in out.outputs:
                idx = fmt.index(i, c)
                if idx in closed:
                    continue
                text = "" if fmt.prompt_only else c.delta_text
                if idx not in offsets and echo is not None:
                    text = echo[i] + text
                if not text and not c.delta_token_ids and not c.finished:
                    continue
                offset = offsets.get(idx, 0)
                chunk = fmt.completion_chunk(i, c, text, new_logprobs(c), offset,
                                             out if idx not in offsets else None)
                if continuous_usage:
                    chunk["usage"] = usage([out], fmt.prompt_only)
                yield sse(chunk)
                offsets[idx] = offset + len(text)
                if c.finished:
                    closed.add(idx)
            if out.finished:
                finals[i] = out
        else:
            if include_usage:
                yield sse(fmt.usage_chunk(finals, "text_completion"))  # type: ignore[arg-type]
    except EngineDeadError as e:
        yield sse(error_body(503, str(e)))
    finally:
        close_streams(streams)
    yield sse("[DONE]")
