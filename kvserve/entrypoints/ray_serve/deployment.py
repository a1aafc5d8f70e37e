"""KVServeDeployment: one kvserve engine per Ray Serve replica, serving the same OpenAI,
Responses and Anthropic routes as `kvserve serve`, behind KVServeIngress (ingress.py).

Each replica builds kvserve's own FastAPI app (`build_app`) and runs its lifespan (model
load, engine stop) and every request through it: `forward` takes the ForwardedRequest the
ingress sends through its DeploymentHandle and yields the app's response as it is sent
(forwarding.run_asgi). So:
- one route table: every route, its validation, errors, auth and OpenAPI document is the
  plain server's, with nothing restated in the ingress that could drift from it;
- streams pass through unchanged: the app's SSE body goes back piece by piece;
- each replica holds its own engine and server state (metrics, the Responses store).
Ray's HTTP proxy hands requests to the ingress, not to these replicas: the ingress reads the
body and keys it by its prompt's block hashes, which the replicas' request router
(KVServeRequestRouter, request_router.py) ranks them by; through the proxy a replica's router
would see no body. That costs one more hop per request (proxy -> ingress -> replica).

A replica is ready once its model has loaded: the lifespan's start waits for the load, so Ray
routes nothing to a loading replica, and a model that fails to load fails the replica's start
with the load's error. After that `check_health` is the engine's health (what /health
answers), and Ray restarts a replica that fails it. A stopping replica (downscale, delete,
redeploy) takes no new requests and Ray waits up to `graceful_shutdown_timeout_s`
(--shutdown-timeout, as after SIGTERM) for those in flight, streams included, before the
lifespan stops the engine.

Not the plain server's: the connection guards (GuardedH11: header, read and write timeouts,
--max-connections) belong to the process that holds the sockets, here Ray's proxy, which
does not apply them. Each response names its replica in an `x-kvserve-replica` header, which
the ingress also reads to pin stored responses to their replica, and its metrics carry the
same id as their `replica` label.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import torch
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.lifespan.on import LifespanOn

from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.ray_serve.args import APP_NAME, ReplicaArgs
from kvserve.entrypoints.ray_serve.forwarding import ForwardedRequest, ResponseStart, run_asgi
from kvserve.entrypoints.ray_serve.ingress import REPLICA_HEADER, KVServeIngress
from kvserve.entrypoints.server.app import build_app
from kvserve.entrypoints.server.args import ServerArgs
from kvserve.entrypoints.server.serving import ServerState

log = logging.getLogger("kvserve.entrypoints.ray_serve")


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that answered it."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()),
                                      (REPLICA_HEADER.encode(), self.replica)]
            await send(message)

        await self.app(scope, receive, send_named)


def _ready_after_load(app: Any, state: ServerState) -> None:
    """Make the app's lifespan start end only once the model has loaded (raising the load's
    error): the plain server listens while it loads and answers 503 meanwhile, but a replica
    must not be handed requests before it can serve them."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any):
        async with inner(a) as value:
            while state.engine is None and state.load_error is None:
                await asyncio.sleep(0.02)
            if state.load_error is not None:
                raise RuntimeError(f"model failed to load: {state.load_error}")
            yield value

    app.router.lifespan_context = lifespan


