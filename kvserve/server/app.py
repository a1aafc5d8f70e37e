"""OpenAI-compatible HTTP server over the async engine.

The model loads in the background after the server starts listening: /health answers 503
until it is ready. Every request that reaches the engine is closed in a `finally`, so a
client that goes away (streaming or not) aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import kvserve
from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from kvserve.engine.llm_engine import EngineArgs, LLMEngine, build_engine
from kvserve.engine.processor import OutputProcessor
from kvserve.metrics import EngineMetrics
from kvserve.models.paths import DEFAULT_MODEL, resolve_model
from kvserve.outputs import LATE_REFUSAL, OutputKind, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import schemas
from kvserve.server.args import ServerArgs
from kvserve.server.chat_tools import ChatPlan, ChoiceStream, finish_reason, plan_chat
from kvserve.server.errors import APIError, GuardMiddleware, error_body, install_error_handlers
from kvserve.server.history import HistoryRecorder
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from kvserve.server.responses import Formatter, sse, usage
from kvserve.structured import StructuredOutputError
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.server")
_WEB_UI = Path(__file__).parent / "static" / "index.html"  # chat playground + dashboard


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
        self.metrics = EngineMetrics(self.model_name, self.registry,
                                     engine_args.latency_targets())
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None

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

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model")


async def _add(engine: AsyncEngine, request_id: str, prompts: list, params,
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


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _engine_call(state: ServerState, fn):
    """`fn(engine)` on the engine thread between steps: reads of what that thread changes."""
    try:
        return await state.ready().call(fn)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e


def _close(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


class ClientGone(Exception):
    pass


async def _collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Final outputs of all streams; aborts them if the client disconnects meanwhile."""

    async def gather() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge(streams):
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
        _close(streams)


def _failure(error: str) -> tuple[int, str]:
    """The status and message of a request the engine ended with `error`: a queued request
    refused as predicted to miss its TTFT target is a 429 (server busy), like one refused on
    arrival; anything else failed inside the engine."""
    if error == LATE_REFUSAL:
        return 429, f"server busy: {error}; retry later"
    return 500, f"request failed: {error}"


def _raise_failed(outs: list[RequestOutput]) -> None:
    for o in outs:
        if o.error:
            status, message = _failure(o.error)
            raise APIError(status, message,
                           headers={"Retry-After": "1"} if status == 429 else None)


def _check_prompt_tokens(state: ServerState, prompts: list, name: str) -> None:
    """--max-prompt-tokens on each prompt (text is tokenized here only for the count)."""
    if state.args.limits.max_prompt_tokens is None:
        return
    for p in prompts:
        n = len(p) if isinstance(p, list) else len(state.tokenizer.encode(p))
        state.args.limits.check_prompt_tokens(n, name)


