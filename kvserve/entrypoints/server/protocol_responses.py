"""OpenAI's Responses API request bodies (`POST /v1/responses`), and their translation into
the chat request the engine path already serves.

Unknown fields are refused (extra="forbid"), as on the other routes. A conversation goes on
from an earlier response with `previous_response_id`: the server keeps each stored
response's conversation (ResponseStore, bounded, least recently used out) and puts it before
the new input, so the prompt's prefix is the earlier one's and the prefix cache serves it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Strict,
    Tool,
    ToolCallItem,
    join_text,
)


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, sent back in a conversation."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return join_text(self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return join_text(self.output)


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier answer's reasoning, sent back with its turn."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    """An input item's kind: its `type`, where a message may leave it out."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ReasoningConfig(Strict):
    """How hard a reasoning model thinks: `effort` reaches the chat template as
    `reasoning_effort` (gpt-oss's template reads it), as chat completions' field does.
    `summary` is accepted and answered with none: the reasoning item carries the model's
    reasoning text whole."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None

    def input_messages(self) -> list[ChatMessage]:
        """The new input as chat messages: consecutive function calls (and the reasoning and
        text before them) as one assistant turn with its tool calls, call outputs as tool
        messages."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        out: list[ChatMessage] = []
        reasoning: str | None = None
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + "".join(c.text for c in item.content or [])
                continue
            if isinstance(item, FunctionCallItem):
                call = ToolCallItem(id=item.call_id, function=FunctionCall(
                    name=item.name, arguments=item.arguments))
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and reasoning is None:
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                           reasoning_content=reasoning))
                reasoning = None
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                       content=item.text()))
            else:
                out.append(ChatMessage(role=item.role, content=item.text(),
                                       reasoning_content=reasoning
                                       if item.role == "assistant" else None))
                reasoning = None
        return out

    def chat_request(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this is, after `history` (the previous response's conversation;
        its instructions are not carried over, as OpenAI's API does)."""
        messages = list(history) + self.input_messages()
        if self.instructions:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        if not messages:
            raise APIError(400, "input must not be empty", "input")
        tools = [Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters))
            for t in self.tools or []] or None
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        fmt = self.text.format if self.text else None
        response_format = None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format of type json_schema needs its schema",
                               "text.format.schema")
            response_format = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
                name=fmt.name or "response", schema=fmt.schema_))
        elif fmt is not None and fmt.type == "json_object":
            response_format = ResponseFormat(type="json_object")
        prefill = messages[-1].role == "assistant" and not messages[-1].tool_calls
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens,
            stream=self.stream, temperature=self.temperature, top_p=self.top_p, tools=tools,
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls, user=self.user,
            response_format=response_format, add_generation_prompt=not prefill,
            continue_final_message=prefill,
            reasoning_effort=self.reasoning.effort if self.reasoning else None)


def answer_message(text: str, calls: list[dict], reasoning: str | None) -> ChatMessage:
    """An answer as the assistant turn a later request's history holds."""
    return ChatMessage(role="assistant", content=text, reasoning_content=reasoning,
                       tool_calls=[ToolCallItem(id=c["call_id"], function=FunctionCall(
                           name=c["name"], arguments=c["arguments"])) for c in calls] or None)


class ResponseStore:
    """Each stored response: its body (GET /v1/responses/{id}) and its conversation (its
    history and input, then its answer) for `previous_response_id`; at most `capacity` of
    them, the least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[ChatMessage], dict]] = OrderedDict()

    def history(self, response_id: str | None) -> list[ChatMessage]:
        if response_id is None:
            return []
        item = self._items.get(response_id)
        if item is None:
            raise APIError(400, f"previous response {response_id!r} not found: it was not "
                           "stored, or it is older than the last "
                           f"{self.capacity} (--responses-store-size)", "previous_response_id")
        self._items.move_to_end(response_id)
        return list(item[0])

    def body(self, response_id: str) -> dict:
        """A stored response as it was answered; APIError 404 when it is not stored."""
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"response {response_id!r} not found: it was not stored, was "
                           "deleted, or is older than the last "
                           f"{self.capacity} (--responses-store-size)", "response_id")
        return item[1]

    def put(self, response_id: str, messages: list[ChatMessage], body: dict) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = (messages, body)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.body(response_id)  # 404 when absent
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


def tool_json(t: FunctionTool) -> dict:
    """A declared tool as a response echoes it."""
    return {"type": "function", "name": t.name, "description": t.description,
            "parameters": t.parameters, "strict": t.strict}
