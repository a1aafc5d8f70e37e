"""OpenAI request bodies we accept. Unknown fields are rejected (extra="forbid"), so a feature
we do not implement is a 400 naming it, never silently ignored."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.server.errors import APIError
from kvserve.sample.sampling_params import SamplingParams, StructuredOutputs, ThinkingBudget


class Strict(BaseModel):
    """A request body (or a part of one) that refuses fields it does not name."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JSONSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any] | bool | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(Strict):
    """vLLM's structured_outputs extra field: exactly one constraint."""

    json_: Annotated[dict[str, Any] | str | bool | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(Strict):
    """Fields shared by completions and chat: OpenAI's, plus vLLM's sampling extras."""

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1  # at most --max-n (limits.py)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the logs; it does not affect generation
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: prompt token logprobs, token ids as logprob tokens, keep the last k prompt
    # tokens; spaces_between_special_tokens is what kvserve's tokenizers always do
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    spaces_between_special_tokens: Literal[True] = True
    request_id: str | None = None  # caller-chosen id, echoed in the response
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share blocks
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The request's constraint and the field it came from; APIError(400) naming the
        field when it is malformed or given twice."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs "
                               "json_schema.schema", "response_format.json_schema")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            given = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                       ("choice", so.choice), ("grammar", so.grammar),
                                       ("json_object", so.json_object or None))
                     if v is not None}
            found.append(("structured_outputs", given))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        if not found:
            return None, None
        if len(found) > 1:
            raise APIError(400, "give at most one of response_format, structured_outputs and "
                           f"guided_*; got {[f for f, _ in found]}", found[1][0])
        field, given = found[0]
        return structured_outputs(given, field), field

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputs | None = None,
                        prompt_logprobs: int | None = None,
                        thinking_budget: ThinkingBudget | None = None) -> SamplingParams:
        """Raises ValueError naming the field for out-of-range values."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
            thinking_budget=thinking_budget,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


def structured_outputs(given: dict[str, Any], field: str) -> StructuredOutputs:
    """A StructuredOutputs from {json | json_object | regex | choice | grammar: value}; a JSON
    schema may be given as an object or as its text. APIError(400) naming `field`."""
    kw = dict(given)
    if "json" in kw and not isinstance(kw["json"], str):
        kw["json"] = json.dumps(kw["json"])
    if "choice" in kw:
        kw["choice"] = tuple(kw["choice"])
    if "json_object" in kw:
        kw["json_object"] = bool(kw["json_object"])
    try:
        return StructuredOutputs(**kw)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", field) from e


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0: with echo, the prompt only
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: int | None = None  # only best_of == n (the default) is supported
    suffix: None = None  # insertion is not supported; any value is rejected


def join_text(content: str | list) -> str:
    """Content given as text or as a list of parts that each hold `text`, as one text."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCallItem(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer
    reasoning_content: str | None = None

    def text(self) -> str:
        return "" if self.content is None else join_text(self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it: tool calls' arguments as
        objects (templates write them with tojson), content as text."""
        item: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            item["name"] = self.name
        if self.tool_call_id is not None:
            item["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            item["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            calls = []
            for i, c in enumerate(self.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError as e:
                    raise APIError(400, f"tool call {c.id!r}: arguments are not JSON: {e}",
                                   f"messages.tool_calls.{i}.function.arguments") from e
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            item["tool_calls"] = calls
        return item


class FunctionDefinition(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM: prepend the last message when it is the assistant's
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: how hard a reasoning model thinks. Chat templates that take it (gpt-oss's)
    # read it as the template variable `reasoning_effort`; others ignore it.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: at most this many tokens of thinking, then the reasoning parser's end tag is
    # forced and the model answers (needs a --reasoning-parser whose format has one).
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort added (where it is set; a different
        value in chat_template_kwargs is a 400)."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None:
            return kwargs
        kwargs = dict(kwargs or {})
        if kwargs.setdefault("reasoning_effort", self.reasoning_effort) != \
                self.reasoning_effort:
            raise APIError(400, "reasoning_effort differs from chat_template_kwargs' "
                           "reasoning_effort", "reasoning_effort")
        return kwargs


class EmbeddingRequest(Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own size: kvserve does not truncate
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