def _prompt_lists(prompt, name: str = "prompt") -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{name} must not be empty", name)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def build_app(engine_args: EngineArgs, args: ServerArgs,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    state = ServerState(engine_args, args)
    recorder = HistoryRecorder(state.metrics, lambda: state.engine)  # the dashboard's series

    async def load() -> None:
        engine = AsyncEngine(lambda: build_engine(engine_args), state.metrics,
                             args.max_waiting_requests)
        try:
            await engine.start()
        except Exception as e:
            log.error("model failed to load: %s", e)
            state.load_error = str(e)
            if on_fatal is not None:
                on_fatal(e)
            return
        state.engine = engine
        log.info("ready: serving %s at http://%s:%d/v1", state.model_name, args.host, args.port)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loader = asyncio.create_task(load())
        recorder.start()
        yield
        await recorder.stop()
        loader.cancel()
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    schemas.publish_streams(app)
    app.add_middleware(GuardMiddleware, api_key=args.api_key,
                       max_body_bytes=args.max_request_bytes,
                       metrics_api_key=args.metrics_api_key)

    # ------------------------------------------------------------------ plain endpoints

    @app.get("/health")
    async def health() -> Response:
        reason = state.ready().health_error()
        if reason is not None:
            raise APIError(503, reason)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> dict:
        timeline = await _engine_call(state, lambda e: e.request_timeline(request_id))
        if timeline is None:
            raise APIError(404, f"no timeline for request {request_id!r}: unknown, or older "
                           f"than the last {state.engine_args.timeline_buffer_size} finished "
                           "requests", "request_id")
        return timeline

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict:
        """Everything the dashboard shows, in one poll."""
        out = await _engine_call(state, lambda e: e.dashboard_state())
        out.update(state.metrics.dashboard())
        out["model"] = state.model_name
        return out

    @app.get("/v1/engine/history")
    async def engine_history(seconds: float | None = None) -> dict:
        """The dashboard's samples of the last `seconds` (up to 10 minutes), oldest first."""
        return recorder.history.as_json(seconds)

    @app.get("/", include_in_schema=False)
    async def web_ui() -> Response:
        return HTMLResponse(_WEB_UI.read_text(encoding="utf-8"))

    @app.get("/v1/engine/steps")
    async def engine_steps(limit: int = 100) -> dict:
        if limit < 1:
            raise APIError(400, "limit must be >= 1", "limit")
        stats = state.ready().stats
        steps = stats.steps[-limit:] if stats is not None else ()
        return {"object": "list", "data": [s.as_json() for s in steps]}

    @app.get("/v1/engine/integrity")
    async def engine_integrity() -> dict:
        """The KV cache's integrity check, run on the engine thread between two steps."""
        def check(engine: LLMEngine) -> dict:
            stats = engine.stats()
            report = {"ok": True, "error": None, "running": stats.running,
                      "waiting": stats.waiting, "kv_blocks": stats.kv_blocks,
                      "kv_free_blocks": stats.kv_free_blocks}
            try:
                engine.check_integrity()
            except AssertionError as e:
                report.update(ok=False, error=str(e) or "integrity check failed")
            return report

        return await _engine_call(state, check)

    @app.get("/v1/models", response_model=None,
             responses=schemas.responses(schemas.ModelList))
    async def models() -> dict:
        state.ready()
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "kvserve",
            "root": str(state.engine_args.model or DEFAULT_MODEL),
            "max_model_len": state.max_model_len}]}

    @app.post("/tokenize", response_model=None,
              responses=schemas.responses(schemas.Tokenized))
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        tok = state.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            ids = _encode_chat(state.processor, body.messages, body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize", response_model=None,
              responses=schemas.responses(schemas.Detokenized))
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        vocab = state.llm_engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # ------------------------------------------------------------------- completions

    @app.post("/v1/completions", response_model=None,
              responses=schemas.responses(schemas.Completion))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        state.check_model(body.model)
        engine = state.ready()
        _check_stream_options(body.stream, body.stream_options)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 returns only the echoed prompt: it needs "
                           "echo: true", "max_tokens")
        echo_logprobs = body.echo and body.logprobs is not None
        prompt_lps = body.prompt_logprobs
        if echo_logprobs:  # the prompt's logprobs head the choice's logprobs
            prompt_lps = max(prompt_lps or 0, body.logprobs or 0)
        prompts = _prompt_lists(body.prompt)
        args.limits.check(body)
        args.limits.check_prompts(len(prompts), "prompt")
        _check_prompt_tokens(state, prompts, "prompt")
        spec, spec_field = body.structured()
        # max_tokens 0 runs the prompt with one sampled token that is never shown.
        params = _params(body, 1 if body.max_tokens == 0 else body.max_tokens, body.logprobs,
                         spec, prompt_lps)
        rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        log.debug("request %s user %s", rid, body.user)
        fmt = Formatter(state.tokenizer, rid, state.model_name, body.n,
                        body.return_tokens_as_token_ids, echo_logprobs, body.max_tokens == 0,
                        body.prompt_logprobs is not None)
        streams = await _add(engine, rid, prompts, params, body.cache_salt, body.stream,
                             spec_field)
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in prompts]
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(_completion_stream(
                fmt, streams, echo, bool(opts and opts.include_usage),
                bool(opts and opts.continuous_usage_stats)), media_type="text/event-stream")
        try:
            outs = await _collect(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        _raise_failed(outs)
        return JSONResponse(fmt.completion(outs, echo))

    # -------------------------------------------------------------------- embeddings

    @app.post("/v1/embeddings", responses=schemas.responses(schemas.EmbeddingList))
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        state.check_model(body.model)
        engine = state.ready()
        hidden = state.llm_engine.model_config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"dimensions {body.dimensions} is not supported: this model's "
                           f"embeddings have {hidden}", "dimensions")
        inputs = _prompt_lists(body.input, "input")
        args.limits.check_prompts(len(inputs), "input")
        _check_prompt_tokens(state, inputs, "input")
        try:
            params = SamplingParams(max_tokens=1, pooling=args.pooling,
                                    truncate_prompt_tokens=body.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        rid = f"embd-{uuid.uuid4().hex}"
        streams = await _add(engine, rid, inputs, params, None, False)
        try:
            outs = await _collect(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        _raise_failed(outs)
        data = []
        for i, out in enumerate(outs):
            vec = out.embedding or []
            emb: list[float] | str = vec
            if body.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    # -------------------------------------------------------------------------- chat

    @app.post("/v1/chat/completions", response_model=None,
              responses=schemas.responses(schemas.ChatCompletion))
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        state.check_model(body.model)
        engine = state.ready()
        _check_stream_options(body.stream, body.stream_options)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        tok = state.tokenizer
        args.limits.check(body)
        spec, spec_field = body.structured()
        auto = args.tool_call_parser if args.enable_auto_tool_choice else None
        plan = plan_chat(body, spec, spec_field, auto, args.reasoning_parser)
        ids = _encode_chat(state.processor, body.messages, body.add_generation_prompt,
                           plan.tools, body.chat_template_kwargs, body.continue_final_message)
        args.limits.check_prompt_tokens(len(ids), "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        params = _params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                         plan.constraint, body.prompt_logprobs)
        rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        log.debug("request %s user %s", rid, body.user)
        fmt = Formatter(tok, rid, state.model_name, body.n, body.return_tokens_as_token_ids,
                        prompt_logprobs=body.prompt_logprobs is not None)
        last = body.messages[-1]
        plan.echo = last.text() if body.echo and last.role == "assistant" else ""
        (stream,) = await _add(engine, rid, [ids], params, body.cache_salt, body.stream,
                               plan.constraint_field)
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(_chat_stream(
                fmt, stream, bool(opts and opts.include_usage), plan,
                bool(opts and opts.continuous_usage_stats)), media_type="text/event-stream")
        try:
            (out,) = await _collect([stream], raw)
        except ClientGone:
            return Response(status_code=499)
        _raise_failed([out])
        return JSONResponse(fmt.chat(out, plan))

    return app


def _check_stream_options(stream: bool, options) -> None:
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       "stream_options")


def _params(body, max_tokens: int | None, logprobs: int | None, structured=None,
            prompt_logprobs: int | None = None):
    try:
        return body.sampling_params(max_tokens, logprobs, structured, prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from e


def _encode_chat(processor: OutputProcessor, messages, add_generation_prompt: bool,
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


def _merged(deltas: list[dict]) -> dict:
    """One chat delta from a parser's pieces (tool-call pieces kept in order)."""
    out: dict = {}
    for d in deltas:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


def _new_logprobs(c) -> list | None:
    if c.logprobs is None:
        return None
    n = len(c.delta_token_ids)
    return c.logprobs[len(c.logprobs) - n:] if n else []


async def _completion_stream(fmt: Formatter, streams: list[RequestStream],
                             echo: list[str] | None, include_usage: bool,
                             continuous_usage: bool = False) -> AsyncIterator[str]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    offsets: dict[int, int] = {}
    closed: set[int] = set()
    try:
        async for i, out in _merge(streams):
            if out.error:
                yield sse(error_body(*_failure(out.error)))
                break
            for c in out.outputs:
                idx = fmt.index(i, c)
                if idx in closed:
                    continue
                text = "" if fmt.prompt_only else c.delta_text
                if idx not in offsets and echo is not None:
                    text = echo[i] + text
                if not text and not c.delta_token_ids and not c.finished:
                    continue
                offset = offsets.get(idx, 0)
                chunk = fmt.completion_chunk(i, c, text, _new_logprobs(c), offset,
                                             out if idx not in offsets else None)
                if continuous_usage:
                    chunk["usage"] = usage([out], fmt.prompt_only)
                yield sse(chunk)
                offsets[idx] = offset + len(text)
                if c.finished:
                    closed.add(idx)
            if out.finished:
                finals[i] = out
        else:
            if include_usage:
                yield sse(fmt.usage_chunk(finals, "text_completion"))  # type: ignore[arg-type]
    except EngineDeadError as e:
        yield sse(error_body(503, str(e)))
    finally:
        _close(streams)
    yield sse("[DONE]")


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
                yield sse(error_body(*_failure(out.error)))
                break
            for c in out.outputs:
                if c.index in closed:
                    continue
                if not c.delta_text and not c.delta_token_ids and not c.finished:
                    continue
                cs = choices[c.index]
                delta = _merged(cs.feed(c.delta_text, c.finished))
                logprobs = _new_logprobs(c)
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
