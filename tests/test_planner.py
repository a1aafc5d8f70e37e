"""The KV memory planner: figures by hand, agreement with the engine, and `kvserve plan`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import CacheConfig
from kvserve.engine.llm import LLM
from kvserve.entrypoints import cli
from kvserve.kv_cache.planner import (
    gpu_kv_budget,
    kv_bytes_per_token,
    kv_token_bytes,
    param_count,
    plan_kv,
    plan_num_blocks,
    weight_bytes,
)
from kvserve.models.hf_dir import hf_model_config
from kvserve.models.loader import load_model, read_model_config
from tests.conftest import parsed_gguf
from tests.test_kv_int8 import SMOLLM2


def test_default_model_figures_by_hand():
    # layers x 2 (K, V) x KV heads x head dim x bytes (+ 2 scale bytes per int8 row)
    assert kv_bytes_per_token(SMOLLM2, "auto", torch.bfloat16) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(SMOLLM2, "auto", torch.float32) == 46080
    for compute in (torch.bfloat16, torch.float32):
        assert kv_bytes_per_token(SMOLLM2, "int8", compute) == 2 * 30 * 3 * 66 == 11880
    assert kv_token_bytes(SMOLLM2, "int8", torch.bfloat16).breakdown() == (
        "30 layers x 2 (K,V) x 3 KV heads x (64 x 1 B + 2 B scale) = 11880 B")
    assert kv_token_bytes(SMOLLM2, "auto", torch.bfloat16).breakdown() == (
        "30 layers x 2 (K,V) x 3 KV heads x 64 x 2 B = 23040 B")
    # embeddings (tied) + 30 x (q, k, v, o, gate, up, down, 2 norms) + final norm
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3 + 2 * 576
    assert param_count(SMOLLM2) == 49152 * 576 + 30 * per_layer + 576 == 134_515_008
    assert weight_bytes(SMOLLM2, torch.bfloat16) == 2 * 134_515_008
    plan = plan_kv(SMOLLM2, 2 << 30, 16, "int8", torch.bfloat16, 1024 + 128)
    assert plan.num_blocks == (2 << 30) // (16 * 11880) == 11297
    assert plan.blocks_per_seq == 72 and plan.max_seqs == 11297 // 72 == 156
    assert plan.kv_bytes <= 2 << 30
    biased = dataclasses.replace(SMOLLM2, qkv_bias=True)
    assert param_count(biased) == param_count(SMOLLM2) + 30 * (576 + 2 * 192)
    untied = dataclasses.replace(SMOLLM2, tie_word_embeddings=False)
    assert param_count(untied) == param_count(SMOLLM2) + 49152 * 576


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_block_count_equals_the_plan(tiny_llama_dir, kv, dtype):
    llm = LLM(str(tiny_llama_dir), dtype=dtype, kv_cache_memory="1MiB", kv_cache_dtype=kv)
    engine = llm.engine
    compute = getattr(torch, dtype)
    cfg = hf_model_config(tiny_llama_dir)
    plan = plan_kv(cfg, 1 << 20, 16, kv, compute, 64)
    assert engine.local_core.runner.num_blocks == engine.local_core.kv.num_blocks == plan.num_blocks
    assert plan.num_blocks == plan_num_blocks(cfg, CacheConfig(16, 1 << 20, kv_cache_dtype=kv),
                                              compute)
    # what is allocated is exactly what was planned, within the budget
    allocated = sum(t.numel() * t.element_size() for t in engine.local_core.runner.kv_caches)
    assert allocated == plan.kv_bytes <= 1 << 20


# untied; tied with qkv biases; q/k norms; sandwich norms
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_param_count_matches_the_loaded_model(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    model = load_model(path, torch.float32, torch.device("cpu"),
                       lambda c: TorchPagedAttention(c.num_heads, c.num_kv_heads, c.head_dim))
    assert param_count(model.config) == sum(p.numel() for p in model.model.parameters())
    assert param_count(read_model_config(path)) == param_count(model.config)


@pytest.mark.real_model
def test_default_model_config_and_param_count(real_model_path):
    cfg = read_model_config(real_model_path)
    assert dataclasses.replace(cfg, name="", rope_theta=SMOLLM2.rope_theta,
                               rms_norm_eps=SMOLLM2.rms_norm_eps) == SMOLLM2
    model = load_model(real_model_path, torch.bfloat16, torch.device("cpu"),
                       lambda c: TorchPagedAttention(c.num_heads, c.num_kv_heads, c.head_dim))
    assert sum(p.numel() for p in model.model.parameters()) == param_count(cfg) == 134_515_008


def test_plan_cli_prints_the_figures(tiny_llama_dir, capsys):
    rc = cli.main(["plan", "--model", str(tiny_llama_dir), "--kv-cache-memory", "1MiB",
                   "--dtype", "float32", "--prompt-len", "40", "--output-len", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    # float32: 2 layers x 2 x 2 KV heads x 16 x 4 B = 512 B; int8: 2 x 2 x 2 x 18 = 144 B
    assert "2 layers x 2 (K,V) x 2 KV heads x 16 x 4 B = 512 B per token" in out
    assert "2 layers x 2 (K,V) x 2 KV heads x (16 x 1 B + 2 B scale) = 144 B per token" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("float32 ", "int8 ")) and line.split()[1].isdigit()}
    # bytes/token, blocks, tokens, ..., sequences of 48 tokens (3 blocks), of 512 (32 blocks)
    assert rows["float32"][1:4] == ["512", "128", "2048"]
    assert rows["int8"][1:4] == ["144", "455", "7280"]
    assert rows["float32"][-2:] == ["42", "4"] and rows["int8"][-2:] == ["151", "14"]
    params = param_count(hf_model_config(tiny_llama_dir))
    assert f"{params:,} parameters" in out
    assert "int8 holds 3.56x the tokens of float32" in out


@pytest.mark.slow
@pytest.mark.real_model
def test_plan_cli_on_the_default_model(real_model_path, capsys):
    assert cli.main(["plan", "--dtype", "bfloat16", "--bandwidth", "10"]) == 0
    out = capsys.readouterr().out
    assert "= 23040 B per token" in out and "= 11880 B per token" in out
    assert "134,515,008 parameters" in out
    assert "int8 holds 1.94x the tokens of bfloat16" in out
    # The weights in place: every matrix (Q4_1, the Q8_0 embedding) counted as its bytes in
    # the file (gguf's own reader); a step reads all of them (the head is tied to the
    # embedding) and the bf16 norms.
    reader = parsed_gguf(real_model_path)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    in_place = sum(int(t.n_bytes) for t in matrices)
    norms = sum(int(t.n_elements) * 2 for t in reader.tensors if len(t.shape) == 1)
    assert {t.tensor_type.name for t in matrices} == {"Q4_1", "Q8_0"}
    mib = 2**20
    assert (f"--quantization gguf: {(in_place + norms) / mib:.1f} MiB ({in_place / mib:.1f} "
            f"MiB of it read in place from the file); a decode step reads "
            f"{(in_place + norms - 576 * 2) / mib:.1f} MiB") in out
    # auto: the layers' int4 tiles (0.625 B a weight), the bf16 embedding, its int8 head copy
    layers = sum(int(t.n_elements) for t in matrices if t.name.startswith("blk."))
    embedding = 49152 * 576
    held = int(layers * 0.625) + embedding * 2 + int(embedding * 1.125) + norms
    assert f"= {held / mib:.1f} MiB as --quantization auto holds them" in out
    # The decode floor: a step's bytes over the bandwidth given (10 GB/s)
    step = in_place + norms - 576 * 2
    assert ("decode floor at 10.0 GB/s (--bandwidth): a batch-1 step" in out
            and f"--quantization gguf {step / 1e7:.1f} ms ({1e10 / step:.1f} tok/s at most)"
            in out)


def test_plan_measures_the_bandwidth_for_the_floor(tiny_llama_dir, capsys):
    assert cli.main(["plan", "--model", str(tiny_llama_dir), "--kv-cache-memory", "1MiB",
                     "--max-model-len", "64", "--prompt-len", "40", "--output-len", "8"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("decode floor at "))
    gbs = float(line.split()[3])
    assert gbs > 0.1 and "threads, measured now" in line, line


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-memory", "lots"], "cannot parse size 'lots'"),
    (["--prompt-len", "500", "--output-len", "100"], "exceeds max_model_len"),
    (["--max-model-len", "100000"], "exceeds the model's context length"),
    (["--prompt-len", "100", "--max-num-batched-tokens", "0"],
     "--max-num-batched-tokens must be >= 1"),
    (["--max-model-len", "64", "--prompt-len", "40", "--output-len", "8", "--bandwidth", "0"],
     "--bandwidth must be > 0"),
])
def test_plan_cli_bad_input(tiny_llama_dir, capsys, args, message):
    assert cli.main(["plan", "--model", str(tiny_llama_dir), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_kv_cache_dtype_flag_is_validated(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert e.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_gpu_budget_is_the_share_left_after_loading():
    gib = 2**30
    # 0.9 of 140 GiB = 126; 20 in use (weights, another process) and 1 kept: 105 left
    assert gpu_kv_budget(140 * gib, 120 * gib, 0.9, gib) == int(0.9 * 140 * gib) - 21 * gib
    with pytest.raises(ValueError, match="in use after loading"):
        gpu_kv_budget(80 * gib, 8 * gib, 0.9, gib)  # 72 in use of 72 allowed, 1 kept


def test_kv_budget_default_by_device(monkeypatch):
    """No --kv-cache-memory: 1 GiB on a CPU; on a GPU (faked: its free and total bytes) what
    --gpu-memory-utilization leaves; an explicit size wins on either."""
    from kvserve.engine.startup import kv_cache_budget

    gib = 2**30
    assert kv_cache_budget(None, torch.device("cpu"), 0.9) == gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cuda = torch.device("cuda")
    assert kv_cache_budget(None, cuda, 0.5) == 40 * gib - 21 * gib
    assert kv_cache_budget(2 * gib, cuda, 0.5) == 2 * gib
