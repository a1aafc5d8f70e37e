"""`kvserve router`: one OpenAI-compatible endpoint (with /v1/responses, and Anthropic's
/v1/messages) in front of N `kvserve serve` replicas.

Each request goes to one healthy replica, chosen by the policy:
- round-robin: in turn;
- least-outstanding: the replica with the fewest requests in flight through this router;
- prefix-aware: the replica that served the longest prefix of this prompt before (so its
  prefix cache most likely holds it), unless that replica has more than `balance_slack`
  requests in flight beyond the least loaded one; then, and for new prefixes, a least
  loaded one (ties split by the prefix's hash). Prompts are keyed by chained hashes of
  fixed-size pieces of their text.

Responses API state lives in the replica that answered: the router remembers which replica
created each response id (read from the first bytes of its answer) and sends a request with
that `previous_response_id`, and GET/DELETE /v1/responses/{id}, there.

Bodies are forwarded unchanged and responses streamed back as they come. A replica that
cannot be reached before any byte was returned is marked unhealthy and the request is sent
to another; one that fails mid-stream ends that stream (the client sees the error, as it
would from the replica). A background loop polls every replica's /health and takes them out
of and back into rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

log = logging.getLogger("kvserve.entrypoints.router")

POLICIES = ("round-robin", "least-outstanding", "prefix-aware")
# Response ids remembered, and where (LRU): as many as 10 replicas' default
# --responses-store-size, beyond which the replicas have forgotten them too.
RESPONSE_OWNERS = 10_000
# The first bytes of a /v1/responses answer hold its id, whole or streamed (response.created).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_SNIFF_BYTES = 4096


@dataclass
class Replica:
    url: str
    healthy: bool = False  # until its first /health answers 200
    outstanding: int = 0  # requests in flight through this router


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "prefix-aware"
    prefix_chunk_chars: int = 256  # piece of prompt text per chained hash
    prefix_entries: int = 100_000  # prefix hashes remembered (LRU)
    balance_slack: int = 4  # prefix-aware: extra in-flight requests tolerated for a hit
    health_interval: float = 2.0  # seconds between /health polls
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica URL")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://: {url!r}")


def prompt_text(body: dict) -> str:
    """The text a request's prefix is judged by: the prompt, or the chat messages."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"{m.get('role')}:{text}")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class Router:
    """Replica choice and bookkeeping (no I/O, so it is tested directly)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = [Replica(u.rstrip("/")) for u in config.replicas]
        self._turn = itertools.count()
        self._prefixes: OrderedDict[bytes, str] = OrderedDict()  # prefix hash -> replica url
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> replica url

    def remember_response(self, response_id: str, replica: Replica) -> None:
        self._responses[response_id] = replica.url
        self._responses.move_to_end(response_id)
        while len(self._responses) > RESPONSE_OWNERS:
            self._responses.popitem(last=False)

    def response_owner(self, response_id: str) -> Replica | None:
        url = self._responses.get(response_id)
        return next((r for r in self.replicas if r.url == url), None)

    def _hashes(self, text: str) -> list[bytes]:
        n = self.config.prefix_chunk_chars
        out, parent = [], b""
        for i in range(0, len(text) - len(text) % n, n):  # full pieces only
            parent = hashlib.blake2b(parent + text[i:i + n].encode(), digest_size=16).digest()
            out.append(parent)
        return out

    def pick(self, body: dict, exclude: set[str] = frozenset()) -> tuple[Replica | None, str]:
        """(replica, why) for a request body; (None, why) when no healthy replica is left.
        A body continuing a stored response goes to the replica that holds it, while it is
        healthy."""
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            return None, "none healthy"
        previous = body.get("previous_response_id")
        owner = self.response_owner(previous) if isinstance(previous, str) else None
        if owner is not None and any(r is owner for r in live):
            return owner, "response owner"
        policy = self.config.policy
        if policy == "round-robin":
            return live[next(self._turn) % len(live)], "turn"
        least = min(live, key=lambda r: r.outstanding)
        if policy == "least-outstanding":
            return least, "least"
        hashes = self._hashes(prompt_text(body))
        # A new prefix goes to a least-loaded replica; ties are split by the prefix's hash
        # (or in turn, for prompts shorter than one piece), so new prefixes spread out.
        tied = [r for r in live if r.outstanding == least.outstanding]
        spread = int.from_bytes(hashes[0][:8], "little") if hashes else next(self._turn)
        chosen, why = tied[spread % len(tied)], "new prefix"
        for h in reversed(hashes):
            url = self._prefixes.get(h)
            if url is None:
                continue
            owner = next((r for r in live if r.url == url), None)
            if owner is None:
                why = "prefix owner down"
            elif owner.outstanding > least.outstanding + self.config.balance_slack:
                why = "prefix owner busy"
            else:
                chosen, why = owner, "prefix hit"
            break
        for h in hashes:
            self._prefixes[h] = chosen.url
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.config.prefix_entries:
            self._prefixes.popitem(last=False)
        return chosen, why


@dataclass
class _Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvserve_router:requests", "Requests sent, by replica and "
                                "status", ["replica", "status"], registry=r)
        self.decisions = Counter("kvserve_router:routing_decisions", "Replica choices, by "
                                 "policy and reason", ["policy", "reason"], registry=r)
        self.latency = Histogram("kvserve_router:request_seconds", "Time from receiving a "
                                 "request to the end of its response, by replica", ["replica"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=r)
        self.healthy = Gauge("kvserve_router:replica_healthy", "1 when the replica is in "
                             "rotation", ["replica"], registry=r)
        self.outstanding = Gauge("kvserve_router:replica_outstanding", "Requests in flight",
                                 ["replica"], registry=r)
        self.failovers = Counter("kvserve_router:failovers", "Requests re-sent to another "
                                 "replica after one could not be reached", registry=r)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error"
                                   if status >= 500 else "invalid_request_error",
                                   "param": None, "code": status}}, status_code=status)


class RouterState:
    """What the router's routes share: the replicas and their policy, the metrics and the
    client that forwards to the replicas."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.router = Router(config)
        self.metrics = _Metrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout, connect=5.0))

    async def check(self, replica: Replica) -> None:
        """Poll one replica's /health and take it out of, or back into, rotation."""
        try:
            ok = (await self.client.get(f"{replica.url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != replica.healthy:
            log.warning("replica %s is %s", replica.url, "back" if ok else "unhealthy")
        replica.healthy = ok
        self.metrics.healthy.labels(replica.url).set(int(ok))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.router.replicas))

    async def health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_interval)

    async def _send(self, body: dict, raw: bytes, path: str, headers: dict[str, str],
                    method: str = "POST", only: Replica | None = None
                    ) -> tuple[Replica, httpx.Response] | None:
        """The request sent to the replica the policy picks (or to `only`), another one each
        time one cannot be reached; None when no healthy replica is left."""
        tried: set[str] = set()
        metrics = self.metrics
        while True:
            if only is not None:
                replica, why = (only, "response owner") if only.url not in tried else \
                    (None, "response owner down")
            else:
                replica, why = self.router.pick(body, tried)
            metrics.decisions.labels(self.config.policy, why).inc()
            if replica is None:
                return None
            try:
                upstream = await self.client.send(
                    self.client.build_request(method, replica.url + path, content=raw,
                                              headers=headers), stream=True)
            except httpx.TransportError as e:
                log.warning("replica %s unreachable (%s); trying another", replica.url, e)
                replica.healthy = False
                metrics.healthy.labels(replica.url).set(0)
                metrics.failovers.inc()
                tried.add(replica.url)
                continue
            return replica, upstream

    async def forward(self, request: Request, path: str, only: Replica | None = None
                      ) -> Response:
        """`request` sent on to a replica (`only`, when given), its response streamed back
        unchanged. The new id of a /v1/responses answer is remembered with its replica."""
        raw = await request.body()
        body: dict = {}
        if request.method == "POST":
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return _error(400, "request body is not valid JSON")
            if not isinstance(body, dict):
                return _error(400, "request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "x-api-key", "content-type", "accept")}
        t0 = time.perf_counter()
        sent = await self._send(body, raw, path, headers, request.method, only)
        if sent is None:
            return _error(503, "no healthy replica")
        replica, upstream = sent
        metrics = self.metrics
        replica.outstanding += 1
        metrics.outstanding.labels(replica.url).set(replica.outstanding)
        metrics.requests.labels(replica.url, str(upstream.status_code)).inc()
        sniff = path == "/v1/responses" and request.method == "POST" and \
            upstream.status_code == 200

        async def passthrough() -> AsyncIterator[bytes]:
            head, looking = b"", sniff
            try:
                async for chunk in upstream.aiter_raw():
                    if looking:
                        head += chunk
                        if (m := _RESPONSE_ID.search(head)) is not None:
                            self.router.remember_response(m.group(1).decode(), replica)
                        looking = m is None and len(head) < _SNIFF_BYTES
                    yield chunk
            except httpx.HTTPError as e:
                log.warning("replica %s failed mid-response: %s", replica.url, e)
            finally:
                await upstream.aclose()
                replica.outstanding -= 1
                metrics.outstanding.labels(replica.url).set(replica.outstanding)
                metrics.latency.labels(replica.url).observe(time.perf_counter() - t0)

        keep = {k: v for k, v in upstream.headers.items()
                if k.lower() in ("content-type", "retry-after", "x-request-id")}
        return StreamingResponse(passthrough(), status_code=upstream.status_code,
                                 headers=keep)


def _state(request: Request) -> RouterState:
    return request.app.state.kvserve_router


State = Annotated[RouterState, Depends(_state)]
routes = APIRouter()


@routes.post("/v1/completions")
async def completions(request: Request, state: State) -> Response:
    return await state.forward(request, "/v1/completions")


@routes.post("/v1/chat/completions")
async def chat(request: Request, state: State) -> Response:
    return await state.forward(request, "/v1/chat/completions")


@routes.post("/v1/messages")
async def messages(request: Request, state: State) -> Response:
    return await state.forward(request, "/v1/messages")


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, state: State) -> Response:
    return await state.forward(request, "/v1/messages/count_tokens")


