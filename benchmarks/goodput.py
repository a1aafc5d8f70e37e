"""Goodput under latency targets: kvserve with --target-ttft-ms / --target-itl-ms against
kvserve without them and against llama.cpp's llama-server, side by side in one run, every
server driven by `kvserve bench serve --goodput` with the same Poisson arrivals.

    python benchmarks/goodput.py --model M.gguf --rate 1.5 --num-prompts 120 \\
        [--ttft-ms 10000] [--itl-ms 150] [--slots 4,8,16,32] [--repeats 1] \\
        [--no-warmup] [--restart-at 0.5]

Servers, one at a time, each on a free port with one warm-up request (with --no-warmup, none:
a fresh server for every repeat, whose first request is a measured one; with --restart-at F,
the server is stopped (SIGTERM: it drains what it holds) and started again, cold, on the same
port after F of the arrivals' span, as a restarted or newly added replica would be; requests
meanwhile fail, and count so):

  kvserve            `kvserve serve` with its defaults
  kvserve-targets    the same with --target-ttft-ms, --target-itl-ms and --shed-late-requests
  llama-server -np N for each N of --slots (its best is what it would be deployed with),
                     `-t 2 -c` N x 512-token slots

A request meets the targets when its TTFT is within --ttft-ms and its time per output token
(TPOT, vLLM's goodput term) within --itl-ms; goodput is such requests per second of the run.
A request refused with a 429 is a request not served: it counts in `failed`, never as good.
Prompts are random (--random-input-len tokens, default 256) with --random-output-len outputs
(128) held to length; the same seed for every server, so each serves the same prompts at the
same arrival times. The table prints each server's medians over --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench import peers as harness


def busy(server: harness.Server) -> bool:
    """Whether the server holds a request now: kvserve's engine stats, or llama-server's
    slots."""
    get = lambda path: httpx.get(server.url + path, timeout=5, trust_env=False)  # noqa: E731
    try:
        r = get("/v1/engine/stats")
        if r.status_code == 200:
            stats = r.json()
            return stats["running"] + stats["waiting"] > 0
        r = get("/slots")
        return r.status_code == 200 and any(s.get("is_processing") for s in r.json())
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


def wait_for_first_request(server: harness.Server, client) -> None:
    """Until the arrivals have begun (the client takes a few seconds to start), so that a
    restart comes at its fraction of the arrivals' span."""
    while client.poll() is None and not busy(server):
        time.sleep(0.1)


def bench(server: harness.Server, spec: harness.ServerSpec, args: argparse.Namespace,
          seed: int, out: Path) -> tuple[dict, harness.Server]:
    """One client run against `server`; returns its summary and the server now serving
    (another one after a --restart-at)."""
    cmd = [*harness.KVSERVE, "bench", "serve", "--base-url", server.url, "--dataset", "random",
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate",
           str(args.rate), "--seed", str(seed), "--warmup", "0", "--no-progress",
           "--timeout", str(args.timeout), "--goodput", f"ttft:{args.ttft_ms:g}",
           f"tpot:{args.itl_ms:g}", "--save-result", str(out)]
    foreign = harness.ForeignCpu(server.proc.pid)
    restarted: float | None = None
    with open(out.with_suffix(".txt"), "w") as report:
        proc = subprocess.Popen(cmd, stdout=report, stderr=subprocess.STDOUT)
        if args.restart_at is not None:
            wait_for_first_request(server, proc)
            time.sleep(args.restart_at * args.num_prompts / args.rate)
            if proc.poll() is None:
                harness.log("  restarting the server")
                server.stop()
                server = harness.Server(spec, server.log_path, args.start_timeout,
                                        warmup=False, port=server.port)
                restarted = server.healthy_after
        rc = proc.wait()
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"bench serve exited with {rc}; see {out.with_suffix('.txt')}")
    summary = json.loads(out.read_text())["summary"]
    # a restarted server is another process tree: its CPU would count as foreign
    summary["other_cores"] = foreign.cores() if args.restart_at is None else None
    summary["restart_healthy_s"] = restarted
    summary["command"] = harness.shown_command(
        [a if a != str(out) else "RESULT.json" for a in cmd], server.port)
    return summary, server


def row(name: str, runs: list[dict]) -> str:
    def med(get) -> float:
        values = [v for r in runs if (v := get(r)) is not None]
        return statistics.median(values) if values else float("nan")

    def stat(key: str, q: str):
        return lambda r: (r.get(key) or {}).get(q)

    return (f"| {name} | {med(lambda r: r['goodput']):.3f} | "
            f"{med(lambda r: r['good_requests']):.0f} / {med(lambda r: r['completed']):.0f} / "
            f"{med(lambda r: r['failed']):.0f} | {med(lambda r: r['output_throughput']):.1f} | "
            f"{med(stat('ttft_ms', 'median')) / 1e3:.2f} / {med(stat('ttft_ms', 'p99')) / 1e3:.2f}"
            f" | {med(stat('itl_ms', 'median')):.0f} / {med(stat('itl_ms', 'p99')):.0f} | "
            f"{med(stat('tpot_ms', 'median')):.0f} / {med(stat('tpot_ms', 'p99')):.0f} | "
            f"{med(lambda r: r['other_cores']):.2f} |")


