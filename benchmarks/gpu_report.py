"""The GPU report of scripts/gpu_check.sh: random-weight bf16 models in real shapes, built on
the machine (nothing is downloaded or carried), measured side by side in one run.

    python benchmarks/gpu_report.py --device cuda --shapes 8b,1b --out REPORT.md
    python benchmarks/gpu_report.py --device cpu --shapes tiny --out /tmp/r.md   # dry run

Per shape:
- the model: a Hugging Face directory (config.json, bf16 safetensors, a byte-level tokenizer
  padded with plain tokens to the shape's vocabulary) written from N(0, 0.02) weights;
- the bandwidth floor: the weights' bytes over the device's measured copy bandwidth (bytes
  read + written per second by a large device-to-device copy, the best of 10);
- batch-1 decode: kvserve's time per output token for one request (512-token prompt, 128
  out), against that floor, and the bandwidth it implies; then the same engine with its
  CUDA graphs dropped (every step eager, as --enforce-eager);
- serving: `kvserve serve` on the device driven by `kvserve bench serve` at --concurrency
  requests of --input-len / --output-len tokens (TTFT, ITL, TPOT p50/p99, output tokens/s);
- the roofline: decode steps at batch 1, 8 and 64 and a 512-token prefill placed against the
  GPU's roof (its bf16 matmul ceiling and copy bandwidth, measured here), as
  `kvserve roofline` places a CPU's steps;
- Hugging Face `generate` with static batching of --concurrency such requests on the same
  device and weights (greedy, held to --output-len tokens): output tokens/s.

The weights are noise, so is the text: the shapes, bytes and compute are the real models'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3.1-8B: 32 layers, hidden 4096, FFN 14336, 32 / 8 heads of 128, 128,256 tokens
    "8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256,
               tie=False),
    # Llama-3.2-1B: 16 layers, hidden 2048, FFN 8192, 32 / 8 heads of 64, tied embeddings
    "1b": dict(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256,
               tie=True),
    # a dry run's: seconds on a CPU
    "tiny": dict(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=512, tie=False),
}


def log(msg: str) -> None:
    print(f"[gpu_report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tokenizer_json(vocab: int) -> str:
    """Byte-level BPE (a token per byte) plus plain added tokens up to `vocab`, so every id
    the model can sample decodes to text and random prompts can be drawn from any of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = {"<s>": 0, "</s>": 1}
    for ch in alphabet:
        ids[ch] = len(ids)
    tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.add_tokens([f"<w{i}>" for i in range(vocab - len(ids))])
    return tok.to_str()


def build_model(shape: str, root: Path, device: str) -> Path:
    """The shape's random bf16 checkpoint under root (reused when already there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    path = root / f"random-{shape}-bf16"
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return path
    t0 = time.perf_counter()
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                      intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=s["tie"], bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # initialised where it is built
    model.save_pretrained(path, max_shard_size="4GB")  # safetensors
    (path / "tokenizer.json").write_text(tokenizer_json(s["vocab"]))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 8192}))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"{shape}: wrote {path} in {time.perf_counter() - t0:.1f}s")
    return path


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def best_seconds(fn, device: str, repeats: int = 10) -> float:
    """The fastest of `repeats` runs of `fn`, each timed from a synchronized device to one."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`, best of 10."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / best_seconds(lambda: y.copy_(x), device)


def matmul_rate(device: str, n: int = 8192) -> float:
    """bf16 FLOP/s of an [n, n] x [n, n] torch.matmul (cuBLAS on a GPU), best of 10."""
    n = n if device.startswith("cuda") else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / best_seconds(lambda: torch.matmul(a, b), device)