@routes.post("/v1/responses")
async def responses(request: Request, state: State) -> Response:
    return await state.forward(request, "/v1/responses")


@routes.get("/v1/responses/{response_id}")
@routes.delete("/v1/responses/{response_id}")
async def stored_response(response_id: str, request: Request, state: State) -> Response:
    """A stored response lives in the replica that made it."""
    owner = state.router.response_owner(response_id)
    if owner is None:
        return _error(404, f"response {response_id!r} not found: no replica behind this "
                      "router made it, or it is older than the router remembers")
    return await state.forward(request, f"/v1/responses/{response_id}", owner)


@routes.get("/v1/models")
async def models(request: Request, state: State) -> Response:
    """The first healthy replica's model list."""
    auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    for r in state.router.replicas:
        if not r.healthy:
            continue
        try:
            resp = await state.client.get(f"{r.url}/v1/models", headers=auth, timeout=10)
        except httpx.HTTPError:
            continue
        return Response(resp.content, status_code=resp.status_code,
                        media_type="application/json")
    return _error(503, "no healthy replica")


@routes.get("/health")
async def health(state: State) -> Response:
    return Response(status_code=200 if any(r.healthy for r in state.router.replicas) else 503)


@routes.get("/router/replicas")
async def replicas(state: State) -> dict:
    return {"policy": state.config.policy, "replicas": [
        {"url": r.url, "healthy": r.healthy, "outstanding": r.outstanding}
        for r in state.router.replicas]}


@routes.get("/metrics")
async def prometheus(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's app: its routes over one RouterState, replicas polled from start-up on."""
    state = RouterState(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.check_all()
        task = asyncio.create_task(state.health_loop())
        yield
        task.cancel()
        await state.client.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.kvserve_router = state
    app.include_router(routes)
    return app
