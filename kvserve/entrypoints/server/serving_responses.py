"""OpenAI's Responses API: `POST /v1/responses`, whole or streamed with its typed events, the
API that OpenAI's agent SDKs default to.

A request becomes the chat request it is (protocol_responses), after the stored conversation
of its `previous_response_id`, and goes through the chat path: the same template, tools and
tool parsers, structured outputs (`text.format`), limits, metrics and engine. Only the
shapes differ: output items (reasoning, a message, function calls) instead of a choice."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.entrypoints.server import schemas
from kvserve.entrypoints.server.chat_tools import ChatPlan, ChoiceStream, chat_message
from kvserve.entrypoints.server.protocol import ChatMessage
from kvserve.entrypoints.server.protocol_responses import (
    ResponsesRequest,
    answer_message,
    tool_json,
)
from kvserve.entrypoints.server.serving import (
    ClientGone,
    ServerState,
    State,
    collect,
    failure,
    raise_failed,
)
from kvserve.entrypoints.server.serving_chat import submit_chat
from kvserve.outputs import CompletionOutput, RequestOutput

router = APIRouter()


@router.post("/v1/responses", response_model=None,
             responses=schemas.responses(schemas.ResponseObject))
async def responses(state: State, body: ResponsesRequest, raw: Request) -> Response:
    history = state.responses.history(body.previous_response_id)
    rid = f"resp_{uuid.uuid4().hex}"
    chat = body.chat_request(history)
    plan, stream, _ = await submit_chat(state, chat, rid)
    conversation = history + body.input_messages()
    shell = _Shell(rid, state.model_name, body)
    if body.stream:
        return StreamingResponse(_events(shell, plan, stream, state, conversation),
                                 media_type="text/event-stream")
    try:
        (out,) = await collect([stream], raw)
    except ClientGone:
        return Response(status_code=499)
    raise_failed([out])
    c = out.outputs[0]
    items = _items(plan, c.text)
    answer = shell.body(items, c, out)
    _store(state, body, rid, conversation, items, answer)
    return JSONResponse(answer)


@router.get("/v1/responses/{response_id}", response_model=None,
            responses=schemas.responses(schemas.ResponseObject))
async def retrieve(state: State, response_id: str) -> Response:
    """A stored response, as it was answered (store: true, the default)."""
    return JSONResponse(state.responses.body(response_id))


@router.delete("/v1/responses/{response_id}", response_model=None,
               responses=schemas.responses(schemas.ResponseDeleted))
async def delete(state: State, response_id: str) -> Response:
    """Forget a stored response: it can no longer be retrieved or continued."""
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Shell:
    """What a response says of its request, the same in every event that carries it."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest) -> None:
        self.id, self.model, self.request = rid, model, body
        self.created = int(time.time())

    def body(self, items: list[dict], c: CompletionOutput | None = None,
             out: RequestOutput | None = None) -> dict[str, Any]:
        b = self.request
        choice = b.tool_choice
        status = "in_progress" if c is None else \
            "incomplete" if c.finish_reason == "length" else "completed"
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) \
            if b.text and b.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "tool_choice": choice.model_dump() if choice is not None and
            not isinstance(choice, str) else (choice or "auto"),
            "tools": [tool_json(t) for t in b.tools or []], "text": {"format": fmt},
            "truncation": "disabled", "metadata": b.metadata or {}, "user": b.user,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": None},
            "usage": None if out is None or c is None else _usage(out, c)}


def _usage(out: RequestOutput, c: CompletionOutput) -> dict:
    prompt = len(out.prompt_token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": c.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + c.num_output_tokens}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
               status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _items(plan: ChatPlan, text: str) -> list[dict]:
    """A whole answer's output items: reasoning, the message (when it has text), then a
    function_call item per call."""
    message, _ = chat_message(plan, text)
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
              for c in message.get("tool_calls", [])]
    return items


def _store(state: ServerState, body: ResponsesRequest, rid: str,
           conversation: list[ChatMessage], items: list[dict], answer: dict) -> None:
    """Keep the response (`answer`, its body) and the conversation with its answer, for a
    later GET and previous_response_id."""
    if not body.store:
        return
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning"
                        for p in i["content"]) or None
    calls = [i for i in items if i["type"] == "function_call"]
    state.responses.put(rid, [*conversation, answer_message(text, calls, reasoning)], answer)


