"""Prefix-aware routing against round-robin on the shared-prefix workload, 2 replicas.

    python benchmarks/router_prefix.py [--port 8320]

Starts two `kvserve serve` replicas (default model) and, for each policy, a `kvserve router`
in front of them, then `kvserve bench serve --dataset shared-prefix` (8 groups x 8 prompts,
1024-token prefix, 32-token question, 16 output tokens, concurrency 8). Each policy gets its
own dataset seed, so its prefixes are new to both replicas. Prints each report's prefix
cache hit rate and TTFT, and the router's routing decisions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import httpx
from kvserve_procs import KVSERVE, start, stop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8320)
    args = p.parse_args()
    ports = [args.port + 1, args.port + 2]
    replicas = [start(["serve", "--port", str(q)], f"http://127.0.0.1:{q}") for q in ports]
    try:
        runs = [("round-robin", "4"), ("prefix-aware", "4"), ("prefix-aware", "1")]
        for seed, (policy, slack) in enumerate(runs):
            url = f"http://127.0.0.1:{args.port}"
            router = start(["router", "--port", str(args.port), "--policy", policy,
                            "--balance-slack", slack,
                            *[a for q in ports for a in ("--replica", f"http://127.0.0.1:{q}")]],
                           url)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "r.json"
                    subprocess.run(
                        [*KVSERVE, "bench", "serve", "--base-url", url, "--no-progress",
                         "--dataset", "shared-prefix", "--shared-prefix-groups", "8",
                         "--prompts-per-group", "8", "--system-prompt-len", "1024",
                         "--question-len", "32", "--output-len", "16", "--max-concurrency",
                         "8", "--warmup", "0", "--seed", str(100 + seed),
                         "--save-result", str(out)], check=True, capture_output=True)
                    s = json.loads(out.read_text())["summary"]
                decisions = [ln for ln in httpx.get(f"{url}/metrics").text.splitlines()
                             if ln.startswith("kvserve_router:routing_decisions_total")]
                hit = 100 * s["prefix_cache_hit_rate"]
                print(f"{policy:13s} slack {slack} hit rate {hit:5.1f}%  mean TTFT "
                      f"{s['ttft_ms']['mean']:7.1f} ms  median {s['ttft_ms']['median']:7.1f} ms  "
                      f"output {s['output_throughput']:.1f} tok/s", flush=True)
                for ln in decisions:
                    print("   ", ln)
            finally:
                stop(router)
    finally:
        for proc in replicas:
            stop(proc)


if __name__ == "__main__":
    main()