HEADER = ("| server | goodput req/s | good / served / refused+failed | output tok/s | "
          "TTFT p50 / p99 s | ITL p50 / p99 ms | TPOT p50 / p99 ms | other cores |\n"
          "|---|---|---|---|---|---|---|---|")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a GGUF every server loads")
    p.add_argument("--rate", type=float, required=True, help="Poisson arrivals, requests/s")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--random-input-len", dest="input_len", type=int, default=256)
    p.add_argument("--random-output-len", dest="output_len", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=10_000.0)
    p.add_argument("--itl-ms", type=float, default=150.0)
    p.add_argument("--slots", default="4,8,16,32", help="llama-server -np values to try")
    p.add_argument("--only", default="kvserve,kvserve-targets,llama-server")
    p.add_argument("--kvserve-args", default="", help="extra flags for both kvserve servers")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--cache-dir", type=Path, default=Path("~/.cache/kvserve-bench"))
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", action="store_true",
                   help="no warm-up request: a fresh server for each repeat, measured cold")
    p.add_argument("--restart-at", type=float, default=None, metavar="F",
                   help="restart the server (cold, same port) after this fraction of the "
                        "arrivals' span, e.g. 0.5")
    args = p.parse_args()
    if args.restart_at is not None and not 0 < args.restart_at < 1:
        p.error("--restart-at is a fraction in (0, 1)")
    if args.rate <= 0 or args.num_prompts < 1 or args.ttft_ms <= 0 or args.itl_ms <= 0:
        p.error("--rate, --num-prompts, --ttft-ms and --itl-ms must be positive")
    peers = harness.Peers(args.cache_dir.expanduser())
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="kvserve-goodput-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = ["--target-ttft-ms", f"{args.ttft_ms:g}", "--target-itl-ms", f"{args.itl_ms:g}",
               "--shed-late-requests"]
    extra = shlex.split(args.kvserve_args)
    servers: list[tuple[str, tuple[str, ...]]] = []
    only = args.only.split(",")
    if "kvserve" in only:
        servers.append(("kvserve", (*harness.KVSERVE, "serve", "--port", "{port}", "--model",
                                    str(args.model), *extra)))
    if "kvserve-targets" in only:
        servers.append((f"kvserve --target-ttft-ms {args.ttft_ms:g} --target-itl-ms "
                        f"{args.itl_ms:g} --shed-late-requests",
                        (*harness.KVSERVE, "serve", "--port", "{port}", "--model",
                         str(args.model), *extra, *targets)))
    if "llama-server" in only:
        if not peers.has("llama-server"):
            peers.build("llama-server")
        for n in (int(s) for s in args.slots.split(",")):
            servers.append((f"llama-server -np {n}", (
                str(peers.llama_server), "-m", str(args.model), "--host", "127.0.0.1",
                "--port", "{port}", "-t", str(harness.THREADS), "-np", str(n), "-c",
                str(512 * n))))
    results: dict[str, list[dict]] = {}
    for name, argv in servers:
        harness.log(f"{name}")
        spec = harness.ServerSpec(argv, "/health")
        safe = "".join(c if c.isalnum() else "-" for c in name)[:60]
        server: harness.Server | None = None
        try:
            for i in range(args.repeats):
                if server is None:
                    server = harness.Server(spec, out_dir / f"{safe}.log", args.start_timeout,
                                            warmup=not args.no_warmup)
                s, server = bench(server, spec, args, args.seed + i,
                                  out_dir / f"{safe}-{i}.json")
                results.setdefault(name, []).append(s)
                harness.log(f"  goodput {s['goodput']:.3f} req/s, {s['good_requests']} good "
                            f"of {s['completed']} served, {s['failed']} refused or failed; "
                            f"errors {s['errors']}")
                if args.no_warmup:  # the next repeat gets a cold server of its own
                    server.stop()
                    server = None
        finally:
            if server is not None:
                server.stop()
    print(f"\nPoisson arrivals at {args.rate:g} req/s, {args.num_prompts} prompts of "
          f"{args.input_len} tokens, {args.output_len} out; targets TTFT <= "
          f"{args.ttft_ms / 1e3:g} s, TPOT <= {args.itl_ms:g} ms; model {args.model.name}; "
          f"{'cold servers (no warm-up)' if args.no_warmup else 'one warm-up request'}"
          f"{f'; restarted at {args.restart_at:g} of the arrivals' if args.restart_at else ''};"
          f" medians of {args.repeats} run(s); results in {out_dir}\n")
    print(HEADER)
    for name, runs in results.items():
        print(row(name, runs))
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
