"""The server's own routes: health (liveness) and readiness, version, Prometheus metrics, the
web UI and what the dashboard and the tools read of the engine (stats, history, steps,
timelines, integrity)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvserve
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.server.errors import APIError
from kvserve.entrypoints.server.metrics_text import exposition
from kvserve.entrypoints.server.serving import (
    State,
    engine_call,
)

router = APIRouter()

_WEB_UI = Path(__file__).parent / "static" / "index.html"  # chat playground + dashboard


@router.get("/health")
async def health(state: State) -> Response:
    reason = state.ready().health_error()
    if reason is not None:
        raise APIError(503, reason)
    return Response(status_code=200)

@router.get("/ready")
async def ready(state: State) -> Response:
    """Readiness, for a load balancer or Kubernetes' readiness probe (/health is liveness):
    200 only when a request sent now would be taken. Otherwise 503, the reason in the error
    body: while the model loads (or after it failed to), when the engine cannot serve (what
    /health says), once the server's shutdown has begun, and while --max-waiting-requests are
    waiting (a request now would get a 429; from the engine's last snapshot, at most a step
    old).

    Two more refusals are not this route's: after SIGTERM uvicorn closes the listening socket
    first, so a probe is refused a connection while in-flight requests drain (this route's
    503 covers the app's shutdown after that); and beyond --max-connections the probe's own
    connection gets the connection cap's 429 (connections.py answers only /health there).
    Both fail a probe, as a server that cannot take a request should."""
    engine = state.ready()  # 503 while loading, or after the load failed
    if state.stopping:
        raise APIError(503, "the server is shutting down")
    reason = engine.health_error()
    if reason is not None:
        raise APIError(503, reason)
    limit = engine.max_waiting_requests
    if limit is not None and engine.num_waiting >= limit:
        raise APIError(503, f"{engine.num_waiting} requests are waiting, this server's limit "
                       "(--max-waiting-requests)")
    return Response(status_code=200)

@router.get("/version")
async def version() -> dict:
    return {"version": kvserve.__version__}

@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(exposition(state.registry, state.replica), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/engine/replicas")
async def engine_replicas(state: State) -> dict:
    """The replicas behind this address, each by the id its metrics' `replica` label and the
    dashboard's `replica` parameter use: this server alone (the Ray Serve ingress answers
    with every live replica)."""
    return {"object": "list", "data": [{"id": state.replica}]}

@router.get("/v1/requests/{request_id}/timeline")
async def request_timeline(state: State, request_id: str) -> dict:
    timeline = await engine_call(state, lambda e: e.request_timeline(request_id))
    if timeline is None:
        raise APIError(404, f"no timeline for request {request_id!r}: unknown, or older "
                       f"than the last {state.engine_args.timeline_buffer_size} finished "
                       "requests", "request_id")
    return timeline

@router.get("/v1/engine/stats")
async def engine_stats(state: State) -> dict:
    """Everything the dashboard shows, in one poll."""
    out = await engine_call(state, lambda e: e.dashboard_state())
    out.update(state.metrics.dashboard())
    out["model"] = state.model_name
    return out

@router.get("/v1/engine/history")
async def engine_history(state: State, seconds: float | None = None) -> dict:
    """The dashboard's samples of the last `seconds` (up to 10 minutes), oldest first."""
    return state.recorder.history.as_json(seconds)

@router.get("/", include_in_schema=False)
async def web_ui() -> Response:
    return HTMLResponse(_WEB_UI.read_text(encoding="utf-8"))

@router.get("/v1/engine/steps")
async def engine_steps(state: State, limit: int = 100) -> dict:
    if limit < 1:
        raise APIError(400, "limit must be >= 1", "limit")
    stats = state.ready().stats
    steps = stats.steps[-limit:] if stats is not None else ()
    return {"object": "list", "data": [s.as_json() for s in steps]}

@router.get("/v1/engine/integrity")
async def engine_integrity(state: State) -> dict:
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

    return await engine_call(state, check)
