"""The response bodies the server sends, as the OpenAPI document it publishes describes them
(/openapi.json): each JSON body, each stream chunk (the `data:` of a text/event-stream, or
the error event a stream may end with) and the error body of every 4xx/5xx.

These models are the contract, not the code path: `responses.Formatter` builds the bodies as
plain dicts (the hot path), and the test clients validate every body and chunk they receive
against this document (tests/server_utils.py), so the two cannot drift apart unseen. Every
object forbids fields it does not name, so a misspelt field fails as surely as a missing one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import models_json_schema

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Body):
    """Every error, as OpenAI sends it; also the event a stream ends with when it fails."""
    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(_Body):
    """kvserve's own: where one request's time went (seconds; None where it has not
    happened, e.g. no token decoded)."""
    queue_time: float | None
    prefill_time: float | None
    ttft: float | None
    decode_time: float | None
    tpot: float | None
    e2e_time: float | None
    num_preemptions: int
    preempted_time: float
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    num_draft_tokens: int | None = None  # with speculative decoding
    num_accepted_tokens: int | None = None


class PromptLogprob(_Body):
    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its entry
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# ------------------------------------------------------------------------- completions

class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # None in a stream until the choice ends
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings | list[Timings]


class CompletionChunk(_Body):
    """A stream's chunk: one choice's new text, or (stream_options.include_usage) the last,
    with no choices and the usage."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | list[Timings] | None = None


# -------------------------------------------------------------------------------- chat

class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCallDelta(_Body):
    name: str | None = None  # on a call's first piece
    arguments: str


class ToolCallDelta(_Body):
    index: int
    id: str | None = None  # on a call's first piece, with type and the function's name
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


# ------------------------------------------------------------------ the other endpoints

class Embedding(_Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: encoding_format "base64" (little-endian float32)


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(_Body):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(_Body):
    prompt: str


# ------------------------------------------------------------- Anthropic's Messages API

class AnthropicErrorDetail(_Body):
    type: str
    message: str


class AnthropicError(_Body):
    """Every error of /v1/messages, in Anthropic's shape; also its streams' error event."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(_Body):
    """input_tokens are those computed for this request; a prompt's cached prefix is
    cache_read_input_tokens, as Anthropic counts them."""
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class MessageTextBlock(_Body):
    type: Literal["text"]
    text: str


class MessageToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str


MessageBlock = Annotated[MessageTextBlock | MessageToolUseBlock | MessageThinkingBlock,
                         Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(_Body):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[MessageBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageStart(_Body):
    type: Literal["message_start"]
    message: Message


class ContentBlockStart(_Body):
    type: Literal["content_block_start"]
    index: int
    content_block: MessageBlock


class TextDelta(_Body):
    type: Literal["text_delta"]
    text: str


class InputJSONDelta(_Body):
    type: Literal["input_json_delta"]
    partial_json: str


class ThinkingDelta(_Body):
    type: Literal["thinking_delta"]
    thinking: str


class ContentBlockDelta(_Body):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | InputJSONDelta | ThinkingDelta, Field(discriminator="type")]


class ContentBlockStop(_Body):
    type: Literal["content_block_stop"]
    index: int


class MessageDeltaBody(_Body):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaUsage(_Body):
    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(_Body):
    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: MessageDeltaUsage


class MessageStop(_Body):
    type: Literal["message_stop"]


class MessageStreamEvent(RootModel[Annotated[
        MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
        | MessageStop, Field(discriminator="type")]]):
    """One event of a /v1/messages stream (its `data:`; the `event:` line names its type)."""


class TokenCount(_Body):
    input_tokens: int


# ------------------------------------------------------------ OpenAI's Responses API

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputText(_Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ResponseMessageItem(_Body):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ResponseReasoningText]
    status: ItemStatus


class ResponseFunctionCallItem(_Body):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem,
                       Field(discriminator="type")]
ContentPart = Annotated[ResponseOutputText | ResponseReasoningText, Field(discriminator="type")]


class ResponseInputTokensDetails(_Body):
    cached_tokens: int
    cache_write_tokens: int


class ResponseOutputTokensDetails(_Body):
    reasoning_tokens: int


class ResponseUsage(_Body):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseIncompleteDetails(_Body):
    reason: Literal["max_output_tokens"]


class ResponseFunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class ResponseFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ResponseTextConfig(_Body):
    format: dict[str, Any]  # the request's text.format, as it came ({"type": "text"} if none)


class ResponseReasoning(_Body):
    """The request's reasoning settings as answered: its effort (None: the template's
    default); no summaries are written."""
    effort: Literal["minimal", "low", "medium", "high"] | None
    summary: None


class ResponseObject(_Body):
    """A /v1/responses answer, and the `response` of its streams' lifecycle events."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    error: None
    incomplete_details: ResponseIncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | ResponseFunctionChoice
    tools: list[ResponseFunctionTool]
    text: ResponseTextConfig
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    user: str | None
    reasoning: ResponseReasoning
    usage: ResponseUsage | None


