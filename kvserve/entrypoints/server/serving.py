"""What every route shares: the server's state (one per app, reached through the `State`
dependency) and the steps from an API request to the engine and back: adding its requests,
merging and collecting their outputs, and the errors on the way, as OpenAI's bodies.

Every request that reaches the engine is closed in a `finally`, so a client that goes away
(streaming or not) aborts its request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.processor import OutputProcessor
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.history import HistoryRecorder
from kvserve.entrypoints.server.metrics_text import PLAIN_REPLICA
from kvserve.entrypoints.server.protocol_responses import ResponseStore
from kvserve.entrypoints.server.reasoning import detect_reasoning_parser, get_reasoning_parser
from kvserve.entrypoints.server.tool_parsers import (
    TOOL_PARSERS,
    detect_tool_parser,
    get_tool_parser,
)
from kvserve.models.paths import DEFAULT_MODEL, resolve_model
from kvserve.outputs import LATE_REFUSAL, OutputKind, RequestOutput
from kvserve.sample.structured import StructuredOutputError
from kvserve.tokenizer import Tokenizer


def default_served_name(model: str | None) -> str:
    path = resolve_model(model)
    if model is None or path.name.startswith(DEFAULT_MODEL):
        return DEFAULT_MODEL
    return path.stem if path.suffix == ".gguf" else path.name


class ServerState:
    def __init__(self, engine_args: EngineArgs, args: ServerArgs) -> None:
        self.engine_args, self.args = engine_args, args
        self.model_name = args.served_model_name or default_served_name(engine_args.model)
        self.registry = CollectorRegistry()
        # the `replica` label of its metrics (metrics_text); a Ray Serve replica sets its id
        self.replica = PLAIN_REPLICA
        self.metrics = EngineMetrics(self.model_name, self.registry,
                                     engine_args.latency_targets())
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.stopping = False  # the app's shutdown has begun (/ready)
        # the dashboard's time series, recorded while the app runs (build_app's lifespan)
        self.recorder = HistoryRecorder(self.metrics, lambda: self.engine)
        self.responses = ResponseStore(args.responses_store_size)  # previous_response_id
        self._token_ids: dict[tuple[str, ...], dict[str, int]] = {}  # by token names

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            message = (f"model failed to load: {self.load_error}" if self.load_error
                       else "model is loading")
            raise APIError(503, message)
        return self.engine

    @property
    def llm_engine(self) -> LLMEngine:
        engine = self.ready().engine
        assert engine is not None
        return engine

    @property
    def processor(self) -> OutputProcessor:
        return self.llm_engine.processor

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @functools.cached_property
    def detected_tool_parser(self) -> str | None:
        """The tool-call form the loaded model's chat template shows (detect_tool_parser),
        read once: the template does not change after the load."""
        return detect_tool_parser(self.tokenizer.chat_template)

    @property
    def auto_tool_parser(self) -> str | None:
        """tool_choice auto's parser: --tool-call-parser, or with `auto` the one the chat
        template's markers show (APIError 400 when they show none); None without
        --enable-auto-tool-choice."""
        name = self.args.tool_call_parser if self.args.enable_auto_tool_choice else None
        if name != "auto":
            return name
        found = self.detected_tool_parser
        if found is None:
            raise APIError(400, 'tool_choice "auto": --tool-call-parser auto found no tool-call '
                           "form in this model's chat template; start the server with one of "
                           f"{sorted(TOOL_PARSERS)}, or send tool_choice \"required\"",
                           "tool_choice")
        return found

    @property
    def reasoning_parser(self) -> str | None:
        """The reasoning parser chat requests use: --reasoning-parser, else the one a format
        that cannot be read without it asks for (detect_reasoning_parser: gpt-oss's
        harmony, whose answer is inside its markup)."""
        if self.args.reasoning_parser is not None:
            return self.args.reasoning_parser
        return self.detected_reasoning_parser

    @functools.cached_property
    def detected_reasoning_parser(self) -> str | None:
        """The reasoning parser the loaded model's chat template requires, read once."""
        return detect_reasoning_parser(self.tokenizer.chat_template)

    def tool_token_ids(self, parser: str) -> dict[str, int]:
        """The ids of `parser`'s SPECIAL_TOKENS that this model's vocabulary has (cached)."""
        return self._vocab_ids(get_tool_parser(parser).SPECIAL_TOKENS)

    def reasoning_token_ids(self, parser: str) -> dict[str, int]:
        """The ids of reasoning parser `parser`'s SPECIAL_TOKENS in this vocabulary."""
        return self._vocab_ids(get_reasoning_parser(parser).SPECIAL_TOKENS)

    def _vocab_ids(self, names: tuple[str, ...]) -> dict[str, int]:
        if names not in self._token_ids:
            found = {t: self.tokenizer.token_to_id(t) for t in names}
            self._token_ids[names] = {t: i for t, i in found.items() if i is not None}
        return self._token_ids[names]

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model")


