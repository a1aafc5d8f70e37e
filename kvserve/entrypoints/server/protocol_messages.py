"""Anthropic Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`),
and their translation into the chat request the engine path already serves.

Unknown fields are refused (extra="forbid"), as on the OpenAI routes: a feature kvserve does
not implement is a 400 naming it. What is accepted and has no effect here, and why:
`cache_control` (kvserve caches every prompt prefix, without being asked), `metadata.user_id`
(logged). `thinking` and `output_config.effort` become the chat request's template switch,
thinking budget and reasoning effort (Thinking, OutputConfig). Anthropic's client no longer
sends `temperature`, `top_p` or `top_k`; they are taken when a request has them (default
temperature 1).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

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


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # What Anthropic's client keeps of an answer's block when it is sent back (unused here).
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return join_text(self.content)


class ThinkingBlock(Strict):
    """An earlier answer's thinking, sent back with its turn (kvserve's signature is empty)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class MessageParam(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    """Anthropic's `thinking`. "enabled" thinks for at most `budget_tokens` tokens (the chat
    path's thinking_token_budget: the reasoning format's end tag is then forced), "adaptive"
    as long as the model likes, "disabled" not at all. Each sets the chat template's
    `enable_thinking` (Qwen 3's switch; templates without one ignore it). kvserve takes any
    budget from 1, where Anthropic's models take at least 1024: small local models are
    given smaller ones. `display: "omitted"` sends thinking blocks without their text."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    def check(self, max_tokens: int | None) -> None:
        if self.type == "enabled" and self.budget_tokens is None:
            raise APIError(400, 'thinking of type "enabled" needs budget_tokens',
                           "thinking.budget_tokens")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise APIError(400, f'thinking of type "{self.type}" takes no budget_tokens',
                           "thinking.budget_tokens")
        if self.budget_tokens is not None and max_tokens is not None and \
                self.budget_tokens >= max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({self.budget_tokens}) must be less "
                           f"than max_tokens ({max_tokens})", "thinking.budget_tokens")


class Metadata(Strict):
    user_id: str | None = None


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(Strict):
    """Anthropic's structured outputs (the answer is JSON valid against `format.schema`) and
    effort (the chat path's reasoning_effort, which gpt-oss's template reads: xhigh and max
    are its high)."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None

    def reasoning_effort(self) -> Literal["low", "medium", "high"] | None:
        return None if self.effort is None else _EFFORT[self.effort]


_EFFORT: dict[str, Literal["low", "medium", "high"]] = {
    "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class CountTokensRequest(Strict):
    model: str | None = None
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's switch for `thinking` (None: the template's default)."""
        if self.thinking is None:
            return None
        self.thinking.check(None)
        return {"enable_thinking": self.thinking.type != "disabled"}

    @property
    def omit_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    @property
    def prefill(self) -> bool:
        """A last assistant turn is a prefill, which the answer continues."""
        return self.messages[-1].role == "assistant"

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the system prompt first; a user turn's tool
        results as tool messages (before its text, as they answer the turn before); an
        assistant turn's tool_use blocks as its tool calls, its thinking as reasoning."""
        out: list[ChatMessage] = []
        if self.system:
            out.append(ChatMessage(role="system", content=join_text(self.system)))
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) \
                else m.content
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            if m.role == "user":
                for b in blocks:
                    if isinstance(b, ToolResultBlock):
                        out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                               content=b.text()))
                    elif not isinstance(b, TextBlock):
                        raise APIError(400, f"a user turn cannot hold a {b.type} block",
                                       f"messages.{i}.content")
                if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append(ChatMessage(role="user", content=text))
                continue
            calls = [ToolCallItem(id=b.id, function=FunctionCall(
                name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)))
                for b in blocks if isinstance(b, ToolUseBlock)]
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise APIError(400, "an assistant turn cannot hold a tool_result block",
                               f"messages.{i}.content")
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None,
                                   reasoning_content=thinking or None))
        return out

    def chat_tools(self) -> tuple[list[Tool] | None, Any, bool | None]:
        """`tools`, `tool_choice` and `parallel_tool_calls` as the chat request has them:
        auto -> "auto", any -> "required", tool -> the named function, none -> "none"."""
        tools = [Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema))
            for t in self.tools or []] or None
        c = self.tool_choice
        if c is None:
            return tools, None, None
        if c.type == "tool":
            if not c.name:
                raise APIError(400, 'tool_choice of type "tool" needs its name',
                               "tool_choice.name")
            choice: Any = NamedToolChoice(type="function", function=NamedFunction(name=c.name))
        else:
            if c.name is not None:
                raise APIError(400, f'tool_choice of type "{c.type}" takes no name',
                               "tool_choice.name")
            choice = {"auto": "auto", "any": "required", "none": "none"}[c.type]
        parallel = None if c.disable_parallel_tool_use is None else \
            not c.disable_parallel_tool_use
        return tools, choice, parallel


class MessagesRequest(CountTokensRequest):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this is: the same template, tools, limits and engine path. A last
        assistant turn is a prefill, continued (Anthropic's API): the answer is what follows
        it."""
        tools, choice, parallel = self.chat_tools()
        prefill = self.prefill
        fmt = self.output_config.format if self.output_config else None
        thinking = self.thinking
        if thinking is not None:
            thinking.check(self.max_tokens)
        return ChatCompletionRequest(
            model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens,
            add_generation_prompt=not prefill, continue_final_message=prefill,
            stop=self.stop_sequences, stream=self.stream, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, tools=tools, tool_choice=choice,
            parallel_tool_calls=parallel,
            user=self.metadata.user_id if self.metadata else None,
            response_format=None if fmt is None else ResponseFormat(
                type="json_schema", json_schema=JSONSchemaFormat(schema=fmt.schema_)),
            reasoning_effort=self.output_config.reasoning_effort() if self.output_config
            else None,
            chat_template_kwargs=self.template_kwargs(),
            thinking_token_budget=thinking.budget_tokens if thinking else None)