@serve.deployment(name="KVServeDeployment")
class KVServeDeployment:
    """One replica: kvserve's FastAPI app over its own AsyncEngine, built from the same
    EngineArgs and ServerArgs as `kvserve serve`, with `threads` torch threads. The app's
    lifespan (model load, engine stop) runs from the replica's constructor and destructor,
    with uvicorn's lifespan runner as a server would: Ray allows one `@serve.ingress` per
    application, which is the ingress's."""

    async def __init__(self, engine_args: EngineArgs, server_args: ServerArgs,
                       threads: int) -> None:
        torch.set_num_threads(threads)  # before the engine thread's first parallel op
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # Ray's rank of this replica (0..replicas-1, a replacement takes the rank of the one
        # it replaces): its KV events' rank and endpoints (KVEventsConfig.for_rank)
        rank = context.rank.rank
        engine_args = dataclasses.replace(engine_args, data_parallel_rank=rank)
        app = build_app(engine_args, server_args)
        self.state: ServerState = app.state.kvserve
        self.state.replica = self.replica_id  # its metrics' `replica` label
        _ready_after_load(app, self.state)
        app.add_middleware(ReplicaHeader, replica=self.replica_id)
        self.app: ASGIApp = app
        self._lifespan = LifespanOn(Config(app, lifespan="on", log_level=None,
                                           log_config=None, access_log=False))
        await self._lifespan.startup()  # returns once the model has loaded
        if self._lifespan.should_exit:
            raise RuntimeError(f"replica {self.replica_id} failed to start: "
                               f"{self.state.load_error or 'see its log'}")
        log.info("replica %s (rank %d): %d torch threads", self.replica_id, rank,
                 torch.get_num_threads())

    async def __del__(self) -> None:
        """Ray calls this once the replica has drained: the lifespan stops the engine."""
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()

    async def forward(self, request: ForwardedRequest
                      ) -> AsyncIterator[ResponseStart | bytes]:
        """One request from the ingress through this replica's app: its status and headers,
        then its body as the app sends it (a stream piece by piece)."""
        async for item in run_asgi(self.app, request, ("ray-serve-ingress", 0)):
            yield item

    async def check_health(self) -> None:
        """Ray's health check: the engine's health, as /health reports it (on the replica's
        event loop, where the app reads it)."""
        state = self.state
        if state.load_error is not None:
            raise RuntimeError(f"model failed to load: {state.load_error}")
        if state.engine is not None and (reason := state.engine.health_error()) is not None:
            raise RuntimeError(reason)


def application(engine_args: EngineArgs, server_args: ServerArgs, replicas: ReplicaArgs,
                ray_actor_options: dict[str, Any] | None = None):
    """The Ray Serve application: KVServeIngress over KVServeDeployment with the options
    `replicas` makes (ReplicaArgs.deployment_options, its request router included);
    `ray_actor_options` adds to both deployments' (a runtime environment, say)."""
    opts = replicas.deployment_options(engine_args, server_args)
    opts["ray_actor_options"] = {**opts["ray_actor_options"], **(ray_actor_options or {})}
    threads = int(opts["ray_actor_options"]["num_cpus"])
    model = KVServeDeployment.options(**opts).bind(engine_args, server_args, threads)
    # Ray's default of 5 requests in flight per replica would hold the ingress, where every
    # request stays until its answer ends, to 5 streams for all replicas together; it may
    # take as many as the replicas can (requests beyond wait in the replicas' router)
    ingress = KVServeIngress.options(
        max_ongoing_requests=replicas.most_replicas * opts["max_ongoing_requests"],
        ray_actor_options={"num_cpus": 0, **(ray_actor_options or {})})
    return ingress.bind(model, engine_args)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def serve_forever(engine_args: EngineArgs, server_args: ServerArgs,
                  replicas: ReplicaArgs) -> int:
    """Deploy the replicas behind Ray's HTTP proxy on --host/--port and serve until SIGINT
    or SIGTERM (to this process: Ray's own processes on a local instance share its process
    group); then delete the application, whose replicas drain, and shut down a Ray instance
    started here. A second signal cuts the drain short."""
    import ray

    address = os.environ.get("RAY_ADDRESS") or None
    # without RAY_ADDRESS a Ray instance of our own ("local"), even where `ray start` left
    # one running, which ray.init() alone would join and the clean-up below would shut down
    ray.init(address=address or "local", include_dashboard=False if address is None else None)
    # after ray.init, whose crash handler would take SIGTERM: as Ctrl-C, so the clean-up
    # below runs
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": server_args.host, "port": server_args.port})
        with suppress(KeyboardInterrupt):  # a signal while the replicas start drains them too
            try:
                serve.run(application(engine_args, server_args, replicas), name=APP_NAME,
                          route_prefix="/")
            except RuntimeError as e:
                log.error("the replicas failed to start: %s", e)
                return 1
            log.info("listening on http://%s:%d through Ray Serve (OpenAI API under /v1): %s",
                     server_args.host, server_args.port,
                     f"{replicas.min_replicas or 1}-{replicas.max_replicas} replicas, "
                     "autoscaled" if replicas.autoscaling
                     else f"{replicas.data_parallel_size} replicas")
            while True:
                time.sleep(3600)
        log.info("stopping: the replicas finish the requests in flight (at most %gs)",
                 server_args.shutdown_timeout)
        serve.delete(APP_NAME)
        return 0
    finally:
        if address is None:
            serve.shutdown()
        ray.shutdown()
