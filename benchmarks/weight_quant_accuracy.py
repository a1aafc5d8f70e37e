"""Accuracy of the weight-only int8/int4 copies against float32, on the default model.

    python benchmarks/weight_quant_accuracy.py [--model ...] [--tokens 128]

The same prompts and method as `kv_int8_accuracy.py`: the float32 model (the GGUF dequantized,
no quantized copies) generates a greedy continuation of each prompt, EOS banned; each candidate
(bfloat16 with --quantization none, int8 and int4) is fed the same tokens and compared at every
step (max |logit difference|, same argmax), then generates on its own (identical greedy prefix).
The six prompts decode together, so every decode step runs the quantized kernels. The prompts
themselves go through the bfloat16 weights on torch's kernels (steps of up to 8 tokens use
them) and through the quantized copy where kvserve's VNNI kernel serves every batch (bf16 on
AVX512-VNNI), as they do when serving. Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
from kv_int8_accuracy import compare, prompt_set, report

from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.paths import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--methods", default="none,int8,int4")
    args = p.parse_args()
    path = resolve_model(args.model)
    prompts, names, banned = prompt_set(path)
    print(f"model {path.name}; {len(prompts)} prompts x {args.tokens} greedy tokens, EOS "
          f"banned; reference float32 without quantized copies; threads "
          f"{torch.get_num_threads()}")

    def load(dtype: torch.dtype, method: str) -> LlamaForCausalLM:
        model = load_model(path, dtype, torch.device("cpu"), lambda c: TorchPagedAttention(
            c.num_heads, c.num_kv_heads, c.head_dim)).model
        model.pack_(method)
        return model

    ref = load(torch.float32, "none")
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        c = compare(ref, load(torch.bfloat16, method), prompts, args.tokens, banned)
        report(f"bfloat16 with --quantization {method} vs float32 "
               f"({time.perf_counter() - t0:.0f}s)", names, c, args.tokens)


if __name__ == "__main__":
    main()