def get_state(request: Request) -> ServerState:
    return request.app.state.kvserve


# A route's parameter `state: State` is the app's ServerState.
State = Annotated[ServerState, Depends(get_state)]


async def add_requests(engine: AsyncEngine, request_id: str, prompts: list, params,
               cache_salt: str | None, stream: bool, structured_field: str | None = None
               ) -> list[RequestStream]:
    """One engine request per prompt (ids `<id>-<i>` when there are several), accepted or
    refused together. A streamed response needs each step's new text; a whole one only the
    last output. A constraint the engine cannot compile is a 400 naming `structured_field`,
    the field it came from."""
    kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                  for i in range(len(prompts))]
    try:
        return await engine.add_requests([(rid, p, params) for rid, p in zip(
            ids, prompts, strict=True)], cache_salt, kind)
    except StructuredOutputError as e:
        raise APIError(400, f"{structured_field}: {e}", structured_field) from e
    except ValueError as e:
        raise APIError(400, str(e)) from e
    except QueueFullError as e:
        raise APIError(429, f"server busy: {e}; retry later",
                       headers={"Retry-After": str(e.retry_after)}) from e
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def engine_call(state: ServerState, fn):
    """`fn(engine)` on the engine thread between steps: reads of what that thread changes."""
    try:
        return await state.ready().call(fn)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e


def close_streams(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


class ClientGone(Exception):
    pass


async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Final outputs of all streams; aborts them if the client disconnects meanwhile."""

    async def gather() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge(streams):
            finals[i] = out
        return finals  # type: ignore[return-value]

    task = asyncio.create_task(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()
        close_streams(streams)


def failure(error: str) -> tuple[int, str]:
    """The status and message of a request the engine ended with `error`: a queued request
    refused as predicted to miss its TTFT target is a 429 (server busy), like one refused on
    arrival; anything else failed inside the engine."""
    if error == LATE_REFUSAL:
        return 429, f"server busy: {error}; retry later"
    return 500, f"request failed: {error}"


def raise_failed(outs: list[RequestOutput]) -> None:
    for o in outs:
        if o.error:
            status, message = failure(o.error)
            raise APIError(status, message,
                           headers={"Retry-After": "1"} if status == 429 else None)


def check_prompt_tokens(state: ServerState, prompts: list, name: str) -> None:
    """--max-prompt-tokens on each prompt (text is tokenized here only for the count)."""
    if state.args.limits.max_prompt_tokens is None:
        return
    for p in prompts:
        n = len(p) if isinstance(p, list) else len(state.tokenizer.encode(p))
        state.args.limits.check_prompt_tokens(n, name)


def prompt_lists(prompt, name: str = "prompt") -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{name} must not be empty", name)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def check_stream_options(stream: bool, options) -> None:
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       "stream_options")


def sampling_params_for(body, max_tokens: int | None, logprobs: int | None, structured=None,
            prompt_logprobs: int | None = None, thinking_budget=None):
    try:
        return body.sampling_params(max_tokens, logprobs, structured, prompt_logprobs,
                                    thinking_budget)
    except ValueError as e:
        raise APIError(400, str(e)) from e


def encode_chat(processor: OutputProcessor, messages, add_generation_prompt: bool,
                 tools: list[dict] | None = None, template_kwargs: dict | None = None,
                 continue_final_message: bool = False) -> list[int]:
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                       "continue_final_message")
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
    clash = sorted(reserved & set(template_kwargs or {}))
    if clash:
        raise APIError(400, f"chat_template_kwargs must not set {clash}: they have fields of "
                       "their own", "chat_template_kwargs")
    plain = [m.for_template() for m in messages]
    try:
        return processor.encode_chat(plain, add_generation_prompt, tools=tools,
                                     continue_final_message=continue_final_message,
                                     **(template_kwargs or {}))
    except ValueError as e:
        raise APIError(400, f"chat template: {e}", "messages") from e


def new_logprobs(c) -> list | None:
    if c.logprobs is None:
        return None
    n = len(c.delta_token_ids)
    return c.logprobs[len(c.logprobs) - n:] if n else []
