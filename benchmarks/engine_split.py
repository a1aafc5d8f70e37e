#!/usr/bin/env python3
"""Serving figures of kvserve builds side by side: `kvserve bench serve` (random 256 in / 128
out, 64 prompts, at concurrency 1, 8 and 32, and the shared-prefix workload at 8) against a
server started from each source tree and flag set in turn, in rounds that alternate the
order. Prints one table per workload: output tok/s, TTFT and ITL p50/p99 (medians over the
rounds).

usage: engine_split.py NAME=TREE[:SERVER FLAGS] ... [--rounds 2] [--out DIR]
e.g.   engine_split.py before=/tmp/kvserve-before thread=. "process=.:--engine-process"

Each TREE is a kvserve checkout whose `kvserve` package the repo's .venv python imports when
run from there (the current checkout, or a `git worktree` of another commit).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve.bench.spawn import spawn_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
WORKLOADS = {
    "c1": ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "128",
           "--num-prompts", "64", "--max-concurrency", "1"],
    "c8": ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "128",
           "--num-prompts", "64", "--max-concurrency", "8"],
    "c32": ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "128",
            "--num-prompts", "64", "--max-concurrency", "32"],
    "shared-prefix": ["--dataset", "shared-prefix", "--max-concurrency", "8"],
}


def serve(tree: Path, flags: list[str], port: int, log: Path) -> subprocess.Popen:
    return spawn_server(flags, port, log, cwd=tree, python=PYTHON)


def stop(proc: subprocess.Popen) -> None:
    stop_server(proc)


def bench(port: int, workload: str, out: Path, seed: int) -> dict:
    cmd = [str(PYTHON), "-m", "kvserve", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", *WORKLOADS[workload], "--seed", str(seed),
           "--temperature", "0", "--no-progress", "--save-result", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="NAME=TREE[:SERVER FLAGS]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--out", type=Path, default=Path("~/.cache/kvserve-bench/engine-split"))
    p.add_argument("--port", type=int, default=8731)
    args = p.parse_args()
    configs = []
    for c in args.configs:
        name, _, rest = c.partition("=")
        tree, _, flags = rest.partition(":")
        configs.append((name, Path(tree).resolve(), shlex.split(flags)))
    workloads = args.workloads.split(",")
    out = args.out.expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name, tree, flags in order:
            proc = serve(tree, flags, args.port, out / f"{name}-{r}.log")
            try:
                for w in workloads:
                    s = bench(args.port, w, out / f"{name}-{w}-{r}.json", seed=r)
                    results.setdefault((name, w), []).append(s)
                    print(f"round {r} {name:>10} {w:>13}: {s['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {s['ttft_ms']['median']:.0f} ms, ITL p50 "
                          f"{s['itl_ms']['median']:.1f} ms", file=sys.stderr)
            finally:
                stop(proc)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for w in workloads:
        print(f"\n{w} (medians of {args.rounds} rounds)")
        print("| build | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
        print("|---|---|---|---|---|---|")
        for name, _, _ in configs:
            rs = results[(name, w)]
            print(f"| {name} | {med([s['output_throughput'] for s in rs]):.1f} "
                  f"| {med([s['ttft_ms']['median'] for s in rs]):.0f} "
                  f"| {med([s['ttft_ms']['p99'] for s in rs]):.0f} "
                  f"| {med([s['itl_ms']['median'] for s in rs]):.1f} "
                  f"| {med([s['itl_ms']['p99'] for s in rs]):.1f} |")
    print(f"\nraw results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
