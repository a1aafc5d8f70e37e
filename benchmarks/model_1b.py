"""A 1B-class model for speed work: random weights in Llama-3.2-1B's shape (16 layers, hidden
2048, FFN 8192, 32 query / 8 KV heads of 64, tied embeddings), the default model's tokenizer
(49,152 tokens), written as F16 with `gguf`'s writer and quantized to Q4_K_M with llama.cpp's
own `llama-quantize` (built, when missing, next to the llama-server that
benchmarks/vs_llamacpp.py builds). `--shape 8b` writes Llama-3.1-8B's shape instead (32
layers, hidden 4096, FFN 14336, 32 query / 8 KV heads of 128, an output matrix of its own),
with the same tokenizer: 7.0B parameters, a 14 GiB F16 file on the way (written one tensor at
a time, so never held in memory whole).

    python benchmarks/model_1b.py [--shape 1b|8b] [--out FILE] [--type Q4_K_M]

Prints the file's path; reuses it when it exists. Then, e.g.:

    python benchmarks/vs_llamacpp.py --model FILE --only kvserve,llama-server \\
        --workloads prefill,decode-16,serve-c32

The weights are N(0, 0.02) (norms 1), so the text is noise; the compute, the bytes read and
the quantized formats are a real 1B model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench import peers as harness

SHAPES = {
    "1b": dict(name="random 1B (Llama-3.2-1B shape)", layers=16, hidden=2048, ffn=8192,
               heads=32, kv_heads=8, head_dim=64, context=8192, rope_theta=500000.0, eps=1e-5,
               tied=True),
    "8b": dict(name="random 8B (Llama-3.1-8B shape)", layers=32, hidden=4096, ffn=14336,
               heads=32, kv_heads=8, head_dim=128, context=8192, rope_theta=500000.0,
               eps=1e-5, tied=False),
}


def quantize_tool(peers: harness.Peers) -> Path:
    """llama.cpp's llama-quantize, built in the llama-server build tree when missing."""
    tool = peers.llama_server.parent / "llama-quantize"
    if os.access(tool, os.X_OK):
        return tool
    if not peers.has("llama-server"):
        peers.build("llama-server")
    build = peers.llama_server.parent.parent
    harness.run_logged(["cmake", "--build", str(build), "--target", "llama-quantize",
                        f"-j{os.cpu_count() or 2}"], peers.cache / "llama-quantize-build.log",
                       "cmake build llama-quantize")
    return tool


def copy_tokenizer(w, src) -> None:
    """The tokenizer's metadata of GGUFReader `src` copied into GGUFWriter `w`."""
    import gguf

    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))


def write_f16(path: Path, tokenizer_gguf: Path, shape: str = "1b", seed: int = 0) -> None:
    """The random F16 model, the tokenizer's metadata copied from `tokenizer_gguf`."""
    import gguf

    s = SHAPES[shape]
    src = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(s["name"])
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, src)
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    h, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    # (name, shape): matrices random float16, norms float32 ones
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h)),
                                                  ("output_norm.weight", (h,))]
    if not s["tied"]:
        tensors.append(("output.weight", (vocab, h)))
    for i in range(s["layers"]):
        tensors += [(f"blk.{i}.{name}.weight", shape) for name, shape in (
            ("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
            ("attn_output", (h, h)), ("ffn_gate", (s["ffn"], h)), ("ffn_up", (s["ffn"], h)),
            ("ffn_down", (h, s["ffn"])))]
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.ffn_norm.weight", (h,))]

    def make(shape: tuple[int, ...]) -> np.ndarray:
        return normal(*shape) if len(shape) == 2 else np.ones(shape, dtype=np.float32)

    for name, shape in tensors:  # infos first, then the data one tensor at a time
        dtype = np.dtype(np.float16 if len(shape) == 2 else np.float32)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in tensors:
        w.write_tensor_data(make(shape))
    w.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = Path(os.environ.get("KVSERVE_BENCH_CACHE", "~/.cache/kvserve-bench")).expanduser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    args = p.parse_args()
    out = (args.out or cache / f"random-{args.shape}-llama-{args.type}.gguf").expanduser()
    if out.is_file():
        print(out)
        return 0
    from kvserve.models.paths import default_model_path

    tokenizer = default_model_path()
    if tokenizer is None:
        raise SystemExit("the default model (its tokenizer) is not installed")
    peers = harness.Peers(cache)
    tool = quantize_tool(peers)
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.stem + ".F16.gguf")
    t0 = time.perf_counter()
    write_f16(f16, tokenizer, args.shape)
    harness.log(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in "
                f"{time.perf_counter() - t0:.0f} s")
    harness.run_logged([str(tool), str(f16), str(out), args.type],
                       cache / "llama-quantize.log", "llama-quantize")
    f16.unlink()
    harness.log(f"quantized to {args.type}: {out.stat().st_size / 2**20:.0f} MiB")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
