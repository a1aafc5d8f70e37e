"""Prefix-cache figures on the default model, measured with `kvserve bench serve`.

    python benchmarks/prefix_cache.py [--port 8311] [--skip-shared] [--skip-disk]

1. Shared prefix: 8 groups x 16 prompts, 1024-token shared prefix, 32-token question,
   32 output tokens, concurrency 8 - against a server with prefix caching, then one without.
2. Disk tier: a server with --kv-cache-dir sees one 1024-token prefix and is stopped
   (SIGTERM: a clean shutdown flushes the cache to disk); a new server on the same directory
   then serves that prefix with a new question, and a never-seen prefix: TTFT of each.

Prints every bench report and a summary; all servers run one after another in this process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import httpx
import numpy as np
from kvserve_procs import KVSERVE, start, stop

from kvserve.bench.datasets import RandomText, load_tokenizer


class Server:
    def __init__(self, port: int, log_path: Path, *flags: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_path
        with open(log_path, "a") as log:
            try:
                self.proc = start(["serve", "--port", str(port), *flags], self.url, log)
            except RuntimeError as e:
                raise RuntimeError(f"{e}; log in {self.log}") from None
        # Warm kernels with an unrelated short request, so the first measured one is fair.
        httpx.post(f"{self.url}/v1/completions", timeout=120,
                   json={"prompt": "Hello there", "max_tokens": 4})

    def stop(self) -> None:
        stop(self.proc)


def bench(url: str, out: Path, *flags: str) -> dict:
    cmd = [*KVSERVE, "bench", "serve", "--base-url", url, "--no-progress", "--save-result",
           str(out), *flags]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def summary(result: dict) -> dict:
    return result.get("summary", result)


def shared_prefix(port: int, work: Path) -> None:
    flags = ["--dataset", "shared-prefix", "--shared-prefix-groups", "8",
             "--prompts-per-group", "16", "--system-prompt-len", "1024", "--question-len", "32",
             "--output-len", "32", "--max-concurrency", "8", "--warmup", "0"]
    results = {}
    for name, extra in (("with prefix caching", []),
                        ("without prefix caching", ["--no-enable-prefix-caching"])):
        server = Server(port, work / "server.log", *extra)
        try:
            results[name] = summary(bench(server.url, work / f"shared-{len(results)}.json",
                                          *flags))
        finally:
            server.stop()
    on, off = results["with prefix caching"], results["without prefix caching"]
    print("\nshared-prefix summary (8 x 16 prompts, 1024-token prefix, concurrency 8):")
    for name, s in results.items():
        print(f"  {name:24s} mean TTFT {s['ttft_ms']['mean']:8.1f} ms   median "
              f"{s['ttft_ms']['median']:8.1f} ms   hit rate {_rate(s)}   "
              f"output {s['output_throughput']:.1f} tok/s")
    ratio = off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"]
    print(f"  mean TTFT ratio (without / with): {ratio:.1f}x")


def _rate(s: dict) -> str:
    r = s.get("prefix_cache_hit_rate")
    return "n/a" if r is None else f"{100 * r:.1f}%"


def disk_restart(port: int, work: Path) -> None:
    tok = load_tokenizer(None)
    text = RandomText(tok, np.random.default_rng(7))
    seen, _ = text.make(1024)
    fresh, _ = text.make(1024)
    questions = [text.make(32, head)[0] for head in (seen, seen, fresh)]

    def jsonl(name: str, prompt: str) -> Path:
        path = work / name
        path.write_text(json.dumps({"prompt": prompt, "output_len": 8}) + "\n")
        return path

    cache_dir = work / "kv-cache"
    flags = ["--kv-cache-dir", str(cache_dir)]
    one = ["--dataset", "jsonl", "--num-prompts", "1", "--warmup", "0"]
    server = Server(port, work / "server.log", *flags)
    try:
        bench(server.url, work / "disk-first.json", *one, "--dataset-path",
              str(jsonl("first.jsonl", seen + questions[0])))
    finally:
        server.stop()
    files = list(cache_dir.rglob("*.kvb"))
    print(f"\nafter a clean shutdown: {len(files)} blocks on disk under {cache_dir}")
    server = Server(port, work / "server.log", *flags)
    try:
        warm = summary(bench(server.url, work / "disk-warm.json", *one, "--dataset-path",
                             str(jsonl("warm.jsonl", seen + questions[1]))))
        cold = summary(bench(server.url, work / "disk-cold.json", *one, "--dataset-path",
                             str(jsonl("cold.jsonl", fresh + questions[2]))))
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    hits = [ln for ln in metrics.splitlines() if ln.startswith("kvserve:prefix_cache_hits_total")]
    print("\ndisk tier after restart (1024-token prefix + 32-token question, 8 output tokens):")
    print(f"  seen prefix  TTFT {warm['ttft_ms']['mean']:8.1f} ms   hit rate {_rate(warm)}")
    print(f"  cold prefix  TTFT {cold['ttft_ms']['mean']:8.1f} ms   hit rate {_rate(cold)}")
    print(f"  ratio (cold / seen): {cold['ttft_ms']['mean'] / warm['ttft_ms']['mean']:.1f}x")
    print("  " + "\n  ".join(hits))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--skip-shared", action="store_true")
    p.add_argument("--skip-disk", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.skip_shared:
            shared_prefix(args.port, work)
        if not args.skip_disk:
            disk_restart(args.port, work)


if __name__ == "__main__":
    main()
