"""KVServeIngress: the Ray Serve application's HTTP ingress, a thin forwarding layer in front
of the KVServeDeployment replicas, so that Ray's request router sees each request's prompt.

Why a forwarding layer, not the FastAPI app's routes: the route table, its validation,
errors, auth, limits and OpenAPI document stay the replica's (`build_app`), with nothing
restated here that could drift from it; the ingress only reads a body far enough to key it.
And why an ingress at all: through Ray's HTTP proxy a replica's router is handed the ASGI
scope only, the body unread, so a router on the replicas themselves cannot see the prompt.
Ray Serve LLM splits its ingress from its model deployment for the same reason.

Each request (any method and path) is read whole, keyed and sent on with
`handle.forward.remote(ForwardedRequest)` as a stream:
- POSTs to the prompt routes carry their route key, the prompt's chained block hashes as the
  replica's prefix cache computes them (route_key.py: the model's tokenizer and chat
  template, loaded here without the model, and the request's cache_salt), which
  KVServeRequestRouter ranks the replicas by;
- a Responses request with `previous_response_id`, and GET/DELETE /v1/responses/{id}, carry a
  pin: the replica that made that response, remembered here (response id -> Ray Serve
  replica id, from the first bytes of each answer and its `x-kvserve-replica` header; LRU,
  RESPONSE_OWNERS ids). An id made by no replica behind this ingress is a 404 here for
  GET/DELETE, and the replica's own 400 for previous_response_id, as `kvserve serve` says.
The replica yields its response's status and headers, then the body as its app sends it:
streams pass through unchanged, errors keep their status and body. A replica that fails
before answering is a 503 in the API's error shape; one that fails mid-stream ends it.

What belongs to every replica is asked of each (GET, the request's own headers, so each
replica checks its auth) and answered as one:
- /metrics: every replica's metrics on one page, each sample labelled with its `replica`
  (metrics_text.merge), so one scrape target sees them all;
- /v1/engine/replicas: the live replicas' ids;
- /v1/engine/stats and /v1/engine/history: the replicas' figures summed (aggregate.py), or
  one replica's with `?replica=ID` (as any /v1/engine/ route: an unknown id is a 404);
- /v1/requests/{id}/timeline: from the replica that served the request.
A replica that stops answering mid-stream ends the stream with an error event in the
route's format (the openai and anthropic clients raise it), not silently.

One ingress replica holds the routing table and the response owners (num_replicas 1, no CPU
reserved: it reads and tokenizes, the replicas compute). More ingress replicas would each
learn a table of their own and forget each other's response ids."""

# no `from __future__ import annotations`: Ray's class-based FastAPI view reads the route's
# annotations as objects, and a string "Request" would make `request` a query parameter
import asyncio
import dataclasses
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.ray_serve import request_router
from kvserve.entrypoints.ray_serve.aggregate import sum_histories, sum_stats
from kvserve.entrypoints.ray_serve.forwarding import ForwardedRequest, ResponseStart
from kvserve.entrypoints.ray_serve.route_key import PROMPT_ROUTES, route_key
from kvserve.entrypoints.server.errors import ANTHROPIC_PATHS, error_body_for, error_response
from kvserve.entrypoints.server.metrics_text import merge
from kvserve.models.paths import resolve_model
from kvserve.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvserve.entrypoints.ray_serve")

REPLICA_HEADER = "x-kvserve-replica"
# Response ids remembered with their replica (LRU): as many as 10 replicas' default
# --responses-store-size, beyond which the replicas have forgotten them too.
RESPONSE_OWNERS = 10_000
# The first bytes of a /v1/responses answer hold its id, whole or streamed (response.created).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_SNIFF_BYTES = 4096
_STORED = re.compile(r"^/v1/responses/([^/]+)$")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
# GET routes answered from every replica's answer (see the module's docstring)
_EVERY_REPLICA = ("/metrics", "/v1/engine/replicas", "/v1/engine/stats", "/v1/engine/history")
_TIMELINE = re.compile(r"^/v1/requests/[^/]+/timeline$")