def roofline_steps(path: Path, device: str, bandwidth: float, flops: float) -> list[str]:
    """`kvserve roofline`'s table on the device: decode steps at batch 1, 8 and 64 and a
    512-token prefill, each placed against this GPU's roof (the bf16 matmul ceiling and the
    copy bandwidth measured here)."""
    from kvserve.engine.llm_engine import EngineArgs, build_engine
    from kvserve.tools import ceilings, roofline

    machine = ceilings.Machine(torch.bfloat16, 0, {"bf16": {"torch matmul": flops / 1e9}},
                               {"device copy": bandwidth / 1e9})
    engine = build_engine(EngineArgs(
        model=str(path), dtype="bfloat16", device=device, enable_prefix_caching=False,
        max_num_seqs=64, max_num_batched_tokens=512, kv_cache_memory="4GiB",
        step_buffer_size=0))
    try:
        _, points, ridge = roofline.run(engine, [1, 8, 64], 512, 8, 3, machine)
    finally:
        engine.close()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return [*roofline.table(points),
            f"decode turns compute-bound at batch {ridge if ridge else '> 4096'} by the "
            f"cost model"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def batch1_decode(path: Path, device: str, prompt_len: int, out_len: int) -> dict:
    """kvserve's time per output token for a lone request (median over 3 requests)."""
    from kvserve.engine.llm import LLM
    from kvserve.sample.sampling_params import SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device=device, max_model_len=prompt_len + out_len,
              kv_cache_memory="4GiB")  # one request's; the server after it takes the GPU
    try:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        vocab = llm.engine.local_core.runner.vocab_size
        runner = llm.engine.local_core.runner

        def tpots() -> list[float]:
            llm.generate(random_prompts(1, prompt_len, vocab, seed=99), params)  # warm-up
            times = []
            for prompt in random_prompts(3, prompt_len, vocab):
                m = llm.generate([prompt], params)[0].metrics
                times.append((m.finished_time - m.first_token_time) / (out_len - 1))
            return times

        graphed = tpots()
        replays = runner.graphs.replays if runner.graphs is not None else 0
        runner.graphs = None  # the same engine, every step eager (as --enforce-eager)
        eager = tpots()
        return {"tpot_s": statistics.median(graphed), "tpots_s": graphed,
                "graph_replays": replays, "eager_tpot_s": statistics.median(eager),
                "eager_tpots_s": eager, "batch_variant": runner.model.batch_variant_parts()}
    finally:
        llm.close()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def serve_bench(path: Path, device: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """`kvserve serve` on the device, `kvserve bench serve` against it; the saved summary."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = out_dir / f"serve-{path.name}.log"
    cmd = [sys.executable, "-m", "kvserve", "serve", "--model", str(path), "--device",
           device, "--dtype", "bfloat16", "--port", str(port),
           "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(args.input_len + args.output_len + 16)]
    with open(log_path, "w") as logf:
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + args.start_timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {server.returncode}; see "
                                   f"{log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvserve serve not healthy in {args.start_timeout}s")
            time.sleep(0.5)
        result = out_dir / f"bench-{path.name}.json"
        bench = [sys.executable, "-m", "kvserve", "bench", "serve", "--base-url",
                 f"http://127.0.0.1:{port}", "--dataset", "random", "--tokenizer", str(path),
                 "--random-input-len", str(args.input_len), "--random-output-len",
                 str(args.output_len), "--num-prompts", str(args.num_prompts),
                 "--max-concurrency", str(args.concurrency), "--seed", "0", "--no-progress",
                 "--save-result", str(result)]
        subprocess.run(bench, check=True, stdout=sys.stderr)
        return json.loads(result.read_text())["summary"]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def hf_static(path: Path, device: str, args: argparse.Namespace) -> dict:
    """Hugging Face generate on one static batch of --concurrency prompts: output tokens/s
    (the best of 2 runs after a short warm-up)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device=device, dtype=torch.bfloat16)  # whatever the version's default
    vocab = model.config.vocab_size
    ids = torch.tensor(random_prompts(args.concurrency, args.input_len, vocab), device=device)
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kw)
    best = float("inf")
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, **kw)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"seconds": best, "output_tokens": n, "output_tokens_per_s": n / best}


