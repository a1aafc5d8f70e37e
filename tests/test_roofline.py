"""`kvserve roofline`: the cost model's counting on a tiny model, and the command end to end."""

from __future__ import annotations

import pytest
import torch

from kvserve.cli import main
from kvserve.engine.llm import LLM
from kvserve.kv_cache.planner import kv_bytes_per_token
from kvserve.roofline import CostModel, Machine, Point, StepCost


def cost_model(path, quantization: str) -> tuple[CostModel, LLM]:
    llm = LLM(str(path), dtype="float32", quantization=quantization, num_kv_blocks=64)
    eng = llm.engine
    return CostModel(eng.runner.model, kv_bytes_per_token(eng.model_config, "auto",
                                                          eng.config.dtype)), llm


def test_cost_model_counts(tiny_llama_dir):
    model, llm = cost_model(tiny_llama_dir, "int8")
    cfg = llm.engine.model_config
    per_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size \
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size \
        * cfg.intermediate_size
    assert model.params == cfg.num_layers * per_layer
    one, two = model.decode(1, 10), model.decode(2, 10)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert one.flops == 2 * model.params + 2 * model.head_params + attn * 10
    assert two.flops == 2 * one.flops
    # every step reads the int8 copies (1 byte a weight, and a scale per group of 32)
    assert model.step(1, 1, 0).weight_bytes == model.step(64, 1, 0).weight_bytes
    assert model.weight_bytes < model.params * 4 / 3
    # a prefill chunk attends to a triangle
    assert model.prefill(4).flops == 2 * model.params * 4 + 2 * model.head_params + attn * 10


def test_points_against_the_ceilings():
    machine = Machine(torch.float32, peak_gflops=100.0, read_gbs=10.0)
    mem = Point("decode", 0.004, StepCost(1e6, 2e7, 0, 0), machine)  # floor 2 ms
    assert mem.bound == "memory" and "50.0% of the bandwidth floor" in mem.row()
    comp = Point("prefill", 0.004, StepCost(2e8, 1e6, 0, 0), machine)  # ceiling 2 ms
    assert comp.bound == "compute" and "50.0% of the compute ceiling" in comp.row()


def test_roofline_command(tiny_llama_dir, capsys, tmp_path):
    png = tmp_path / "roofline.png"
    rc = main(["roofline", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--batches", "1,2", "--prefill", "16", "--steps", "2", "--repeats", "1",
               "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "matmul" in out and "GB/s" in out
    for name in ("decode b=1", "decode b=2", "prefill 16"):
        assert name in out
    assert "turns compute-bound at batch" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and f"plot written to {png}" in out


@pytest.mark.parametrize("bad", [["--batches", "1,x"], ["--batches", "0"], ["--steps", "0"]])
def test_roofline_bad_arguments(tiny_llama_dir, capsys, bad):
    assert main(["roofline", "--model", str(tiny_llama_dir), *bad]) == 2
    assert "kvserve: error:" in capsys.readouterr().err
