"""`kvserve roofline`: the cost model's counting on tiny models, each step's roof chosen by its
arithmetic, points above their roof flagged, and the command end to end."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import kernels
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.engine.llm import LLM
from kvserve.entrypoints.cli import main
from kvserve.layers.linear import LinearBase
from kvserve.layers.quant import QuantizedWeight
from kvserve.models.loader import load_model
from kvserve.models.moe import SparseMoE
from kvserve.tools import ceilings, roofline
from kvserve.tools.ceilings import Machine, StepWork, measure_compute
from kvserve.tools.roofline import Point, WorkModel, cost_model

# Round synthetic figures: no timing is measured by these tests (apart from the command's).
MACHINE = Machine(torch.float32, threads=2, bandwidth={"sum": 8.0, "int8 GEMV": 10.0},
                  compute={"int8": {"quant_linear": 400.0}, "bf16": {"matmul": 200.0},
                           "fp32": {"matmul": 100.0, "dense_linear": 80.0}})

needs_kernels = pytest.mark.skipif(kernels.quant_kernels(torch.float32, "cpu", 64, 64) is None,
                                   reason="kvserve's int8 kernel is not built here")


def loaded(path, quantization: str, dtype: str = "float32") -> tuple[WorkModel, LLM]:
    llm = LLM(str(path), dtype=dtype, quantization=quantization, num_kv_blocks=64)
    return cost_model(llm.engine), llm


@needs_kernels
def test_cost_model_counts(tiny_llama_dir):
    model, llm = loaded(tiny_llama_dir, "int8")
    cfg = llm.engine.model_config
    per_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size \
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size \
        * cfg.intermediate_size
    assert model.params == cfg.num_layers * per_layer
    one, two = model.decode(1, 10), model.decode(2, 10)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert one.flops == 2 * model.params + 2 * model.head_params + attn * 10
    assert two.flops == 2 * one.flops
    # every step reads the int8 tiles: per 16 outputs x 32 inputs, 512 bytes of codes and
    # a float16 scale and minimum per output (quant_pack's layout), whatever the batch
    assert model.step(1, 1, 0).weight_bytes == model.step(64, 1, 0).weight_bytes
    assert model.weight_bytes == model.params // 512 * (512 + 64)
    assert model.head_bytes == model.head_params // 512 * (512 + 64)
    # a prefill chunk attends to a triangle
    assert model.prefill(4).flops == 2 * model.params * 4 + 2 * model.head_params + attn * 10


def test_dense_bytes_are_what_the_kernel_reads(tiny_llama_bf16_dir):
    """A bf16 checkpoint served in float32 is read as 16-bit tiles where the dense kernel
    takes them: half the bytes of its float32 weights."""
    model, llm = loaded(tiny_llama_bf16_dir, "none")
    layers = [m for m in llm.engine.local_core.runner.model.modules() if isinstance(m, LinearBase)]
    assert model.weight_bytes + model.head_bytes == sum(roofline.layer_bytes(m) for m in layers)
    if kernels.dense_half_kernels("cpu", 64, 64) is not None:
        assert model.weight_bytes == 2 * model.params


def _projections(net) -> tuple[list[LinearBase], list[LinearBase]]:
    """(the routed experts' projections, every other projection but the LM head)."""
    experts = [m for moe in net.modules() if isinstance(moe, SparseMoE)
               for m in moe.experts.modules() if isinstance(m, LinearBase)]
    others = [m for m in net.modules() if isinstance(m, LinearBase)
              and m is not net.lm_head and all(m is not x for x in experts)]
    return experts, others


def _size(layers: list[LinearBase]) -> tuple[int, int]:
    """(parameters, bytes as their kernels read them) of `layers`."""
    return (sum(m.in_features * m.out_features for m in layers),
            sum(roofline.layer_bytes(m) for m in layers))


# the tiny MoE models' MLP intermediate a token computes per layer (tests/test_moe.py):
# qwen3moe 2 of 8 experts of 64 in both layers; qwen2moe 2 of 4 experts of 64 and a shared
# expert of 128 in layer 0, a dense MLP of 128 in layer 1
MOE_WIDTHS = {"qwen3moe": (2 * 64, 2 * 64), "qwen2moe": (2 * 64 + 128, 128)}


@pytest.mark.parametrize("arch", MOE_WIDTHS)
def test_moe_counts_the_experts_a_step_reads(tmp_path, arch):
    """A token's FLOPs count k/E of the routed experts' weights, a step's bytes the share
    experts_read gives, 1 - (1 - k/E)^T of them (k/E at T = 1), so batch 1 < batch 32 <
    every expert; the router, a shared expert and a dense layer's MLP count whole."""
    from tests.test_moe import build_tiny_moe

    net = load_model(build_tiny_moe(tmp_path, arch), torch.float32, torch.device("cpu"),
                     TorchPagedAttention.for_model).model
    cfg = net.config
    experts, others = _projections(net)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    assert k < e and len(experts) == 2 * e * sum(map(cfg.sparse, range(cfg.num_layers)))
    (n_exp, b_exp), (n_other, b_other) = _size(experts), _size(others)
    model = WorkModel(net, kv_bytes_per_token=0)
    assert model.params == n_other + n_exp * k // e
    assert model.weight_bytes == b_other + b_exp  # every expert: what a long step reads
    fixed = b_other + model.norm_bytes + model.head_bytes
    reads = {}
    for t in (1, 32):
        step = model.step(t, 0, 0)  # no sampling, no attention: the projections alone
        assert step.flops == 2 * t * (n_other + n_exp * k / e)
        assert step.weight_bytes == pytest.approx(fixed + b_exp * (1 - (1 - k / e) ** t))
        assert step.act_bytes == 2 * t * sum(2 * 64 + w for w in MOE_WIDTHS[arch]) * 4
        reads[t] = step.weight_bytes
    assert reads[1] == pytest.approx(fixed + b_exp * k / e)
    assert reads[1] < reads[32] < fixed + b_exp
    assert model.step(4096, 0, 0).weight_bytes == pytest.approx(fixed + b_exp)


def test_dense_model_counts_every_projection_every_step(tiny_llama_dir):
    """No experts: every projection read whole and used by every token, at any batch."""
    net = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"),
                     TorchPagedAttention.for_model).model
    cfg = net.config
    experts, others = _projections(net)
    n, b = _size(others)
    model = WorkModel(net, kv_bytes_per_token=0)
    assert experts == [] and model.expert_bytes == {} and model.params == n
    for t in (1, 32):
        step = model.step(t, 0, 0)
        assert step.flops == 2 * t * n
        assert step.weight_bytes == b + model.norm_bytes + model.head_bytes
        assert step.act_bytes == 2 * t * cfg.num_layers * (2 * cfg.hidden_size +
                                                           cfg.intermediate_size) * 4