def stream_error(path: str, message: str) -> bytes:
    """The server-sent event that ends a stream whose replica failed mid-answer: the 503
    body of the route's API (errors.error_body_for, as a replica's own failing stream sends
    it), as a data event, or Anthropic's `event: error` on its routes."""
    event = "event: error\n" if path.startswith(ANTHROPIC_PATHS) else ""
    return f"{event}data: {json.dumps(error_body_for(path, 503, message))}\n\n".encode()


class ResponseOwners:
    """response id -> the replica that made it, the newest RESPONSE_OWNERS."""

    def __init__(self, capacity: int = RESPONSE_OWNERS) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, replica: str) -> None:
        self._owners[response_id] = replica
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


app = FastAPI(title="kvserve on Ray Serve", openapi_url=None, docs_url=None, redoc_url=None)


@serve.deployment(name="KVServeIngress", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class KVServeIngress:
    def __init__(self, model: DeploymentHandle, engine_args: EngineArgs) -> None:
        self.model = model.options(stream=True)
        self.tokenizer = Tokenizer.load(resolve_model(engine_args.model))
        self.block_size = engine_args.block_size
        self.owners = ResponseOwners()

    async def replica_ids(self, request: Request) -> list[str]:
        """The live replicas, as the handle's router knows them. Ray builds that router on
        the handle's first request: before it, one request to any replica starts it."""
        ids = request_router.live_replicas()
        if not ids:
            await self.fetch(ForwardedRequest("GET", "/health", b"",
                                              tuple(request.scope["headers"])))
            for _ in range(50):
                if ids := request_router.live_replicas():
                    break
                await asyncio.sleep(0.02)
        return ids

    async def fetch(self, forwarded: ForwardedRequest) -> tuple[ResponseStart, bytes]:
        """One whole (not streamed) answer of a replica."""
        stream = self.model.forward.remote(forwarded)
        start = await stream.__anext__()
        assert isinstance(start, ResponseStart), start
        return start, b"".join([piece async for piece in stream])

    async def each_replica(self, request: Request, path: str
                           ) -> dict[str, tuple[ResponseStart, bytes]]:
        """This GET's answer from every live replica, by replica id (one that went away
        meanwhile is left out)."""
        base = ForwardedRequest("GET", path, request.scope.get("query_string", b""),
                                tuple(request.scope["headers"]))
        ids = await self.replica_ids(request)
        # one replica after another: asked at once (asyncio.gather), one of two pinned
        # requests never got an answer in one of three test runs with the pinned Ray
        answers: list[tuple[ResponseStart, bytes] | BaseException] = []
        for rid in ids:
            try:
                answers.append(await self.fetch(dataclasses.replace(base, pin=rid)))
            except Exception as e:  # noqa: BLE001 - a replica that left meanwhile
                answers.append(e)
        out: dict[str, tuple[ResponseStart, bytes]] = {}
        for answer in answers:
            if isinstance(answer, BaseException):
                log.warning("GET %s: a replica did not answer: %s", path, answer)
                continue
            replica = answer[0].header(REPLICA_HEADER)
            # a pin to a replica that left is routed elsewhere: keep one answer a replica
            if replica is not None and replica not in out:
                out[replica] = answer
        return out

    async def from_every_replica(self, request: Request, path: str) -> Response:
        """A route that belongs to every replica, answered as one (the module's docstring)."""
        answers = await self.each_replica(request, path)
        if not answers:
            return error_response(path, 503, "no replica could answer")
        ok = [body for start, body in answers.values() if start.status == 200]
        if not ok:  # auth, a bad parameter, an unknown request: the first replica's answer
            start, body = next(iter(answers.values()))
            return Response(body, status_code=start.status, headers={
                k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                if k.lower() != b"content-length"})
        if _TIMELINE.match(path) is not None:  # the replica that served it has it
            return Response(ok[0], media_type="application/json")
        if path == "/metrics":
            return Response(merge(ok), media_type=CONTENT_TYPE_LATEST)
        pages = [json.loads(body) for body in ok]
        if path == "/v1/engine/replicas":
            out = {"object": "list", "data": sorted((r for p in pages for r in p["data"]),
                                                    key=lambda r: r["id"])}
        elif path == "/v1/engine/stats":
            out = sum_stats(pages)
        else:
            out = sum_histories(pages)
        return Response(json.dumps(out), media_type="application/json")

    @app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def forward(self, request: Request) -> Response:
        path = request.url.path
        body = await request.body()
        key: tuple[int, ...] = ()
        pin: str | None = None
        stored = _STORED.match(path)
        every = path in _EVERY_REPLICA or _TIMELINE.match(path) is not None
        if request.method == "GET" and (every or path.startswith("/v1/engine/")):
            query = parse_qs(request.scope.get("query_string", b"").decode("latin-1"))
            if "replica" not in query:
                if every:
                    return await self.from_every_replica(request, path)
            else:
                pin = query["replica"][-1]
                if pin not in await self.replica_ids(request):
                    return error_response(path, 404, f"no live replica {pin!r}: "
                                          "GET /v1/engine/replicas lists them", "replica")
        elif stored is not None and request.method in ("GET", "DELETE"):
            pin = self.owners.owner(stored.group(1))
            if pin is None:
                return error_response(path, 404, f"response {stored.group(1)!r} not found: "
                                      "no replica behind this server made it, or it is "
                                      "older than the last it remembers", "response_id")
        elif request.method == "POST" and path in PROMPT_ROUTES:
            try:
                parsed = json.loads(body or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError):
                parsed = None  # the replica answers it with its own 400
            if isinstance(parsed, dict):
                previous = parsed.get("previous_response_id")
                if path == "/v1/responses" and isinstance(previous, str):
                    pin = self.owners.owner(previous)
                else:
                    key = await asyncio.to_thread(route_key, self.tokenizer, self.block_size,
                                                  path, parsed)
        forwarded = ForwardedRequest(
            request.method, path, request.scope.get("query_string", b""),
            tuple(request.scope["headers"]), body, key, pin)
        stream = self.model.forward.remote(forwarded)
        try:
            start = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - any Ray failure before an answer
            log.warning("%s %s: no replica answered: %s", request.method, path, e)
            return error_response(path, 503, f"no replica could answer: {type(e).__name__}")
        assert isinstance(start, ResponseStart), start
        replica = start.header(REPLICA_HEADER)
        remember = replica is not None and start.status == 200 and \
            path == "/v1/responses" and request.method == "POST"
        if stored is not None and request.method == "DELETE" and start.status == 200:
            self.owners.forget(stored.group(1))

        streamed = (start.header("content-type") or "").startswith("text/event-stream")

        async def body_pieces() -> AsyncIterator[bytes]:
            head, looking, done = b"", remember, False
            try:
                async for piece in stream:
                    if looking:
                        head += piece
                        if (m := _RESPONSE_ID.search(head)) is not None:
                            self.owners.remember(m.group(1).decode(), replica)
                        looking = m is None and len(head) < _SNIFF_BYTES
                    yield piece
                done = True
            except Exception as e:  # noqa: BLE001 - the replica failed mid-answer
                log.warning("%s %s: replica %s failed mid-response: %s", request.method, path,
                            replica, e)
                if streamed:
                    yield stream_error(path, f"replica {replica} failed mid-response: "
                                       f"{type(e).__name__}; the request was not finished")
            finally:
                if not done:  # the client went away: the replica's app sees it go
                    stream.cancel()

        response = StreamingResponse(body_pieces(), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response
