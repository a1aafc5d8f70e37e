"""Tool calls and reasoning on the chat endpoint: what a request's `tools` and `tool_choice`
ask of the engine, and how a choice's generated text becomes the message sent back.

- `none` (or no tools): plain text; the tools are not shown to the model.
- `required` and a named function are enforced by a grammar built from the tools' parameter
  schemas, so they work on any model: a named function's output is its arguments object; a
  required call's output is a JSON array of {"name", "parameters"} objects (one item when
  parallel_tool_calls is false).
- `auto` needs `--enable-auto-tool-choice` and a `--tool-call-parser` for the model's own
  format (tool_parsers.TOOL_PARSERS: the forms each family writes); its output is parsed.
  Where the format has a lazy grammar (tool_call_grammar) and the request no other
  constraint, the output is free until the model opens a call, and the call is then held to
  the declared functions and their schemas. Text that would call an undeclared function
  stays content.

With a `--reasoning-parser`, the text up to the end of the thinking goes to
`reasoning_content` first and only the rest is read for content and tool calls; a constraint
(tools or response_format) applies only after the thinking's end tag, and a
`thinking_token_budget` forces that tag once the thinking has taken its tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvserve.entrypoints.server.call_scan import CallScan, Scan
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvserve.entrypoints.server.reasoning import ReasoningParser, get_reasoning_parser
from kvserve.entrypoints.server.tool_parsers import (
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)
from kvserve.sample.sampling_params import StructuredOutputs, ThinkingBudget


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the whole (grammar-constrained) output is its arguments,
    streamed as they come."""

    name: ClassVar[str] = "named"

    def __init__(self, function: str) -> None:
        super().__init__([function])
        self.function = function
        self._call: ToolCall | None = None

    def parse(self, text: str) -> ParsedMessage:
        return ParsedMessage(None, [ToolCall(self.function, text)])

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        if not delta:
            return StreamDelta()
        if self._call is None:
            self._call = ToolCall(self.function, "")
            self._calls.append(self._call)
            piece = ToolCallDelta(0, self._call.id, self.function, delta)
        else:
            piece = ToolCallDelta(0, arguments=delta)
        self._call.arguments += delta
        return StreamDelta(tool_calls=[piece])

    def finish(self) -> StreamDelta:
        self._check_open()
        self._finished = True
        if self._call is None:  # nothing generated: still one call, with empty arguments
            self._call = ToolCall(self.function, "")
            self._calls.append(self._call)
            return StreamDelta(tool_calls=[ToolCallDelta(0, self._call.id, self.function)])
        return StreamDelta()


class RequiredToolParser(ToolParser):
    """tool_choice "required": the (grammar-constrained) output is a JSON array of
    {"name", "parameters"}. Each call is sent once its name is read, and its arguments as they
    come (the model's own text of them). Text that is not such an array is content; in a
    stream, calls already sent when the array breaks (cut off by max_tokens) are `broken`."""

    name: ClassVar[str] = "required"

    _KEYS: ClassVar[tuple[str, ...]] = ("parameters",)

    def __init__(self, tool_names: list[str] | None = None,
                 schemas: dict[str, dict] | None = None, stream_arguments: bool = True) -> None:
        super().__init__(tool_names, schemas)
        self._stream_arguments = stream_arguments
        self._pos = 0  # how far the buffer is read
        self._expect = "["  # "[", "item", ", or ]", "end", or "" once it is not the array
        self._scan: CallScan | None = None
        self._scan_from = 0  # where the current item starts in the buffer
        self._done: list[ToolCall] = []  # complete calls (all of them when held)

    def parse(self, text: str) -> ParsedMessage:
        scan = RequiredToolParser(self.tool_names, self.schemas, stream_arguments=False)
        scan.feed(text)
        scan.finish()
        calls = scan.tool_calls()
        return ParsedMessage(None, calls) if calls else ParsedMessage(text or None, [])

    def feed(self, delta: str) -> StreamDelta:
        self._check_open()
        self._buffer += delta
        out = StreamDelta()
        while self._expect and self._step(out):
            pass
        return out

    def _step(self, out: StreamDelta) -> bool:
        """Read one piece of the array; False when it needs more text (or it is no array)."""
        b = self._buffer
        if self._expect != "item":
            while self._pos < len(b) and b[self._pos].isspace():
                self._pos += 1
            if self._pos == len(b):
                return False
            c = b[self._pos]
            ok = {"[": "[", ", or ]": ",]", "end": ""}[self._expect]
            if c not in ok:
                self._expect = ""
                return False
            self._pos += 1
            self._expect = "end" if c == "]" else "item"
            self._scan, self._scan_from = None, self._pos
            return True
        if self._scan is None:
            self._scan = CallScan(self._KEYS, self.tool_names)
        scan = self._scan
        piece = scan.feed(b[self._pos:])
        self._pos = len(b)
        if scan.status in (Scan.HEAD, Scan.OTHER, Scan.BROKEN):
            if scan.status is not Scan.HEAD:
                self._expect = ""
            return False
        assert scan.name is not None
        if self._stream_arguments:
            if len(self._calls) == len(self._done):
                call = ToolCall(scan.name, "")
                self._calls.append(call)
                out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, call.id, call.name))
            if piece:
                self._calls[-1].arguments += piece
                out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, arguments=piece))
        if scan.status is not Scan.DONE:
            return False
        self._done.append(self._calls[-1] if self._stream_arguments
                          else ToolCall(scan.name, scan.arguments))
        self._pos = self._scan_from + scan.end
        self._expect = ", or ]"
        return True

    def finish(self) -> StreamDelta:
        self._check_open()
        self._finished = True
        whole = self._expect == "end" and not self._buffer[self._pos:].strip()
        if whole and not self._stream_arguments:
            self._calls = list(self._done)
            return StreamDelta()
        if whole:
            return StreamDelta()
        if self._calls:  # sent, but the array never ended
            self.broken = list(range(len(self._calls)))
            return StreamDelta()
        return StreamDelta(content=self._buffer)


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else \
        {"type": "object"}


