"""OpenAI-compatible HTTP server over the async engine: `build_app` assembles the route table
below with the state, the lifespan, the error mapping and the guards.

The model loads in the background after the server starts listening: /health answers 503
until it is ready."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

import kvserve
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.entrypoints.server import (
    routes_engine,
    routes_models,
    schemas,
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_messages,
    serving_responses,
)
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.entrypoints.server.errors import GuardMiddleware, install_error_handlers
from kvserve.entrypoints.server.serving import ServerState

log = logging.getLogger("kvserve.entrypoints.server")

# The route table: each module holds its routes' handlers, which reach the app's ServerState
# through the `State` dependency (kvserve.entrypoints.server.serving).
ROUTERS: tuple[APIRouter, ...] = (
    routes_engine.router,  # /health, /version, /metrics, /, /v1/engine/*, timelines
    routes_models.router,  # /v1/models, /tokenize, /detokenize
    serving_completions.router,  # /v1/completions
    serving_embeddings.router,  # /v1/embeddings
    serving_chat.router,  # /v1/chat/completions
    serving_responses.router,  # /v1/responses (OpenAI's Responses API)
    serving_messages.router,  # /v1/messages, /v1/messages/count_tokens (Anthropic's API)
)


def build_app(engine_args: EngineArgs, args: ServerArgs,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    state = ServerState(engine_args, args)

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
        if args.enable_auto_tool_choice and args.tool_call_parser == "auto":
            log.info("tool_choice auto: --tool-call-parser auto reads %s from the chat template",
                     state.detected_tool_parser or "no tool-call form")
        log.info("ready: serving %s at http://%s:%d/v1", state.model_name, args.host, args.port)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loader = asyncio.create_task(load())
        state.recorder.start()
        yield
        state.stopping = True  # /ready says so from here on
        await state.recorder.stop()
        loader.cancel()
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)
    app.state.kvserve = state
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app)
    schemas.publish_streams(app)
    app.add_middleware(GuardMiddleware, api_key=args.api_key,
                       max_body_bytes=args.max_request_bytes,
                       metrics_api_key=args.metrics_api_key)
    return app