class ResponseDeleted(_Body):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseLifecycleEvent(_Body):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete"]
    sequence_number: int
    response: ResponseObject


class ResponseOutputItemEvent(_Body):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ResponseContentPartEvent(_Body):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class ResponseTextDeltaEvent(_Body):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class ResponseTextDoneEvent(_Body):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ResponseReasoningDeltaEvent(_Body):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponseReasoningDoneEvent(_Body):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class ResponseArgumentsDeltaEvent(_Body):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ResponseArgumentsDoneEvent(_Body):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseStreamEvent(RootModel[Annotated[
        ResponseLifecycleEvent | ResponseOutputItemEvent | ResponseContentPartEvent
        | ResponseTextDeltaEvent | ResponseTextDoneEvent | ResponseReasoningDeltaEvent
        | ResponseReasoningDoneEvent | ResponseArgumentsDeltaEvent
        | ResponseArgumentsDoneEvent, Field(discriminator="type")]]):
    """One event of a /v1/responses stream (its `data:`; the `event:` line names its type)."""


class ResponseErrorEvent(_Body):
    """The event a /v1/responses stream ends with when the request fails."""
    type: Literal["error"]
    sequence_number: int
    code: str | None
    message: str
    param: str | None


# The models of the streams' `data:` events, by the route that streams them, and of the
# error event a stream may end with.
STREAMS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionChunk, ErrorResponse),
    "/v1/chat/completions": (ChatCompletionChunk, ErrorResponse),
    "/v1/responses": (ResponseStreamEvent, ResponseErrorEvent),
    "/v1/messages": (MessageStreamEvent, AnthropicError)}

# Every error, by range (OpenAPI's "4XX"/"5XX"): 400 invalid request (a malformed body
# included: never FastAPI's 422), 401 API key, 404 unknown model, 413 body too large, 429
# queue full (Retry-After), 500 internal error, 503 not loaded yet or the engine stopped.
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "the request is refused"},
    "5XX": {"model": ErrorResponse, "description": "the server failed it"}}
# The same statuses on Anthropic's routes, in its error shape.
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    k: {**v, "model": AnthropicError} for k, v in ERRORS.items()}


def responses(model: type[BaseModel], errors: dict[int | str, dict[str, Any]] = ERRORS
              ) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route answering `model` on 200 (and `errors` otherwise)."""
    return {200: {"model": model}, **errors}


def publish_streams(app: FastAPI) -> None:
    """Put each streaming route's chunk schema in the OpenAPI document, as the
    text/event-stream content of its 200 (any chunk: the chunk model, or the error event),
    with the chunk models in components/schemas beside the rest."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        models = {m for pair in STREAMS.values() for m in pair}
        _, defs = models_json_schema([(m, "serialization") for m in models],
                                     ref_template="#/components/schemas/{model}")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        for path, (model, error) in STREAMS.items():
            ok = doc["paths"][path]["post"]["responses"]["200"]
            ok.setdefault("content", {})["text/event-stream"] = {"schema": {"oneOf": [
                {"$ref": f"#/components/schemas/{model.__name__}"},
                {"$ref": f"#/components/schemas/{error.__name__}"}]}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