@dataclass
class ChatPlan:
    """What a chat request needs beyond plain text, decided before it is queued."""

    tools: list[dict] | None  # for the chat template
    mode: str  # none | auto | required | named
    function: str | None  # the named function
    constraint: StructuredOutputs | None
    constraint_field: str | None
    tool_parser: str | None  # auto: the format to parse
    reasoning_parser: str | None
    tool_names: list[str]
    # Each tool's parameters schema: parsers of forms with text arguments type them by it.
    tool_schemas: dict[str, dict] = dataclasses.field(default_factory=dict)
    echo: str = ""  # vLLM's echo: the last (assistant) message's text, which this continues
    thinking_budget: ThinkingBudget | None = None  # thinking_token_budget, with its end tag

    def parser(self) -> ToolParser | None:
        if self.mode == "named":
            assert self.function is not None
            return NamedToolParser(self.function)
        if self.mode == "required":
            return RequiredToolParser(self.tool_names)
        if self.mode == "auto":
            assert self.tool_parser is not None
            return get_tool_parser(self.tool_parser)(self.tool_names, self.tool_schemas)
        return None

    def reasoning(self) -> ReasoningParser | None:
        return get_reasoning_parser(self.reasoning_parser)() if self.reasoning_parser else None


def plan_chat(body: ChatCompletionRequest, constraint: StructuredOutputs | None,
              constraint_field: str | None, auto_tool_parser: str | None,
              reasoning_parser: str | None, token_ids: Mapping[str, int] | None = None
              ) -> ChatPlan:
    """Check `tools` and `tool_choice` (APIError 400 naming the field) and decide the mode.
    `auto_tool_parser` is the server's --tool-call-parser when --enable-auto-tool-choice is
    on, else None; `token_ids` the vocabulary's ids of its SPECIAL_TOKENS."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", "tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools and choice != "none":
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    function = None
    if isinstance(choice, NamedToolChoice):
        function = choice.function.name
        if function not in names:
            raise APIError(400, f"tool_choice names function {function!r}, which is not "
                           f"among the tools {names}", "tool_choice")
        mode = "named"
    else:
        mode = choice
    if mode == "auto" and auto_tool_parser is None:
        raise APIError(400, 'tool_choice "auto" needs a server started with '
                       "--enable-auto-tool-choice and --tool-call-parser; send "
                       'tool_choice "required" or a named function instead (enforced by a '
                       "grammar on any model)", "tool_choice")
    if mode in ("named", "required"):
        if constraint is not None:
            raise APIError(400, f"tool_choice {mode!r} cannot be combined with "
                           f"{constraint_field}", constraint_field)
        if mode == "named":
            schema = _parameters(next(t for t in tools if t.function.name == function))
        else:
            item = {"anyOf": [{
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"], "additionalProperties": False}
                for t in tools]}
            schema = {"type": "array", "items": item, "minItems": 1}
            if body.parallel_tool_calls is False:
                schema["maxItems"] = 1
        constraint, constraint_field = StructuredOutputs(json=json.dumps(schema)), "tools"
    end_tag = get_reasoning_parser(reasoning_parser).END_TAG if reasoning_parser else None
    budget = None
    if body.thinking_token_budget is not None:
        if end_tag is None:
            raise APIError(400, "a thinking budget needs a server started with "
                           "--reasoning-parser for a format that ends its thinking with a tag "
                           f"({reasoning_parser or 'none here'} has none)",
                           "thinking_token_budget")
        if (body.chat_template_kwargs or {}).get("enable_thinking") is False:
            # the template closes the thinking in the prompt: a forced tag would land in
            # the answer
            raise APIError(400, "thinking_token_budget needs thinking: chat_template_kwargs "
                           "turns it off (enable_thinking: false)", "thinking_token_budget")
        budget = ThinkingBudget(end=end_tag, tokens=body.thinking_token_budget)
    if constraint is not None and end_tag is not None:
        # A reasoning model thinks first: the constraint starts after its thinking. (A
        # format with no end tag, such as harmony, is held to it from the first token.)
        try:
            constraint = dataclasses.replace(constraint, reasoning_end=end_tag)
        except ValueError as e:
            raise APIError(400, f"{constraint_field}: {e}", constraint_field) from e
    if mode == "auto" and constraint is None:
        assert auto_tool_parser is not None
        lazy = tool_call_grammar(get_tool_parser(auto_tool_parser), tools, token_ids)
        if lazy is not None:
            constraint, constraint_field = StructuredOutputs(grammar=lazy), "tools"
    return ChatPlan(template_tools(tools) if mode != "none" else None, mode, function,
                    constraint, constraint_field,
                    auto_tool_parser if mode == "auto" else None, reasoning_parser, names,
                    {t.function.name: _parameters(t) for t in tools}, thinking_budget=budget)


def template_tools(tools: list) -> list[dict] | None:
    """The tools as chat templates read them (None: none, or hidden by tool_choice none)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in tools] or None