def report_shape(shape: str, args: argparse.Namespace, root: Path) -> dict:
    path = build_model(shape, root, args.device)
    r: dict = {"shape": shape, **SHAPES[shape], "weight_bytes": weight_bytes(path)}
    r["copy_bandwidth"] = copy_bandwidth(args.device, args.copy_bytes)
    r["floor_s"] = r["weight_bytes"] / r["copy_bandwidth"]
    log(f"{shape}: {r['weight_bytes'] / 1e9:.2f} GB of weights, copy bandwidth "
        f"{r['copy_bandwidth'] / 1e9:.0f} GB/s, floor {1e3 * r['floor_s']:.2f} ms")
    r["batch1"] = batch1_decode(path, args.device, args.input_len, args.batch1_output_len)
    r["batch1"]["vs_floor"] = r["batch1"]["tpot_s"] / r["floor_s"]
    log(f"{shape}: batch-1 TPOT {1e3 * r['batch1']['tpot_s']:.2f} ms = "
        f"{r['batch1']['vs_floor']:.2f}x the floor ({r['batch1']['graph_replays']} graph "
        f"replays; eager {1e3 * r['batch1']['eager_tpot_s']:.2f} ms)")
    r["matmul_flops"] = matmul_rate(args.device)
    r["roofline"] = roofline_steps(path, args.device, r["copy_bandwidth"], r["matmul_flops"])
    log(f"{shape}: roofline\n" + "\n".join(r["roofline"]))
    r["serve"] = serve_bench(path, args.device, args, root)
    r["hf"] = hf_static(path, args.device, args)
    r["vs_hf"] = r["serve"]["output_throughput"] / r["hf"]["output_tokens_per_s"]
    log(f"{shape}: kvserve {r['serve']['output_throughput']:.0f} tok/s, HF static "
        f"{r['hf']['output_tokens_per_s']:.0f} tok/s: {r['vs_hf']:.2f}x")
    return r


def markdown(results: list[dict], args: argparse.Namespace, device_name: str) -> str:
    lines = [f"# GPU report: {device_name}", "",
             f"torch {torch.__version__}; serving {args.num_prompts} requests at concurrency "
             f"{args.concurrency}, {args.input_len} in / {args.output_len} out; batch-1 "
             f"decode {args.input_len} in / {args.batch1_output_len} out.", "",
             "| shape | weights GB | copy GB/s | floor ms | batch-1 TPOT ms | x floor | "
             "eager batch-1 TPOT ms | TTFT p50/p99 ms | ITL p50/p99 ms | TPOT p50/p99 ms | "
             "kvserve tok/s | HF static tok/s | x HF |", "|" + "---|" * 13]
    def pct(s: dict, key: str) -> str:
        d = s.get(key) or {}
        return f"{d.get('median', float('nan')):.1f} / {d.get('p99', float('nan')):.1f}"

    for r in results:
        s = r["serve"]
        lines.append(
            f"| {r['shape']} | {r['weight_bytes'] / 1e9:.2f} | {r['copy_bandwidth'] / 1e9:.0f} "
            f"| {1e3 * r['floor_s']:.2f} | {1e3 * r['batch1']['tpot_s']:.2f} | "
            f"{r['batch1']['vs_floor']:.2f} | {1e3 * r['batch1']['eager_tpot_s']:.2f} | "
            f"{pct(s, 'ttft_ms')} | {pct(s, 'itl_ms')} | "
            f"{pct(s, 'tpot_ms')} | {s['output_throughput']:.0f} | "
            f"{r['hf']['output_tokens_per_s']:.0f} | {r['vs_hf']:.2f} |")
    for r in results:
        lines += ["", f"{r['shape']}: each step against this GPU's roof (bf16 matmul "
                  f"{r['matmul_flops'] / 1e12:.0f} TFLOP/s, copy "
                  f"{r['copy_bandwidth'] / 1e9:.0f} GB/s):", "", "```", *r["roofline"], "```"]
    for r in results:
        if r["batch1"]["batch_variant"]:
            lines.append(f"\n{r['shape']}: not batch-invariant here: "
                         f"{'; '.join(r['batch1']['batch_variant'])}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="8b,1b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--out", type=Path, required=True, help="the report (markdown; + .json)")
    p.add_argument("--workdir", type=Path, default=None, help="models and logs (a temp dir)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="kvserve-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    device_name = (torch.cuda.get_device_name(torch.device(args.device))
                   if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)")
    results: list[dict] = []
    for shape in shapes:
        try:
            results.append(report_shape(shape, args, root))
        except Exception as e:  # one shape's failure still leaves the others' report
            log(f"{shape}: FAILED: {type(e).__name__}: {e}")
            results.append({"shape": shape, "error": f"{type(e).__name__}: {e}"})
        # after every shape: a timeout during the next still leaves this one's report
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        ok = [r for r in results if "error" not in r]
        text = markdown(ok, args, device_name) + "".join(
            f"\n{r['shape']}: FAILED: {r['error']}\n" for r in results if "error" in r)
        args.out.write_text(text)
    print(text)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
