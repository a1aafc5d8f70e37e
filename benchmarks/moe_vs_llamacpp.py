"""Random mixture-of-experts GGUFs for issue 41's measurements against llama.cpp: random
weights in Qwen3-MoE's layout (q/k norms, an F32 router, experts stacked per layer as
ffn_{gate,up,down}_exps, no shared expert, an output matrix of its own) or gpt-oss's (biases
on q/k/v/o, the router and the experts, attention sinks, sliding and full layers in turn,
YaRN), with the default model's tokenizer (49,152 tokens), written as F16 with `gguf`'s
writer and quantized with llama.cpp's own `llama-quantize` (Q4_K_M; gpt-oss: MXFP4_MOE,
experts in MXFP4 and the rest Q8_0, as gpt-oss's own GGUFs), as benchmarks/model_1b.py does
for its dense models (whose helpers it uses). The shapes (--shape):

  small       8 layers, hidden 1024, 16 query / 4 KV heads of 64, 64 experts of 512
              features, 8 used: 0.9B parameters, quick to build and run
  a3b-12l     Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
              of 768 features, 8 used, renormalized) in 12 of its 48 layers: 7.7B parameters,
              0.78B read a token (the issue's 4-8B total, 0.5-1B active); ~4.4 GiB as Q4_K_M,
              ~15 GiB of F16 on disk while it is built
  a3b         all 48 of Qwen3-30B-A3B's layers (30.3B parameters, 2.9B read a token; its
              own 151,936-token vocabulary is SmolLM2's 49,152 here): a3b-12l's quantized
              layers four times over (layer i is a3b-12l's layer i % 12, the blocks copied
              as llama-quantize wrote them: no 61 GB F16 file), ~17 GiB as Q4_K_M. Two such
              servers do not fit 24 GiB at once, so this shape runs benchmarks/vs_llamacpp.py
              (one server at a time: a 500-token prefill and batch-1 decode, each server's
              peak resident memory) instead of paired.py
  oss20b-4l   gpt-oss-20b's layer (hidden 2880, 64 query / 8 KV heads of 64, 32 experts of
              2880 features, 4 used, sliding window 128 on the even layers) in 4 of its 24
              layers; ~6 GiB of F16 on disk while it is built
  oss20b      all 24 of gpt-oss-20b's layers (its 201,088-token vocabulary is SmolLM2's
              49,152 here): oss20b-4l's quantized layers six times over, ~11 GiB as
              MXFP4_MOE; vs_llamacpp.py, one server at a time (llama-server repacks the
              experts into ~10 GiB of its own beside the file's pages: two servers do not
              fit 24 GiB)

    python benchmarks/moe_vs_llamacpp.py [--shape small] [--out FILE] [--type Q4_K_M]
        [--rounds 3] [--no-run] [paired.py's (a3b: vs_llamacpp.py's) options...]

Writes the file once (reused when it exists: ~/.cache/kvserve-bench/models/
random-qwen3moe-SHAPE-Q4_K_M.gguf), prints its path and the CPU (model name, family/model),
then runs benchmarks/paired.py on it (both servers up at once, one request at a time in
turn): the TTFT of a 500-token prompt and batch-1 decode TPOT, medians of --rounds, and both
servers' peak RSS. `--no-run` only writes the file.

The weights are N(0, 0.02) (norms 1), so the text is noise; the routing spreads tokens over
the experts much as a trained router does at batch 1 (k of E read per token), and the
compute, the bytes read and the quantized formats are those of a real model of this shape.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from model_1b import copy_tokenizer, quantize_tool

from kvserve.bench import peers as harness

SHAPES = {
    "small": dict(name="random Qwen3-MoE (small)", layers=8, hidden=1024, heads=16,
                  kv_heads=4, head_dim=64, experts=64, experts_used=8, expert_ffn=512,
                  context=8192, rope_theta=1000000.0, eps=1e-6),
    "a3b-12l": dict(name="random Qwen3-MoE (30B-A3B layers, 12 of 48)", layers=12,
                    hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
                    experts_used=8, expert_ffn=768, context=8192, rope_theta=1000000.0,
                    eps=1e-6),
    "oss20b-4l": dict(name="random gpt-oss (20b layers, 4 of 24)", arch="gpt-oss", layers=4,
                      hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32,
                      experts_used=4, expert_ffn=2880, context=8192, rope_theta=150000.0,
                      eps=1e-5, window=128, yarn=(32.0, 4096), qtype="MXFP4_MOE"),
}
# a3b: a3b-12l's layers repeated to the real model's 48 (see repeat_layers)
SHAPES["a3b"] = dict(SHAPES["a3b-12l"], name="random Qwen3-MoE (30B-A3B shape, 48 layers)",
                     layers=48, repeats="a3b-12l", one_at_a_time=True)
SHAPES["oss20b"] = dict(SHAPES["oss20b-4l"], name="random gpt-oss (20b shape, 24 layers)",
                        layers=24, repeats="oss20b-4l", one_at_a_time=True)


def cpu_name() -> str:
    """lscpu's model name with its family/model/stepping (the name alone, e.g. `AMD EPYC`
    on a virtual machine, does not say which generation)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model "
            f"{info.get('model', '?')}, stepping {info.get('stepping', '?')}), "
            f"{os.cpu_count()} CPUs")


