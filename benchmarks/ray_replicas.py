"""Replicas on Ray Serve against one server (issue 40): does splitting the cores into replicas
pay, does prefix-aware routing keep the prefix cache's hits, and what does Ray's hop cost?

    python benchmarks/ray_replicas.py [--model MODEL] [--rounds 2] [--port 8123]
        [--configs plain,ray-1,ray-2-prefix,ray-2-pow2] [--workloads shared-c16,...]

Servers, one at a time on the same port, each with kvserve's defaults for the model:

  plain          `kvserve serve`: one engine on both cores
  ray-1          `kvserve ray --data-parallel-size 1 --threads-per-replica 2`: the same engine
                 as one Ray Serve replica, behind Ray's proxy and kvserve's ingress
  ray-2-prefix   `kvserve ray -dp 2 --threads-per-replica 1`: two replicas of one core,
                 prefix-aware routing (the default)
  ray-2-pow2     the same with `--request-router power-of-two` (Ray's default policy)

Workloads (`kvserve bench serve`, streamed completions, greedy; each round uses its own seed,
the same for every server, so no server starts a workload with its prompts cached):

  shared-c16     shared-prefix: 16 groups of 4 prompts, a 512-token system prompt each and a
                 64-token question, 64 output tokens, at most 16 in flight
  shared-c32     the same at 32 in flight
  random-c32     64 random prompts of 256 tokens, 64 output tokens, 32 in flight
  c1             8 random prompts of 128 tokens, 64 output tokens, one at a time (Ray's
                 per-request overhead: ray-1 against plain)

Each round starts every server in turn (the order reversed every other round), runs every
workload on it and stops it. Printed: per server and workload, the medians over rounds of
output tok/s, TTFT p50/p99, ITL p50 and the prefix-cache hit rate (the share of prompt tokens
the server reports as cached, usage.prompt_tokens_details.cached_tokens); then the ratios
the issue asks for. With --results-file the table is appended there as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import kvserve_procs

from kvserve.bench.peers import machine

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "plain": ["serve"],
    "ray-1": ["ray", "--data-parallel-size", "1", "--threads-per-replica", "2"],
    "ray-2-prefix": ["ray", "--data-parallel-size", "2", "--threads-per-replica", "1"],
    "ray-2-pow2": ["ray", "--data-parallel-size", "2", "--threads-per-replica", "1",
                   "--request-router", "power-of-two"],
}
WORKLOADS = {
    "shared-c16": ["--dataset", "shared-prefix", "--shared-prefix-groups", "16",
                   "--prompts-per-group", "4", "--system-prompt-len", "512",
                   "--question-len", "64", "--output-len", "64", "--max-concurrency", "16"],
    "shared-c32": ["--dataset", "shared-prefix", "--shared-prefix-groups", "16",
                   "--prompts-per-group", "4", "--system-prompt-len", "512",
                   "--question-len", "64", "--output-len", "64", "--max-concurrency", "32"],
    "random-c32": ["--dataset", "random", "--num-prompts", "64", "--random-input-len", "256",
                   "--random-output-len", "64", "--max-concurrency", "32"],
    "c1": ["--dataset", "random", "--num-prompts", "8", "--random-input-len", "128",
           "--random-output-len", "64", "--max-concurrency", "1"],
}
FIGURES = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "hit_rate")


def bench(url: str, workload: str, seed: int, model: str | None, out: Path) -> dict:
    """One `kvserve bench serve` run; its figures."""
    cmd = [sys.executable, "-m", "kvserve", "bench", "serve", "--base-url", url,
           "--seed", str(seed), "--ignore-eos", "--temperature", "0", "--no-progress",
           "--save-result", str(out), *WORKLOADS[workload]]
    if model:
        cmd += ["--tokenizer", model]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())["summary"]
    if r["failed"]:
        raise RuntimeError(f"{workload}: {r['failed']} requests failed: {r['errors']}")
    return {"output_tok_s": r["output_throughput"], "ttft_p50": r["ttft_ms"]["median"],
            "ttft_p99": r["ttft_ms"]["p99"], "itl_p50": r["itl_ms"]["median"],
            "hit_rate": r["prefix_cache_hit_rate"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: kvserve's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--ray-args", default="",
                   help="more flags for the ray-* servers, e.g. \"--balance-slack 16\"")
    p.add_argument("--results-file", type=Path, default=None,
                   help="markdown file the table is appended to (e.g. docs/results-history.md)")
    args = p.parse_args()
    configs = args.configs.split(",")
    workloads = args.workloads.split(",")
    for name in configs:
        if name not in CONFIGS:
            p.error(f"unknown config {name!r}; one of {', '.join(CONFIGS)}")
    for name in workloads:
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    url = f"http://127.0.0.1:{args.port}"
    model = ["--model", args.model] if args.model else []
    runs: dict[tuple[str, str], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ray_replicas_"))
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name in order:
            log = open(tmp / f"{name}-{rnd}.log", "w")  # noqa: SIM115 - closed below
            extra = args.ray_args.split() if name.startswith("ray") else []
            proc = kvserve_procs.start([*CONFIGS[name], *extra, *model,
                                        "--port", str(args.port)], url, log=log, timeout=600)
            try:
                for w in workloads:
                    seed = 1000 * (rnd + 1) + workloads.index(w)
                    got = bench(url, w, seed, args.model, tmp / f"{name}-{w}-{rnd}.json")
                    runs.setdefault((name, w), []).append(got)
                    print(f"round {rnd} {name:13s} {w:11s} " + " ".join(
                        f"{k} {v:.3f}" if v is not None else f"{k} -"
                        for k, v in got.items()), flush=True)
            finally:
                kvserve_procs.stop(proc)
                log.close()

    def med(name: str, w: str, key: str) -> float | None:
        values = [r[key] for r in runs.get((name, w), []) if r[key] is not None]
        return statistics.median(values) if values else None

    lines = [f"`python benchmarks/ray_replicas.py --rounds {args.rounds}"
             + (f" --model {args.model}" if args.model else "")
             + (f" --ray-args '{args.ray_args}'" if args.ray_args else "")
             + (f" --configs {args.configs}" if args.configs != ",".join(CONFIGS) else "")
             + (f" --workloads {args.workloads}" if args.workloads != ",".join(WORKLOADS)
                else "") + f"` on {machine()}, "
             f"{datetime.now():%Y-%m-%d %H:%M}; medians over {args.rounds} rounds:", "",
             "| workload | server | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| prefix hit rate |", "|---|---|---|---|---|---|---|"]
    for w in workloads:
        for name in configs:
            v = [med(name, w, k) for k in FIGURES]
            cells = [f"{x:.1f}" if x is not None else "-" for x in v[:4]]
            cells.append(f"{100 * v[4]:.1f}%" if v[4] is not None else "-")
            lines.append(f"| {w} | {name} | " + " | ".join(cells) + " |")
    lines.append("")

    def ratio(a: str, b: str, w: str, key: str) -> str:
        x, y = med(a, w, key), med(b, w, key)
        return f"{x / y:.2f}x" if x and y else "-"

    for w in workloads:
        parts = []
        if "ray-2-prefix" in configs and "plain" in configs:
            parts.append("2 replicas (prefix) / plain: tok/s "
                         f"{ratio('ray-2-prefix', 'plain', w, 'output_tok_s')}, TTFT p50 "
                         f"{ratio('ray-2-prefix', 'plain', w, 'ttft_p50')}")
        if "ray-2-prefix" in configs and "ray-2-pow2" in configs:
            parts.append(f"prefix / power-of-two: TTFT p50 "
                         f"{ratio('ray-2-prefix', 'ray-2-pow2', w, 'ttft_p50')}, tok/s "
                         f"{ratio('ray-2-prefix', 'ray-2-pow2', w, 'output_tok_s')}")
        if "ray-1" in configs and "plain" in configs:
            parts.append(f"ray-1 / plain: TTFT p50 {ratio('ray-1', 'plain', w, 'ttft_p50')}, "
                         f"ITL p50 {ratio('ray-1', 'plain', w, 'itl_p50')}")
        lines.append(f"- {w}: " + "; ".join(parts))
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    print(f"bench JSON and server logs: {tmp}")
    if args.results_file:
        with args.results_file.open("a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