def tool_call_grammar(parser: type[ToolParser], tools: list,
                      token_ids: Mapping[str, int] | None = None) -> str | None:
    """tool_choice auto's grammar (llguidance's Lark) for `tools` in `parser`'s form: free
    text until a call opens, then a call of a declared function with arguments valid
    against its schema. None when the form has no grammar. `token_ids`: the vocabulary's
    ids of the form's SPECIAL_TOKENS."""
    return parser.lazy_grammar({t.function.name: _parameters(t) for t in tools}, token_ids)


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(plan: ChatPlan, text: str) -> tuple[dict, bool]:
    """A whole choice's message, and whether it holds tool calls."""
    text = plan.echo + text
    reasoning = None
    rp = plan.reasoning()
    content: str | None = text
    if rp is not None:
        reasoning, content = rp.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if rp is not None:
        message["reasoning_content"] = reasoning
    tp = plan.parser()
    if tp is None:
        if message["content"] is None:
            message["content"] = ""
        return message, False
    parsed = tp.parse(content or "")
    message["content"] = parsed.content
    if parsed.tool_calls:
        message["tool_calls"] = [_call_json(c) for c in parsed.tool_calls]
    return message, bool(parsed.tool_calls)


class ChoiceStream:
    """One streamed choice: text deltas in, chat `delta` objects out."""

    def __init__(self, plan: ChatPlan) -> None:
        self.reasoning = plan.reasoning()
        self.tools = plan.parser()
        self.has_calls = False
        self._echo = plan.echo

    def feed(self, text: str, final: bool) -> list[dict]:
        deltas: list[dict] = []
        text, self._echo = self._echo + text, ""
        content = text
        if self.reasoning is not None:
            r, content = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                r, content = r + r2, content + c2
            if r:
                deltas.append({"reasoning_content": r})
        if self.tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        out = self.tools.feed(content) if content else StreamDelta()
        if final:
            last = self.tools.finish()
            out = StreamDelta(out.content + last.content, out.tool_calls + last.tool_calls)
        if out.content:
            deltas.append({"content": out.content})
        for d in out.tool_calls:
            self.has_calls = True
            piece: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                piece["id"], piece["type"] = d.id, "function"
                piece["function"]["name"] = d.name
            deltas.append({"tool_calls": [piece]})
        return deltas