class _ItemStream:
    """Chat deltas (chat_tools.ChoiceStream's) as output item events: an item opens when a
    delta of another kind arrives and is done when the next opens or the answer ends."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict] = []  # done
        self.open: dict | None = None  # the item being streamed

    def event(self, payload: dict) -> str:
        payload["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _start(self, item: dict) -> list[str]:
        out = self.close()
        self.open = item
        index = len(self.items)
        out.append(self.event({"type": "response.output_item.added", "output_index": index,
                               "item": json.loads(json.dumps(item))}))
        part = {"message": {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            item["content"] = [dict(part)]
            out.append(self.event({"type": "response.content_part.added",
                                   "item_id": item["id"], "output_index": index,
                                   "content_index": 0, "part": part}))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = "completed"
        out = []
        if item["type"] == "function_call":
            out.append(self.event({"type": "response.function_call_arguments.done",
                                   "item_id": item["id"], "output_index": index,
                                   "name": item["name"], "arguments": item["arguments"]}))
        else:
            part = item["content"][0]
            done = {"type": "response.output_text.done", "logprobs": []} \
                if item["type"] == "message" else {"type": "response.reasoning_text.done"}
            out.append(self.event({**done, "item_id": item["id"], "output_index": index,
                                   "content_index": 0, "text": part["text"]}))
            out.append(self.event({"type": "response.content_part.done",
                                   "item_id": item["id"], "output_index": index,
                                   "content_index": 0, "part": part}))
        self.items.append(item)
        out.append(self.event({"type": "response.output_item.done", "output_index": index,
                               "item": item}))
        return out

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            text = delta.get(key)
            if not text:
                continue
            if self.open is None or self.open["type"] != kind:
                out += self._start({"type": kind, "id": _new_id("rs" if kind == "reasoning"
                                                                else "msg"),
                                    "status": "in_progress", **(
                                        {"summary": []} if kind == "reasoning" else
                                        {"role": "assistant", "content": []})})
            assert self.open is not None
            self.open["content"][0]["text"] += text
            event = "response.output_text.delta" if kind == "message" else \
                "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self.event({"type": event, "item_id": self.open["id"],
                                   "output_index": len(self.items), "content_index": 0,
                                   "delta": text, **extra}))
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                out += self._start(_call_item(piece["id"], piece["function"]["name"], "",
                                              status="in_progress"))
            args = piece["function"].get("arguments")
            if args:
                assert self.open is not None
                self.open["arguments"] += args
                out.append(self.event({"type": "response.function_call_arguments.delta",
                                       "item_id": self.open["id"],
                                       "output_index": len(self.items), "delta": args}))
        return out


async def _events(shell: _Shell, plan: ChatPlan, stream: RequestStream, state: ServerState,
                  conversation: list[ChatMessage]) -> AsyncIterator[str]:
    """response.created and .in_progress, the items' events, then response.completed (or
    .incomplete at max_output_tokens); an `error` event instead if the request fails."""
    items = _ItemStream()
    yield items.event({"type": "response.created", "response": shell.body([])})
    yield items.event({"type": "response.in_progress", "response": shell.body([])})
    choice = ChoiceStream(plan)
    try:
        async for out in stream:
            if out.error:
                status, message = failure(out.error)
                yield items.event({"type": "error", "code": str(status), "message": message,
                                   "param": None})
                return
            c = out.outputs[0]
            if not c.delta_text and not c.finished:
                continue
            for delta in choice.feed(c.delta_text, c.finished):
                for event in items.feed(delta):
                    yield event
            if c.finished:
                for event in items.close():
                    yield event
                body = shell.body(items.items, c, out)
                _store(state, shell.request, shell.id, conversation, items.items, body)
                kind = "response.incomplete" if body["status"] == "incomplete" else \
                    "response.completed"
                yield items.event({"type": kind, "response": body})
                return
    except EngineDeadError as e:
        yield items.event({"type": "error", "code": "503", "message": str(e), "param": None})
    finally:
        stream.close()
