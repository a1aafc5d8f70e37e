"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed with its typed events) and
`POST /v1/messages/count_tokens`, so that clients written for it (its SDK, coding tools that
take a base URL) can use a local model.

A request becomes the chat request it is (protocol_messages) and goes through the chat path:
the same template, tools and tool parsers, structured outputs, limits, metrics and engine.
Only the shapes differ: content blocks instead of a message, Anthropic's stop reasons,
usage and errors (errors.ANTHROPIC_PATHS)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.chat_tools import (
    ChatPlan,
    ChoiceStream,
    chat_message,
    template_tools,
)
from kvserve.entrypoints.server.errors import APIError, anthropic_error_body
from kvserve.entrypoints.server.protocol_messages import CountTokensRequest, MessagesRequest
from kvserve.entrypoints.server.serving import (
    ClientGone,
    State,
    collect,
    encode_chat,
    failure,
    raise_failed,
)
from kvserve.entrypoints.server.serving_chat import submit_chat
from kvserve.outputs import CompletionOutput, RequestOutput

router = APIRouter()


@router.post("/v1/messages", response_model=None,
             responses=schemas.responses(schemas.Message, schemas.ANTHROPIC_ERRORS))
async def messages(state: State, body: MessagesRequest, raw: Request) -> Response:
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    if body.thinking is not None and body.thinking.type != "disabled" and \
            state.reasoning_parser is None:
        raise APIError(400, f'thinking of type "{body.thinking.type}" needs a server started '
                       "with --reasoning-parser for the model's format of thinking", "thinking")
    plan, stream, prompt_tokens = await submit_chat(state, body.chat_request(), rid)
    if body.stream:
        return StreamingResponse(_events(rid, state.model_name, plan, stream, prompt_tokens,
                                         body.omit_thinking),
                                 media_type="text/event-stream")
    try:
        (out,) = await collect([stream], raw)
    except ClientGone:
        return Response(status_code=499)
    raise_failed([out])
    c = out.outputs[0]
    blocks, has_calls = _blocks(plan, c.text, body.omit_thinking)
    reason, sequence = stop_reason(c, has_calls)
    return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                         "model": state.model_name, "content": blocks, "stop_reason": reason,
                         "stop_sequence": sequence, "usage": _usage(out, c)})


@router.post("/v1/messages/count_tokens", response_model=None,
             responses=schemas.responses(schemas.TokenCount, schemas.ANTHROPIC_ERRORS))
async def count_tokens(state: State, body: CountTokensRequest) -> Response:
    """The prompt's tokens as /v1/messages would render it: the chat template with the
    system prompt and the tools."""
    state.check_model(body.model)
    state.ready()
    tools, _, _ = body.chat_tools()
    hidden = body.tool_choice is not None and body.tool_choice.type == "none"
    ids = encode_chat(state.processor, body.chat_messages(), not body.prefill,
                      None if hidden else template_tools(tools or []), body.template_kwargs(),
                      continue_final_message=body.prefill)
    return JSONResponse({"input_tokens": len(ids)})


def stop_reason(c: CompletionOutput, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput, c: CompletionOutput) -> dict:
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached,
            "output_tokens": c.num_output_tokens, "cache_read_input_tokens": cached}


def _blocks(plan: ChatPlan, text: str, omit_thinking: bool = False
            ) -> tuple[list[dict], bool]:
    """A whole answer's content blocks: thinking (its text left out when `omit_thinking`),
    text, then a tool_use block per call. A call whose arguments do not decode to an object
    (cut off by max_tokens) is text."""
    message, has_calls = chat_message(plan, text)
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "signature": "",
                       "thinking": "" if omit_thinking else message["reasoning_content"]})
    body = message.get("content") or ""
    calls = []
    for call in message.get("tool_calls", []):
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = None
        if isinstance(args, dict):
            calls.append({"type": "tool_use", "id": call["id"],
                          "name": call["function"]["name"], "input": args})
        else:
            body += call["function"]["arguments"]
    if body:
        blocks.append({"type": "text", "text": body})
    return blocks + calls, bool(calls)


def _event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _BlockStream:
    """Chat deltas (chat_tools.ChoiceStream's) as content block events: a block opens when a
    delta of another kind arrives, and closes when the next opens or the answer ends."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.index = -1
        self.kind: str | None = None
        self.omit_thinking = omit_thinking

    def _open(self, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        return out + [_event({"type": "content_block_start", "index": self.index,
                              "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                out += self._open({"type": "tool_use", "id": piece["id"],
                                   "name": piece["function"]["name"], "input": {}})
            if piece["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": piece["function"]["arguments"]}))
        return out


async def _events(rid: str, model: str, plan: ChatPlan, stream: RequestStream,
                  prompt_tokens: int, omit_thinking: bool = False) -> AsyncIterator[str]:
    """message_start, the content blocks' events, message_delta (stop reason, usage) and
    message_stop; an `error` event instead of the rest if the request fails."""
    yield _event({"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    choice = ChoiceStream(plan)
    blocks = _BlockStream(omit_thinking)
    try:
        async for out in stream:
            if out.error:
                yield _event(anthropic_error_body(*failure(out.error)))
                return
            c = out.outputs[0]
            if not c.delta_text and not c.finished:
                continue
            for delta in choice.feed(c.delta_text, c.finished):
                for event in blocks.feed(delta):
                    yield event
            if c.finished:
                for event in blocks.close():
                    yield event
                reason, sequence = stop_reason(c, choice.has_calls)
                yield _event({"type": "message_delta",
                              "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": _usage(out, c)})
                yield _event({"type": "message_stop"})
                return
    except EngineDeadError as e:
        yield _event(anthropic_error_body(503, str(e)))
    finally:
        stream.close()