@pytest.mark.parametrize(("quantization", "dtype", "expected"), [
    pytest.param("int8", "float32", "int8", marks=needs_kernels),
    pytest.param("int4", "bfloat16", "int8", marks=needs_kernels),
    ("none", "float32", "fp32"),
    ("none", "bfloat16", "bf16")])
def test_roof_chosen_by_arithmetic(tiny_llama_dir, quantization, dtype, expected):
    model, _ = loaded(tiny_llama_dir, quantization, dtype)
    weights_only = model.step(4, 1, 0)  # no attention: the projections and the head alone
    assert set(weights_only.flops_by) == {expected}
    p = Point("prefill", 1.0, weights_only, MACHINE)
    assert p.ceiling_gflops == pytest.approx(MACHINE.ceiling(expected))
    assert p.arithmetic == expected


@needs_kernels
def test_mixed_model_gets_the_flop_weighted_ceiling(tiny_llama_dir):
    """Quantized projections with a bf16 LM head (and bf16 attention): the compute time is
    each part's FLOPs over its own ceiling."""
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="int8", num_kv_blocks=64)
    net = llm.engine.local_core.runner.model
    net.lm_head.packed = None  # torch's F.linear on the bf16 weight
    assert roofline.arithmetic_of(net.lm_head, torch.bfloat16) == "bf16"
    assert isinstance(net.layers[0].mlp.down_proj.packed, QuantizedWeight)
    cost = cost_model(llm.engine).prefill(8)
    int8, bf16 = cost.flops_by["int8"], cost.flops_by["bf16"]
    assert int8 > 0 and bf16 > 0 and set(cost.flops_by) == {"int8", "bf16"}
    p = Point("prefill 8", 1.0, cost, MACHINE)
    assert p.ceiling_time == pytest.approx(int8 / 400e9 + bf16 / 200e9)
    assert 200.0 < p.ceiling_gflops < 400.0
    assert p.arithmetic.startswith("int8 ") and "+bf16 " in p.arithmetic


def test_points_against_their_roofs():
    machine = Machine(torch.float32, 1, {"fp32": {"matmul": 100.0}}, {"sum": 10.0})
    mem = Point("decode", 0.004, StepWork({"fp32": 1e6}, 2e7, 0, 0), machine)  # floor 2 ms
    assert mem.bound == "memory" and "50.0% of its bandwidth floor" in mem.row()
    comp = Point("prefill", 0.004, StepWork({"fp32": 2e8}, 1e6, 0, 0), machine)  # 2 ms
    assert comp.bound == "compute" and "50.0% of its compute ceiling" in comp.row()
    assert mem.warning() is None and comp.warning() is None


