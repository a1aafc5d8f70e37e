"""The README's diagnosis walk-through: two workloads, their plots, what the timelines say.

    python benchmarks/diagnosis.py [--out docs/diagnosis] [--port 8313]

Starts `kvserve serve --max-num-seqs 16` on the default model and drives it with
`kvserve bench serve --plot`:
  long-prompts   8 prompts of 2,000 random tokens, 32 output tokens, concurrency 4
  many-short     96 prompts of 64 tokens, 128 output tokens, all at once (96 > 16 seats)
For each it writes the bench report, the three plots, the timeline of the median request
(`kvserve trace`), and the mean split of end-to-end latency from the server's timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import httpx
from kvserve_procs import KVSERVE, start, stop

RUNS = {
    "long-prompts": ["--dataset", "random", "--random-input-len", "2000",
                     "--random-output-len", "32", "--num-prompts", "8", "--max-concurrency", "4"],
    "many-short": ["--dataset", "random", "--random-input-len", "64", "--random-output-len",
                   "128", "--num-prompts", "96"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/diagnosis")
    p.add_argument("--port", type=int, default=8313)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    server = start(["serve", "--port", str(args.port), "--max-num-seqs", "16"], url)
    try:
        for name, flags in RUNS.items():
            result = out / f"{name}.json"
            report = subprocess.run(
                [*KVSERVE, "bench", "serve", "--base-url", url, "--no-progress", "--plot",
                 str(out / name), "--save-result", str(result), *flags],
                check=True, capture_output=True, text=True).stdout
            (out / f"{name}.txt").write_text(report)
            recs = [r for r in json.loads(result.read_text())["requests"] if r["success"]]
            median = sorted(recs, key=lambda r: r["e2el_ms"])[len(recs) // 2]
            subprocess.run([*KVSERVE, "trace", median["response_id"], "--url", url,
                            "--output", str(out / name / "median-request.png")],
                           check=True, capture_output=True)
            timeline = httpx.get(f"{url}/v1/requests/{median['response_id']}/timeline").json()
            decode = [e for e in timeline["samples"][0]["events"] if e["event"] == "decode"]
            steps = httpx.get(f"{url}/v1/engine/steps", params={"limit": 1000}).json()["data"]
            mixed = [s["total"] for s in steps if s["prefill_tokens"]]
            pure = [s["total"] for s in steps if not s["prefill_tokens"]]
            print(f"{name}: median request's decode events {decode}")
            print(f"{name}: last {len(steps)} steps: {len(mixed)} carried prefill tokens "
                  f"(median {1e3 * statistics.median(mixed or [0]):.1f} ms), {len(pure)} only "
                  f"decodes (median {1e3 * statistics.median(pure or [0]):.1f} ms)")
            t = [r["server_timings"] for r in recs]
            parts = {k: statistics.mean(x[k] or 0.0 for x in t)
                     for k in ("queue_time", "prefill_time", "decode_time", "e2e_time")}
            share = {k: parts[k] / parts["e2e_time"] for k in parts if k != "e2e_time"}
            print(f"{name}: mean e2e {1e3 * parts['e2e_time']:.0f} ms = queue "
                  f"{100 * share['queue_time']:.0f}% + prefill {100 * share['prefill_time']:.0f}%"
                  f" + decode {100 * share['decode_time']:.0f}%; median request "
                  f"{median['response_id']}: {median['server_timings']}")
            print("\n".join(line for line in report.splitlines()
                            if any(k in line for k in ("Mean TTFT", "Mean TPOT", "Output token",
                                                       "Median E2EL"))))
            result.unlink()  # the per-request JSON is large; the report and plots stay
    finally:
        stop(server)


if __name__ == "__main__":
    main()
