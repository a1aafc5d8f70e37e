"""/v1/chat/completions: the chat template, tools and reasoning around one engine request,
whole or streamed (tool calls and reasoning parsed as they stream)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.chat_tools import ChatPlan, ChoiceStream, finish_reason, plan_chat
from kvserve.entrypoints.server.errors import APIError, error_body
from kvserve.entrypoints.server.protocol import ChatCompletionRequest
from kvserve.entrypoints.server.responses import Formatter, sse, usage
from kvserve.entrypoints.server.serving import (
    ClientGone,
    ServerState,
    State,
    add_requests,
    check_stream_options,
    collect,
    encode_chat,
    failure,
    new_logprobs,
    raise_failed,
    sampling_params_for,
)

router = APIRouter()
log = logging.getLogger("kvserve.entrypoints.server")


@router.post("/v1/chat/completions", response_model=None,
             responses=schemas.responses(schemas.ChatCompletion))
async def chat(state: State, body: ChatCompletionRequest, raw: Request) -> Response:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
    rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    plan, stream, _ = await submit_chat(state, body, rid)
    fmt = Formatter(state.tokenizer, rid, state.model_name, body.n,
                    body.return_tokens_as_token_ids,
                    prompt_logprobs=body.prompt_logprobs is not None)
    if body.stream:
        opts = body.stream_options
        return StreamingResponse(_chat_stream(
            fmt, stream, bool(opts and opts.include_usage), plan,
            bool(opts and opts.continuous_usage_stats)), media_type="text/event-stream")
    try:
        (out,) = await collect([stream], raw)
    except ClientGone:
        return Response(status_code=499)
    raise_failed([out])
    return JSONResponse(fmt.chat(out, plan))


async def submit_chat(state: ServerState, body: ChatCompletionRequest, rid: str
                      ) -> tuple[ChatPlan, RequestStream, int]:
    """A chat request checked, rendered by the chat template and queued as engine request
    `rid`, with its prompt's length: what every chat-shaped API (chat completions,
    Anthropic's messages) shares. Bad input is an APIError naming the chat field it came
    from."""
    state.check_model(body.model)
    engine = state.ready()
    check_stream_options(body.stream, body.stream_options)
    state.args.limits.check(body)
    spec, spec_field = body.structured()
    auto = state.auto_tool_parser if body.tools and body.tool_choice in (None, "auto") \
        else None
    token_ids = state.tool_token_ids(auto) if auto is not None else None
    reasoning = state.reasoning_parser
    plan = plan_chat(body, spec, spec_field, auto, reasoning, token_ids)
    markers = list(token_ids.values()) if plan.mode == "auto" and token_ids else []
    if reasoning is not None:
        markers += state.reasoning_token_ids(reasoning).values()
    if any(state.tokenizer.is_special(i) for i in markers):
        # The form's calls (or the reasoning's channels) are written with control tokens,
        # which decoding would drop: the text must keep them for the parsers to read it.
        body = body.model_copy(update={"skip_special_tokens": False})
    ids = encode_chat(state.processor, body.messages, body.add_generation_prompt,
                       plan.tools, body.template_kwargs(), body.continue_final_message)
    state.args.limits.check_prompt_tokens(len(ids), "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params_for(body, max_tokens, top, plan.constraint, body.prompt_logprobs,
                                 plan.thinking_budget)
    log.debug("request %s user %s", rid, body.user)
    last = body.messages[-1]
    plan.echo = last.text() if body.echo and last.role == "assistant" else ""
    (stream,) = await add_requests(engine, rid, [ids], params, body.cache_salt, body.stream,
                                   plan.constraint_field)
    return plan, stream, len(ids)


def merged_delta(deltas: list[dict]) -> dict:
    """One chat delta from a parser's pieces (tool-call pieces kept in order)."""
    out: dict = {}
    for d in deltas:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out



async def _chat_stream(fmt: Formatter, stream: RequestStream, include_usage: bool,
                       plan: ChatPlan, continuous_usage: bool = False) -> AsyncIterator[str]:
    final = None
    closed: set[int] = set()
    choices = [ChoiceStream(plan) for _ in range(fmt.n)]
    try:
        for i in range(fmt.n):
            yield sse(fmt.chat_chunk(i, {"role": "assistant", "content": ""}))
        async for out in stream:
            if out.error:
                yield sse(error_body(*failure(out.error)))
                break
            for c in out.outputs:
                if c.index in closed:
                    continue
                if not c.delta_text and not c.delta_token_ids and not c.finished:
                    continue
                cs = choices[c.index]
                delta = merged_delta(cs.feed(c.delta_text, c.finished))
                logprobs = new_logprobs(c)
                if not delta and not c.finished and not logprobs:
                    continue  # held back by a parser (a tag may be starting)
                chunk = fmt.chat_chunk(c.index, delta,
                                       finish_reason(c.finish_reason, cs.has_calls),
                                       logprobs, c.stop_reason)
                if continuous_usage:
                    chunk["usage"] = usage([out])
                yield sse(chunk)
                if c.finished:
                    closed.add(c.index)
            final = out
        else:
            if include_usage and final is not None:
                yield sse(fmt.usage_chunk([final], "chat.completion.chunk"))
    except EngineDeadError as e:
        yield sse(error_body(503, str(e)))
    finally:
        stream.close()
    yield sse("[DONE]")
