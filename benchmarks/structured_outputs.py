#!/usr/bin/env python3
"""What structured outputs cost: one kvserve server, `kvserve bench serve` (random 256 in /
128 out) at concurrency 1 and 32 with every request constrained by a JSON schema and without,
alternating in rounds; the grammar phase of the steps (from /v1/engine/steps); and schema
compile times, cold and cached.

The schema asks for a long array, so a constrained request runs to its 128 tokens as an
unconstrained one with ignore_eos does: the two runs produce the same number of tokens.

usage: structured_outputs.py [--rounds 2] [--out DIR] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_split import PYTHON, ROOT, serve, stop  # noqa: E402

LONG = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 200,
    "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"],
        "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
CONSTRAINED = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "long", "schema": LONG}}}
LOADS = {"c1": ["--num-prompts", "16", "--max-concurrency", "1"],
         "c32": ["--num-prompts", "64", "--max-concurrency", "32"]}
COMPILE_SCHEMAS = {
    "long array of objects": LONG,
    "flat object": {"type": "object", "properties": {"a": {"type": "string"},
                                                      "b": {"type": "integer"}},
                    "required": ["a", "b"]},
    "nested with anyOf and patterns": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5}},
            "required": ["email"]},
        "value": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]}},
        "required": ["user", "value"]},
}


def bench(port: int, load: str, constrained: bool, out: Path, seed: int) -> dict:
    cmd = [str(PYTHON), "-m", "kvserve", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--dataset", "random", "--random-input-len", "256",
           "--random-output-len", "128", *LOADS[load], "--seed", str(seed),
           "--temperature", "0", "--no-progress", "--save-result", str(out)]
    if constrained:
        cmd += ["--extra-body", json.dumps(CONSTRAINED)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def grammar_steps(port: int) -> list[dict]:
    r = httpx.get(f"http://127.0.0.1:{port}/v1/engine/steps", params={"limit": 100000})
    return [s for s in r.json()["data"] if s["grammar"] > 0]


def compile_times() -> list[tuple[str, float, float]]:
    """(schema, cold ms, cached ms) with a GrammarCompiler on the default model's tokenizer."""
    from kvserve.models.paths import resolve_model
    from kvserve.sample.sampling_params import StructuredOutputs
    from kvserve.sample.structured import GrammarCompiler
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model(None))
    compiler = GrammarCompiler(tok.backend.to_str(), 49152, sorted(tok.eos_token_ids))
    compiler.tokenizer  # noqa: B018 (built on its thread; wait for it outside the timing)
    rows = []
    for name, schema in COMPILE_SCHEMAS.items():
        spec = StructuredOutputs(json=json.dumps(schema))
        t0 = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(100):
            compiler.compile(spec)
        rows.append((name, cold * 1e3, (time.perf_counter() - t0) * 10))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("~/.cache/kvserve-bench/structured"))
    p.add_argument("--port", type=int, default=8732)
    p.add_argument("server_flags", nargs="*")
    args = p.parse_args()
    out = args.out.expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    results: dict[tuple[str, bool], list[dict]] = {}
    proc = serve(ROOT, ["--step-buffer-size", "100000", *args.server_flags], args.port,
                 out / "server.log")
    try:
        for r in range(args.rounds):
            for load in LOADS:
                order = (False, True) if r % 2 == 0 else (True, False)
                for constrained in order:
                    name = f"{load}-{'json' if constrained else 'plain'}-{r}"
                    s = bench(args.port, load, constrained, out / f"{name}.json", seed=r)
                    results.setdefault((load, constrained), []).append(s)
                    print(f"{name}: {s['output_throughput']:.1f} tok/s, TPOT p50 "
                          f"{s['tpot_ms']['median']:.1f} ms, {s['completed']} done, "
                          f"{s['failed']} failed", file=sys.stderr)
        steps = grammar_steps(args.port)
    finally:
        stop(proc)
    med = statistics.median
    print(f"\nkvserve bench serve, random 256/128, medians of {args.rounds} rounds")
    print("| load | requests | output tok/s | TPOT p50 ms | ITL p50 ms | TTFT p50 ms |")
    print("|---|---|---|---|---|---|")
    for load in LOADS:
        for constrained in (False, True):
            rs = results[(load, constrained)]
            print(f"| {load} | {'JSON schema' if constrained else 'unconstrained'} "
                  f"| {med([s['output_throughput'] for s in rs]):.1f} "
                  f"| {med([s['tpot_ms']['median'] for s in rs]):.1f} "
                  f"| {med([s['itl_ms']['median'] for s in rs]):.1f} "
                  f"| {med([s['ttft_ms']['median'] for s in rs]):.0f} |")
        plain = med([s["output_throughput"] for s in results[(load, False)]])
        json_ = med([s["output_throughput"] for s in results[(load, True)]])
        print(f"|  | ratio | {json_ / plain:.3f} | | | |")
    by_batch: dict[int, list[float]] = {}
    for s in steps:
        by_batch.setdefault(s["num_requests"], []).append(s["grammar"])
    print("\ngrammar (mask) phase per step, by requests in the step")
    print("| requests | steps | median ms | per request µs |")
    print("|---|---|---|---|")
    for b in sorted(by_batch):
        m = med(by_batch[b])
        print(f"| {b} | {len(by_batch[b])} | {m * 1e3:.2f} | {m / b * 1e6:.0f} |")
    print("\nschema compile (default model's tokenizer)")
    print("| schema | cold ms | cached ms |")
    print("|---|---|---|")
    for name, cold, cached in compile_times():
        print(f"| {name} | {cold:.2f} | {cached:.3f} |")
    print(f"\nraw results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