@needs_kernels
def test_synthetic_timings_sit_at_or_below_their_roofs(tiny_llama_dir):
    model, _ = loaded(tiny_llama_dir, "int4")
    costs = [model.decode(b, 24) for b in (1, 8, 64, 512)] + [model.prefill(256)]
    for i, cost in enumerate(costs):
        roof = Point("x", 1.0, cost, MACHINE).roof_time
        for slack in (1.0, 1.5, 4.0):
            p = Point(f"step {i}", roof * slack, cost, MACHINE)
            gflops, gbs = cost.flops / p.seconds / 1e9, cost.bytes / p.seconds / 1e9
            assert p.achieved <= 1 + 1e-12 and p.warning() is None
            assert gflops <= p.ceiling_gflops * (1 + 1e-9) and gbs <= 10.0 * (1 + 1e-9)
    # on a machine of 4 FLOP a byte, decode of this tiny model (~12 FLOP a byte from batch
    # 1, KV and activations included) turns compute-bound as the batch grows
    slow = Machine(torch.float32, 1, {"int8": {"k": 40.0}, "fp32": {"k": 40.0}}, {"s": 10.0})
    ridge = model.ridge_batch(slow, 24)
    assert ridge is not None and Point("r", 1, model.decode(ridge, 24), slow).bound == "compute"
    assert ridge == 1 or Point("r", 1, model.decode(ridge - 1, 24), slow).bound == "memory"


def test_a_point_above_its_roof_is_flagged():
    cost = StepWork({"fp32": 1e6}, 2e7, 0, 0)  # floor 2 ms at 10 GB/s
    fast = Point("decode b=1", 0.0015, cost, MACHINE)
    assert fast.achieved > 1
    lines = roofline.table([Point("decode b=2", 0.004, cost, MACHINE), fast])
    warnings = [ln for ln in lines if ln.startswith("WARNING")]
    assert len(warnings) == 1 and "decode b=1" in warnings[0]
    assert "133.3% of its bandwidth floor" in warnings[0] and "under-measured" in warnings[0]
    assert "ABOVE ITS ROOF" in fast.row()


def test_ceilings_json():
    d = json.loads(json.dumps(ceilings.ceilings_json(MACHINE)))
    assert d["compute_gflops"]["fp32"] == {"ceiling": 100.0,
                                           "methods": {"matmul": 100.0, "dense_linear": 80.0}}
    assert d["bandwidth_gbs"]["best"] == 10.0 and d["threads"] == 2
    assert d["activations"] == "float32"


def small_machine(dtype: torch.dtype, repeats: int, measure=ceilings.measure_machine
                  ) -> Machine:
    """Every figure over tensors of a few MiB: quick, and meaningless as a measurement."""
    return measure(dtype, repeats, matmul_n=64, rows=16, read_bytes=1 << 22)


def test_measure_machine_reports_every_method():
    m = small_machine(torch.bfloat16, 1)
    assert {"bf16", "fp32"} <= set(m.compute) and m.threads == torch.get_num_threads()
    if kernels.quant_kernels(torch.bfloat16, "cpu", 64, 64) is not None:
        assert len(m.compute["int8"]) == 2  # 8- and 4-bit weights
        assert any("quant_linear 4-bit GEMV" in k for k in m.bandwidth)
    assert any(k.startswith("sum") for k in m.bandwidth) and len(m.bandwidth) >= 3
    assert all(v > 0 for methods in m.compute.values() for v in methods.values())
    assert m.read_gbs == max(m.bandwidth.values())
    if kernels.gguf_kernels(torch.bfloat16, "cpu", [12]) is not None:  # Q4_K
        # the kernel a GGUF model's steps run: a roof, so prefill is not drawn above it
        assert any("gguf_linear Q4_K GEMV" in k for k in m.bandwidth)
        int8 = measure_compute(torch.bfloat16, 1, n=256, rows=16)["int8"]
        assert int8[next(k for k in int8 if "gguf_linear Q4_K 16x256x256" in k)] > 0


@pytest.mark.slow
def test_roofline_command(tiny_llama_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "measure_machine", small_machine)
    png = tmp_path / "roofline.png"
    rc = main(["roofline", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--batches", "1,2", "--prefill", "16", "--steps", "2", "--repeats", "1",
               "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "matmul" in out and "GB/s" in out and "fp32  ceiling" in out
    for name in ("decode b=1", "decode b=2", "prefill 16"):
        assert name in out
    assert "turns compute-bound at batch" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and f"plot written to {png}" in out


@pytest.mark.parametrize("bad", [["--batches", "1,x"], ["--batches", "0"], ["--steps", "0"]])
def test_roofline_bad_arguments(tiny_llama_dir, capsys, bad):
    assert main(["roofline", "--model", str(tiny_llama_dir), *bad]) == 2
    assert "kvserve: error:" in capsys.readouterr().err
