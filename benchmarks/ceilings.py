"""How close decode comes to this machine's ceilings, on the default model.

    python benchmarks/ceilings.py [--batches 1,8,16,32,64,128] [--steps 24] [--quantization auto]

(`kvserve roofline` does the same for any model with a fuller cost model; this script keeps
the figures issue 5 quoted comparable.)

Measures, in one process with the engine's thread settings:

1. The machine: a large bf16 and fp32 matrix product (GFLOP/s), and read bandwidth (GB/s,
   summing a 1 GiB tensor).
2. Batch-1 decode: the median time of a decode step after a 16-token prompt, against the
   floor set by the bytes a step must read (every weight in the format the batch-1 path uses:
   quantized copies where there are, the LM head's, the norms; plus the K/V it attends to)
   divided by the measured bandwidth.
3. Batched decode: the median decode-step time with B sequences, as achieved GFLOP/s
   (2 x parameters used per token, LM head included, plus attention) against the bf16
   ceiling. The batch where decode turns compute-bound is where B x 2 FLOP per parameter
   outgrows the bytes per parameter times the machine balance (ceiling / bandwidth).
"""

from __future__ import annotations

import argparse

import torch

from kvserve.engine.llm_engine import EngineArgs, LLMEngine, build_engine
from kvserve.roofline import PROMPT_LEN, CostModel, measure_machine, time_decode


def machine(repeats: int) -> dict[str, float]:
    bf16 = measure_machine(torch.bfloat16, repeats)
    fp32 = measure_machine(torch.float32, repeats)
    return {"bf16_gflops": bf16.peak_gflops, "fp32_gflops": fp32.peak_gflops,
            "read_gbs": bf16.read_gbs}


def decode_bytes(engine: LLMEngine, context: int) -> tuple[int, int]:
    """(bytes a batch-1 decode step reads: weights in the batch-1 format, LM head, norms and
    the K/V of `context` tokens; parameters it multiplies per token), from the roofline's
    cost model."""
    kv = engine.runner.kv_caches
    per_token = sum(c[:, :, 0].numel() * c.element_size() for c in kv)
    m = CostModel(engine.runner.model, per_token)
    nbytes = m.small_bytes + m.head_bytes_small + m.norm_bytes + per_token * context
    return int(nbytes), m.params + m.head_params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,16,32,64,128")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    engine = build_engine(EngineArgs(model=None, quantization=args.quantization,
                                  max_num_seqs=max(batches),
                                  max_num_batched_tokens=max(512, max(batches))))
    m = machine(args.repeats)
    print(f"threads {torch.get_num_threads()}; quantized copies: {engine.quantization}")
    print(f"machine: bf16 matmul {m['bf16_gflops']:.0f} GFLOP/s, fp32 {m['fp32_gflops']:.0f} "
          f"GFLOP/s, read bandwidth {m['read_gbs']:.1f} GB/s (medians of {args.repeats})")

    cfg = engine.model_config
    # Attention FLOPs per token at context c: QK and PV, 2 x 2 x heads x head_dim x c per layer.
    attn_per_ctx = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    print("\nbatch  step ms  tok/s   GFLOP/s  % bf16 ceiling   (decode at ~"
          f"{PROMPT_LEN + args.steps // 2} tokens of context)")
    for i, b in enumerate(batches):
        step = time_decode(engine, b, args.steps, seed=i)
        ctx = PROMPT_LEN + args.steps // 2
        nbytes, params = decode_bytes(engine, ctx)
        flops = b * (2 * params + attn_per_ctx * ctx)
        gflops = flops / step / 1e9
        print(f"{b:5d} {1e3 * step:8.2f} {b / step:7.1f} {gflops:9.1f} "
              f"{100 * gflops / m['bf16_gflops']:10.1f}%")
        if b == 1:
            floor = nbytes / (m["read_gbs"] * 1e9)
            one = (step, nbytes, floor)
    if 1 in batches:
        step, nbytes, floor = one
        print(f"\nbatch-1 decode reads {nbytes / 1e6:.1f} MB per step: floor "
              f"{1e3 * floor:.2f} ms at {m['read_gbs']:.1f} GB/s; measured {1e3 * step:.2f} ms "
              f"= {100 * floor / step:.0f}% of the bandwidth floor")
    balance = m["bf16_gflops"] / m["read_gbs"]  # FLOP per byte where the two limits meet
    print(f"machine balance {balance:.0f} FLOP/byte: with bf16 weights (2 B per parameter, "
          f"2 FLOP per parameter per sequence) decode turns compute-bound near batch "
          f"{balance:.0f}")


if __name__ == "__main__":
    main()
