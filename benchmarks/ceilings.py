"""How close decode comes to this machine's ceilings, on the default model.

    python benchmarks/ceilings.py [--batches 1,8,16,32,64,128] [--steps 24] [--quantization auto]

The measurements and the cost model are `kvserve roofline`'s (kvserve/tools/roofline.py), in one
process with the engine's thread settings:

1. The machine: each arithmetic's ceiling (bf16, fp32: torch's matmul and kvserve's
   dense_linear; int8: kvserve's VNNI quant_linear with 8- and 4-bit weights) and the memory
   bandwidth (a sum, a copy and the kernels' GEMVs), every method's figure and the best.
2. Decode with B sequences: the median step time against its roof (the bandwidth floor,
   or the ceiling of the arithmetics its FLOPs run in), flagged where it sits above it.
3. The bytes a batch-1 decode step reads (weights as their kernels read them, the LM head,
   the norms, the K/V of its context) and the batch where decode turns compute-bound.
"""

from __future__ import annotations

import argparse

from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.tools.ceilings import machine_lines
from kvserve.tools.roofline import cost_model, decode_context, run, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,16,32,64,128")
    p.add_argument("--steps", type=int, default=24)
    EngineArgs.add_cli_args(p, ["quantization"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    engine = build_engine(EngineArgs(model=None, quantization=args.quantization,
                                  max_num_seqs=max(batches),
                                  max_num_batched_tokens=max(512, max(batches))))
    machine, points, ridge = run(engine, batches, 0, args.steps, args.repeats)
    kernel = engine.local_core.runner.model.weight_kernel()
    print(f"quantized copies: {engine.quantization} ({kernel}); {args.repeats} runs a figure")
    print("\n".join(machine_lines(machine)))
    ctx = decode_context(args.steps)
    print(f"\ndecode at ~{ctx} tokens of context")
    print("\n".join(table(points)))
    one = cost_model(engine).decode(1, ctx)
    print(f"\nbatch-1 decode reads {one.bytes / 1e6:.1f} MB per step (weights "
          f"{one.weight_bytes / 1e6:.1f}, K/V {one.kv_bytes / 1e6:.2f}): floor "
          f"{1e3 * machine.memory_seconds(one):.2f} ms at {machine.read_gbs:.1f} GB/s")
    print(f"decode turns compute-bound at batch {ridge if ridge is not None else '> 4096'} "
          "by this cost model")


if __name__ == "__main__":
    main()
