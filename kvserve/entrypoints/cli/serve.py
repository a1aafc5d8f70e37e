"""`kvserve serve`, `kvserve ray` and `kvserve trace`: the server, its replicas on Ray Serve
(prefix-aware routing included), and one request's timeline read back from a server."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from kvserve.entrypoints.cli.common import add_engine_args, engine_args_from, ensure_default_model
from kvserve.entrypoints.ray_serve.args import ReplicaArgs, require_ray

log = logging.getLogger("kvserve")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None,
                   help="model, as an alternative to --model")
    from kvserve.entrypoints.server.args import ServerArgs

    ServerArgs.add_cli_args(s)
    ReplicaArgs.add_cli_args(s, only=["data_parallel_size"])
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    ra = sub.add_parser("ray", help="kvserve replicas on Ray Serve: a fixed count or "
                                    "autoscaled, on a local Ray instance or $RAY_ADDRESS's "
                                    "cluster (pip install kvserve[ray])")
    ra.add_argument("model_tag", nargs="?", default=None,
                    help="model, as an alternative to --model")
    ServerArgs.add_cli_args(ra)
    ReplicaArgs.add_cli_args(ra)
    add_engine_args(ra)
    ra.set_defaults(func=cmd_ray)

    tr = sub.add_parser("trace", help="one request's timeline from a server, as text and a "
                                      "waterfall PNG")
    tr.add_argument("request_id", help="the id in the API response")
    tr.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    tr.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    tr.add_argument("--output", default="trace.png", help="PNG to write")
    tr.set_defaults(func=cmd_trace)


def server_args_from(args: argparse.Namespace):
    """`serve`'s server settings from its flags, by field name (ServerArgs.from_cli_args)."""
    from kvserve.entrypoints.server.args import ServerArgs

    return ServerArgs.from_cli_args(args)


def absorb_sigterm_reraise() -> None:
    """uvicorn re-raises the signal it handled once its graceful shutdown is done. By then
    SIGTERM's work is complete, so that re-raise lands on a no-op: the caller's own clean-up
    runs and the process exits 0 (the default action would kill it on the spot)."""
    signal.signal(signal.SIGTERM, lambda *_: None)


def cmd_serve(args: argparse.Namespace) -> int:
    if ReplicaArgs.from_cli_args(args).on_ray:  # --data-parallel-size N > 1
        return cmd_ray(args)
    engine_args = engine_args_from(args)  # first: it starts the prefault before torch loads
    import uvicorn

    from kvserve.engine.startup import create_config
    from kvserve.entrypoints.server.app import build_app
    from kvserve.entrypoints.server.connections import server_config

    create_config(engine_args)  # every engine setting checked before listening, not after
    server_args = checked_server_args(args)
    failed: list[BaseException] = []

    def on_fatal(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = build_app(engine_args, server_args, on_fatal)
    config = server_config(app, server_args.host, server_args.port, server_args.connections,
                           log_level="info", access_log=server_args.access_log,
                           timeout_graceful_shutdown=int(server_args.shutdown_timeout))
    server = uvicorn.Server(config)
    log.info("listening on http://%s:%d (OpenAI API under /v1; /health is 503 until the "
             "model has loaded)", server_args.host, server_args.port)
    absorb_sigterm_reraise()
    server.run()
    if failed:
        print(f"kvserve: error: model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def checked_server_args(args: argparse.Namespace):
    """The server's settings, checked together and reported (those not at their defaults)."""
    from kvserve.settings import non_defaults

    server_args = server_args_from(args)
    if server_args.enable_auto_tool_choice and server_args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    asked = non_defaults(server_args)
    log.info("server settings (those not at their defaults): %s",
             ", ".join(f"{k}={v}" for k, v in asked.items()) or "none")
    return server_args


def cmd_ray(args: argparse.Namespace) -> int:
    """The same engine and server on Ray Serve replicas (kvserve.entrypoints.ray_serve),
    behind Ray's HTTP proxy on --host/--port, until SIGINT or SIGTERM."""
    replicas = ReplicaArgs.from_cli_args(args)
    require_ray()  # before the model's install or load: a missing extra is said first
    ensure_default_model(args)
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.startup import create_config

    engine_args = EngineArgs.from_cli_args(args)  # no prefault: the replicas load the model
    replicas.check_engine(engine_args)
    create_config(engine_args)  # every engine setting checked before Ray starts
    server_args = checked_server_args(args)
    from kvserve.entrypoints.ray_serve.deployment import serve_forever

    return serve_forever(engine_args, server_args, replicas)


def cmd_trace(args: argparse.Namespace) -> int:
    """Fetch one request's timeline from a server, print it and draw its waterfall."""
    import httpx

    url = f"{args.url.rstrip('/')}/v1/requests/{args.request_id}/timeline"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except Exception:
            message = resp.text[:200]
        raise ValueError(f"{url}: HTTP {resp.status_code}: {message}")
    timeline = resp.json()
    for sample in timeline["samples"]:
        print(f"sample {sample['index']} ({sample['status']}, {sample['output_tokens']} tokens)")
        for e in sample["events"]:
            extra = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event"))
            print(f"  {1e3 * e['t']:10.2f} ms  {e['event']:12s} {extra}")
    print("breakdown: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in timeline["breakdown"].items()))
    from kvserve.bench.plots import plot_timeline

    print(f"waterfall written to {plot_timeline(timeline, args.output)}")
    return 0