def write_f16(path: Path, tokenizer_gguf: Path, s: dict, seed: int = 0) -> None:
    """The random F16 model of shape `s` (router and norms F32), written one tensor at a
    time."""
    import gguf

    arch = s.get("arch", "qwen3moe")
    oss = arch == "gpt-oss"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(s["name"])
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["expert_ffn"] * 6)  # unused: no dense layer
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["experts_used"])
    w.add_expert_feed_forward_length(s["expert_ffn"])
    if oss:
        w.add_sliding_window(s["window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["yarn"][0])
        w.add_rope_scaling_orig_ctx_len(s["yarn"][1])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    src = gguf.GGUFReader(str(tokenizer_gguf))
    copy_tokenizer(w, src)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w.add_vocab_size(vocab)

    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    q, kv = s["heads"] * d, s["kv_heads"] * d
    # (name, shape, dtype): matrices random (F16; the router F32), norms F32 ones
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    tensors: list[tuple[str, tuple[int, ...], np.dtype]] = [
        ("token_embd.weight", (vocab, h), f16), ("output_norm.weight", (h,), f32),
        ("output.weight", (vocab, h), f16)]
    for i in range(s["layers"]):
        tensors += [(f"blk.{i}.{name}.weight", shape, dtype) for name, shape, dtype in (
            ("attn_norm", (h,), f32), ("attn_q", (q, h), f16), ("attn_k", (kv, h), f16),
            ("attn_v", (kv, h), f16), ("attn_output", (h, q), f16),
            ("ffn_gate_inp", (e, h), f32), ("ffn_gate_exps", (e, f, h), f16),
            ("ffn_up_exps", (e, f, h), f16), ("ffn_down_exps", (e, h, f), f16))]
        if oss:  # the MLP's input norm as post_attention_norm; biases; sinks
            tensors += [(f"blk.{i}.{name}", shape, f32) for name, shape in (
                ("post_attention_norm.weight", (h,)), ("attn_sinks.weight", (s["heads"],)),
                ("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,)),
                ("attn_output.bias", (h,)), ("ffn_gate_inp.bias", (e,)),
                ("ffn_gate_exps.bias", (e, f)), ("ffn_up_exps.bias", (e, f)),
                ("ffn_down_exps.bias", (e, h)))]
        else:
            tensors += [(f"blk.{i}.{name}.weight", shape, f32) for name, shape in (
                ("attn_q_norm", (d,)), ("attn_k_norm", (d,)), ("ffn_norm", (h,)))]
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    for name, shape, dtype in tensors:  # infos first, then the data one tensor at a time
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, dtype in tensors:
        w.write_tensor_data(make(name, shape, dtype))
    w.close()


def repeat_layers(src: Path, out: Path, s: dict) -> None:
    """`out`: the quantized file `src` with s["layers"] layers, layer i a copy of src's
    layer i % (src's layers): every tensor's blocks copied byte for byte, the metadata
    src's but for the layer count and the name. Written one tensor at a time."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    have = int(reader.fields[f"{arch}.block_count"].contents())
    w = gguf.GGUFWriter(str(out), arch)
    for f in reader.fields.values():
        if f.name in (gguf.Keys.General.ARCHITECTURE, f"{arch}.block_count",
                      gguf.Keys.General.NAME) or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_name(s["name"])
    w.add_block_count(s["layers"])
    by_name = {t.name: t for t in reader.tensors}
    order = [t.name for t in reader.tensors if not t.name.startswith("blk.")]
    copies = [(name, name) for name in order]
    for i in range(s["layers"]):
        prefix = f"blk.{i % have}."
        copies += [(f"blk.{i}." + t.name[len(prefix):], t.name) for t in reader.tensors
                   if t.name.startswith(prefix)]
    for name, source in copies:
        t = by_name[source]
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, source in copies:
        w.write_tensor_data(by_name[source].data)
    w.close()


def default_path(cache: Path, shape: str, qtype: str) -> Path:
    arch = SHAPES[shape].get("arch", "qwen3moe")
    return cache / "models" / f"random-{arch}-{shape}-{qtype}.gguf"


def ensure_model(out: Path, qtype: str, cache: Path, shape: dict) -> Path:
    if out.is_file():
        return out
    if "repeats" in shape:  # the shape it repeats at its default path (whatever --out is)
        src = ensure_model(default_path(cache, shape["repeats"], qtype), qtype, cache,
                           SHAPES[shape["repeats"]])
        t0 = time.perf_counter()
        part = out.with_name(out.name + ".part")
        repeat_layers(src, part, shape)
        part.rename(out)
        harness.log(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) from {src.name}'s "
                    f"layers in {time.perf_counter() - t0:.0f} s")
        return out
    from kvserve.models.paths import default_model_path

    tokenizer = default_model_path()
    if tokenizer is None:
        raise SystemExit("the default model (its tokenizer) is not installed")
    tool = quantize_tool(harness.Peers(cache))
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.stem + ".F16.gguf")
    t0 = time.perf_counter()
    write_f16(f16, tokenizer, shape)
    harness.log(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in "
                f"{time.perf_counter() - t0:.0f} s")
    harness.run_logged([str(tool), str(f16), str(out), qtype],
                       cache / "llama-quantize.log", "llama-quantize")
    f16.unlink()
    harness.log(f"quantized to {qtype}: {out.stat().st_size / 2**20:.0f} MiB")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = Path(os.environ.get("KVSERVE_BENCH_CACHE", "~/.cache/kvserve-bench")).expanduser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--type", default=None,
                   help="llama-quantize's type name (default: Q4_K_M; gpt-oss: MXFP4_MOE)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-run", action="store_true", help="only write the model file")
    args, paired_args = p.parse_known_args()
    s = SHAPES[args.shape]
    args.type = args.type or s.get("qtype", "Q4_K_M")
    out = (args.out or default_path(cache, args.shape, args.type)).expanduser()
    ensure_model(out, args.type, cache, s)
    print(out)
    print(f"shape: {s.get('arch', 'qwen3moe')}, {s['layers']} layers, hidden {s['hidden']}, "
          f"{s['heads']}/"
          f"{s['kv_heads']} heads of {s['head_dim']}, {s['experts']} experts of "
          f"{s['expert_ffn']}, {s['experts_used']} used; {args.type}, "
          f"{out.stat().st_size / 2**20:.0f} MiB")
    print(f"CPU: {cpu_name()}", flush=True)
    if args.no_run:
        return 0
    if s.get("one_at_a_time"):
        script = Path(__file__).resolve().with_name("vs_llamacpp.py")
        cmd = [sys.executable, str(script), "--model", str(out), "--only",
               "kvserve,llama-server", "--workloads", "prefill,decode-16", "--repeats",
               str(args.rounds), *paired_args]
    else:
        script = Path(__file__).resolve().with_name("paired.py")
        cmd = [sys.executable, str(script), "--model", str(out), "--rounds", str(args.rounds),
               *paired_args]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=script.parent)


if __name__ == "__main__":
    sys.exit(main())
