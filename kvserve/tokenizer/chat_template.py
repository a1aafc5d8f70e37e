"""Chat templates: Hugging Face's Jinja templates rendered in jinja2's immutable sandbox,
with the filters and globals they expect, a render time budget and bounded products, so that
a hostile template (it comes with the model file) fails its request clearly."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template refused its input (its `raise_exception`) or failed to render."""


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # Like transformers: keys set to None are dropped (OpenAI clients send content=None with
    # tool calls, and templates test for presence), and reasoning is visible under the names
    # templates read it by.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning_keys = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in reasoning_keys if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and takes no json.dumps options; HF templates need both.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    HF templates; for rendering it is a no-op around its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# A chat template comes with the model file: it renders in jinja2's immutable sandbox (no
# attributes of Python internals, no file access: there is no loader), within a time budget
# and with bounded string and list products, so a hostile one fails its request clearly.
RENDER_SECONDS = 1.0
MAX_PRODUCT = 1 << 20  # elements of a repeated string or list
_render_budget = threading.local()


def _check_budget() -> None:
    deadline = getattr(_render_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError(f"chat template took over {RENDER_SECONDS:g} s to render")


def _bounded_range(*args: int) -> Iterator[int]:
    """range() for templates: the sandbox's size cap, and the render budget checked as the
    loop runs (nested loops cannot run for ever)."""
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"chat template asked for a range over {MAX_RANGE} items")
    for i, x in enumerate(r):
        if i % 1024 == 0:
            _check_budget()
        yield x


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_budget()
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise ChatTemplateError("chat template raised a number to a power over 64")
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(times, int) and \
                    len(seq) * times > MAX_PRODUCT:
                raise ChatTemplateError(f"chat template built a sequence over {MAX_PRODUCT} "
                                        "items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_budget()
        return super().call(__context, __obj, *args, **kwargs)


@functools.cache
def _template_environment() -> ImmutableSandboxedEnvironment:
    env = _TemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.globals["range"] = _bounded_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc


def render_chat_template(source: str, variables: dict[str, Any]) -> str:
    """`source` rendered with `variables` (messages, tools, add_generation_prompt and the
    special-token strings), within the render budget. Raises ChatTemplateError (a ValueError)
    when the template rejects the conversation or fails, ValueError when it does not parse."""
    template = _compile_chat_template(source)
    messages = [_template_message(m) for m in variables.get("messages") or []]
    _render_budget.deadline = time.monotonic() + RENDER_SECONDS
    try:
        return template.render({**variables, "messages": messages})
    except (jinja2.TemplateError, TypeError, ValueError, OverflowError,
            RecursionError) as exc:
        # Sandbox refusals, the render budget, and templates that misuse values or ask
        # for files (no loader): the template's fault, never the server's.
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    finally:
        _render_budget.deadline = None
