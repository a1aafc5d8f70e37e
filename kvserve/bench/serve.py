"""`kvserve bench serve`: load-test an OpenAI-compatible server and report what clients see.

Works against any server that streams `/v1/completions` or `/v1/chat/completions` as server-sent
events (kvserve, vLLM, llama.cpp's llama-server). Everything is measured on the client from the
SSE stream, so the figures include HTTP and serialization time:

  TTFT   send -> first chunk carrying non-empty text
  ITL    gaps between successive chunks carrying text (several tokens in one chunk count once)
  TPOT   (E2E - TTFT) / (output tokens - 1), per request
  E2E    send -> end of the stream

Output tokens come from the final `usage` chunk (requested with stream_options.include_usage);
a server that sends none is assumed to stream one token per content chunk, which is how vLLM,
llama-server and kvserve stream but is only an approximation for servers that batch tokens.
Input tokens likewise come from `usage.prompt_tokens` when sent (so they include BOS and chat
template tokens), else from the dataset's count.

Arrivals follow a gamma process with mean interval 1/rate (burstiness 1 = Poisson), optionally
capped at --max-concurrency requests in flight. A failed request (HTTP error, error event,
exception, timeout, no text) is recorded with its message; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import httpx

from kvserve.bench.client import (
    BenchError,
    Progress,
    ServeBenchConfig,
    auth_headers,
    fetch_model,
    fetch_spec_counters,
    make_client,
    run_load,
    spec_summary,
)
from kvserve.bench.datasets import (
    DATASETS,
    DatasetConfig,
    SampleRequest,
    load_requests,
    load_tokenizer,
)
from kvserve.bench.report import (
    BenchResult,
    config_json,
    format_report,
    parse_goodput,
    rate_str,
    save_result,
    summarize,
)
from kvserve.settings import positive_float


async def benchmark(
    cfg: ServeBenchConfig, requests: Sequence[SampleRequest],
    transport: httpx.AsyncBaseTransport | None = None, model: str | None = None,
) -> BenchResult:
    """Warm up, run the timed load and summarise it. `model` skips the GET /v1/models lookup
    (already done by the caller); `transport` lets tests replace the network."""
    cfg.validate()
    if not requests:
        raise BenchError("no requests to send")
    headers = auth_headers(cfg)
    async with make_client(cfg, transport) as client:
        model = model or await fetch_model(client, cfg)
        assert model is not None
        if cfg.warmup:
            warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
            warm_cfg = replace(cfg, request_rate=math.inf)
            outcome = await run_load(client, warm_cfg, model, warm, headers)
            if not any(r.success for r in outcome.records):
                raise BenchError(f"the warm-up request failed: {outcome.records[0].error} "
                                 f"(POST {cfg.url}, model {model!r})")
        spec_before = await fetch_spec_counters(client, cfg)
        progress = Progress(len(requests), enabled=cfg.progress)
        try:
            outcome = await run_load(client, cfg, model, requests, headers, progress)
        finally:
            progress.close()
        spec = spec_summary(spec_before, await fetch_spec_counters(client, cfg))
    summary = summarize(outcome.records, outcome.duration, cfg.goodput, outcome.peak_concurrency)
    return BenchResult(config=config_json(cfg), model=model, summary=summary,
                       records=outcome.records, spec_decode=spec)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return value


def _goodput_arg(text: str) -> str:
    try:
        parse_goodput([text])
    except BenchError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("invalid --goodput ")) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench serve` to the kvserve command line; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks against a running server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (kvserve, vLLM, llama-server)",
        description="Send streaming requests to an OpenAI-compatible server at a chosen rate and "
                    "report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.")

    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (any path ending in "
                        "chat/completions is sent chat messages)")
    g.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=DATASETS)
    d.add_argument("--num-prompts", type=int, default=None,
                   help="number of prompts (default 64; shared-prefix: groups x prompts-per-group"
                        "; jsonl: the first N lines)")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    d.add_argument("--tokenizer", default=None,
                   help="tokenizer for random prompts: .gguf file, Hugging Face directory or "
                        "model short name (default: kvserve's default model)")
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own input")
    d.add_argument("--shared-prefix-groups", type=int, default=4)
    d.add_argument("--prompts-per-group", type=int, default=16)
    d.add_argument("--system-prompt-len", type=int, default=512)
    d.add_argument("--question-len", type=int, default=64)
    d.add_argument("--output-len", type=int, default=128,
                   help="output tokens for shared-prefix, and for jsonl lines without one")
    d.add_argument("--dataset-path", default=None,
                   help="jsonl: one {\"prompt\": ..., \"output_len\": ...} object per line")

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=positive_float, default=math.inf,
                    help="requests per second (default inf: send all at once)")
    lo.add_argument("--burstiness", type=positive_float, default=1.0,
                    help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    lo.add_argument("--max-concurrency", type=int, default=None,
                    help="most requests in flight (default: unlimited)")
    lo.add_argument("--warmup", type=int, default=1,
                    help="requests sent (and not counted) before the timed run")

    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (a vLLM/llama.cpp "
                        "extension)")
    r.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body")
    r.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds allowed per request, whole stream included")

    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", type=_goodput_arg, default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    o.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG plots there: TTFT and ITL distributions, throughput and "
                        "requests in flight over time, a waterfall of sampled requests")
    o.add_argument("--save-result", default=None, metavar="PATH",
                   help="write config, summary and per-request records as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench_serve)
    from kvserve.bench.soak import add_parser as add_soak_parser

    add_soak_parser(sub)
    return bench


def configs_from(args: argparse.Namespace) -> tuple[ServeBenchConfig, DatasetConfig]:
    cfg = ServeBenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, warmup=args.warmup,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        timeout=args.timeout, goodput=parse_goodput(args.goodput) if args.goodput else {},
        seed=args.seed, progress=not args.no_progress)
    data = DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, tokenizer=args.tokenizer,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        shared_prefix_groups=args.shared_prefix_groups, prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_prompt_len, question_len=args.question_len,
        output_len=args.output_len, dataset_path=args.dataset_path)
    return cfg, data


def cmd_bench_serve(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None,
                    ) -> int:
    """Run the benchmark the parsed arguments describe. Exit code 0, or 1 when every request
    failed; bad input raises BenchError / DatasetError (the CLI turns them into exit code 2)."""
    # httpx logs every request at INFO; thousands of those lines would bury the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, data = configs_from(args)
    cfg.validate()
    data.validate()  # before contacting the server or loading a tokenizer: fail fast

    async def resolve() -> str | None:
        async with make_client(cfg, transport) as client:
            return await fetch_model(client, cfg)

    model = asyncio.run(resolve())
    tokenizer = load_tokenizer(data.tokenizer) if data.needs_tokenizer else None
    requests = load_requests(data, tokenizer)
    print(f"kvserve bench: {len(requests)} {data.name} prompts -> POST {cfg.url} "
          f"(model {model!r}, rate {rate_str(cfg.request_rate)}, "
          f"max concurrency {cfg.max_concurrency or 'unlimited'})", file=sys.stderr)
    result = asyncio.run(benchmark(cfg, requests, transport=transport, model=model))
    result.config["dataset"] = asdict(data)
    print(format_report(result))
    if args.save_result:
        print(f"results written to {save_result(result, args.save_result)}", file=sys.stderr)
    if args.plot:
        from kvserve.bench.plots import plot_bench

        for path in plot_bench(result.records, args.plot):
            print(f"plot written to {path}", file=sys.stderr)
    return 0 if result.summary.completed else 1
