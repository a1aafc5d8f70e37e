"""gpt-oss (issue 41): a tiny random model built with transformers' own GptOssForCausalLM,
served from its Hugging Face directory and from a GGUF written here in llama.cpp's layout
(float experts, and MXFP4 experts), against transformers on the same weights. What it adds to
the other mixtures of experts: a router with a bias and a softmax over the chosen experts'
logits, experts with biases and a clamped SwiGLU, attention sinks, biases on the attention's
output, alternating sliding-window and full layers, and YaRN RoPE."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvserve import kernels
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.config import RopeScaling
from kvserve.layers import quant
from kvserve.layers.quant import GGUFWeight
from kvserve.layers.rotary import inverse_frequencies
from kvserve.models.loader import load_model, read_model_config
from kvserve.models.moe import SparseMoE, route
from tests.conftest import make_llm
from tests.test_gguf import write_shape, write_tokens
from tests.test_model import paged_logits
from tests.test_moe import (
    _backend,
    _hf_logits,
    _module_path_logits,
    add_gguf_tensor,
    assert_greedy_is_the_references,
    assert_requests_run_as_alone,
    assert_tp2_greedy_matches_one_process,
    save_random_checkpoint,
)

IDS = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(3)).tolist()
WINDOW = 8  # the sliding layers' window: far shorter than the prompts
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def build_tiny_gpt_oss(root: Path, seed: int = 0) -> Path:
    """A random gpt-oss checkpoint of 4 layers (sliding, full, sliding, full), 64 wide, 8
    experts of 64 features, top 2, heads of 16, YaRN stretching an original context of 128
    by 4 (ramp ends unrounded, as gpt-oss's own config says). Weights drawn at 0.2, biases
    at 0.1, sinks at 1, all rounded to float16 values (exact in an F16 GGUF)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 150000.0})
    torch.manual_seed(seed)
    return save_random_checkpoint(GptOssForCausalLM(config), root, seed)


def write_gpt_oss_gguf(hf_dir: Path, out: Path,
                       experts: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
                       ) -> None:
    """The checkpoint as llama.cpp's converter lays gpt-oss out: gate and up de-interleaved
    into ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I] in `experts`'
    type, their biases [E, I] and [E, H]; the router ffn_gate_inp with its bias; attn_sinks;
    the MLP's input norm as post_attention_norm; YaRN's type, factor and original context;
    no SwiGLU constants and no gating function (llama.cpp's graph hard-codes them). Every
    other tensor F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k.removeprefix("model."): v.float().numpy()
          for k, v in load_file(hf_dir / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    rope = write_shape(w, cfg)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    write_tokens(w, cfg["vocab_size"])

    def add(name: str, arr: np.ndarray, kind=gguf.GGMLQuantizationType.F32) -> None:
        add_gguf_tensor(w, name, arr, kind)

    add("token_embd.weight", sd["embed_tokens.weight"])
    add("output_norm.weight", sd["norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    attn = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf, ours in attn.items():
            for what in ("weight", "bias"):
                add(f"blk.{i}.{ours}.{what}", sd[f"{p}self_attn.{hf}.{what}"])
        add(f"blk.{i}.attn_sinks.weight", sd[p + "self_attn.sinks"])
        add(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.router.weight"])
        add(f"blk.{i}.ffn_gate_inp.bias", sd[p + "mlp.router.bias"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, H]
        gate_up_bias = sd[p + "mlp.experts.gate_up_proj_bias"]
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, 0::2], experts)
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2], experts)
        add(f"blk.{i}.ffn_down_exps.weight",
            sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1), experts)
        add(f"blk.{i}.ffn_gate_exps.bias", gate_up_bias[:, 0::2])
        add(f"blk.{i}.ffn_up_exps.bias", gate_up_bias[:, 1::2])
        add(f"blk.{i}.ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory) -> Path:
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))


def _reference(path: Path, experts_from: Path | None = None):
    """transformers' model of `path`; with `experts_from` (a GGUF), its experts replaced by
    gguf's own dequantization of the file's expert stacks (an independent reading of the
    file's MXFP4 blocks)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if experts_from is not None:
        reader = gguf.GGUFReader(str(experts_from))
        stacks = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
                  for t in reader.tensors if "_exps.weight" in t.name}
        params = dict(ref.named_parameters())
        with torch.no_grad():
            for i in range(ref.config.num_hidden_layers):
                gate_up = params[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, H, 2I]
                gate_up[:, :, 0::2] = stacks[f"blk.{i}.ffn_gate_exps.weight"].transpose(1, 2)
                gate_up[:, :, 1::2] = stacks[f"blk.{i}.ffn_up_exps.weight"].transpose(1, 2)
                params[f"model.layers.{i}.mlp.experts.down_proj"].copy_(
                    stacks[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2))
    return ref


# ------------------------------------------------------------------------- configuration


def test_config_from_the_checkpoint_and_from_gguf(oss_dir, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gpt_oss_gguf(oss_dir, path)
    hf, gg = read_model_config(oss_dir), read_model_config(path)
    for cfg in (hf, gg):
        assert cfg.architecture == "gpt-oss"
        assert cfg.layer_windows == (WINDOW, 0, WINDOW, 0)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
        assert (cfg.moe_gating, cfg.moe_bias, cfg.attention_sinks, cfg.o_bias, cfg.qkv_bias) \
            == ("topk_softmax", True, True, True, True)
        assert (cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)
        assert cfg.dense_layers == () and not cfg.tie_word_embeddings
    assert hf.rope_scaling == gg.rope_scaling
    assert hf.rope_scaling.kind == "yarn" and not hf.rope_scaling.truncate
    assert hf.rope_scaling.attn_factor == pytest.approx(1 + 0.1 * math.log(4.0))


def test_yarn_frequencies_are_transformers(oss_dir):
    """The inverse frequencies and cos/sin scale bit for bit as transformers computes them,
    with the ramp's ends rounded and not."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(oss_dir)
    for truncate in (False, True):
        hf.rope_parameters["truncate"] = truncate
        want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = read_model_config(oss_dir).rope_scaling
        ours = RopeScaling(**{**ours.__dict__, "truncate": truncate})
        assert torch.equal(inverse_frequencies(16, 150000.0, ours), want)
        assert ours.attn_factor == pytest.approx(scale)
    # With an original context of 128, only dimension 0 turns more than 32 times in it
    # (kept); those from 3 on turn less than once (divided by the factor); 1 and 2 blend.
    plain = inverse_frequencies(16, 150000.0, RopeScaling())
    yarn = inverse_frequencies(16, 150000.0, ours)
    assert yarn[0] == plain[0] and torch.allclose(yarn[3:], plain[3:] / 4)
    assert (plain[1:3] / 4 < yarn[1:3]).all() and (yarn[1:3] < plain[1:3]).all()


def test_routing_softmax_over_the_chosen_logits():
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0]])
    weights, ids = route(logits, 2, normalize=True, gating="topk_softmax")
    assert ids.tolist() == [[1, 3], [0, 1]]  # ties to the lower id, in id order
    torch.testing.assert_close(weights[0], torch.tensor([3.0, 2.0]).softmax(-1), rtol=0,
                               atol=0)
    assert weights[1].tolist() == [0.5, 0.5]
    if kernels.ops() is not None:  # run_layers' router: the same bits
        w2, i2 = kernels.ops().moe_route(logits, 2, True, True)
        assert torch.equal(w2, weights) and torch.equal(i2, ids)
        wide = torch.randn(33, 32, generator=torch.Generator().manual_seed(0))
        w2, i2 = kernels.ops().moe_route(wide, 4, True, True)
        w1, i1 = route(wide, 4, True, "topk_softmax")
        assert torch.equal(w2, w1) and torch.equal(i2, i1)


# ------------------------------------------------------------------------ attention sinks


def _sink_reference(q, k, v, sinks, scale, window):
    """Causal attention of one sequence, q [T, H, D] over k/v [T, Hkv, D], in float64, with a
    sink logit per head joining each softmax."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    kk, vv = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    full = torch.cat((scores, sinks.double().view(h, 1, 1).expand(h, t, 1)), dim=-1)
    return torch.einsum("hts,shd->thd", full.softmax(-1)[..., :-1], vv)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kernel", [True, False])
def test_attention_with_sinks(window, kernel, monkeypatch):
    """The paged kernel and torch's path against a float64 reference, the prompt whole and
    then a decode row; a sink of -inf is no sink (the kernel's bits unchanged)."""
    if kernel and kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    if not kernel:
        monkeypatch.setattr(kernels, "attention_kernels", lambda *a, **k: None)
    from kvserve.attention.backend import AttentionBatch

    g = torch.Generator().manual_seed(window)
    t, h, hkv, d, bs = 23, 4, 2, 16, 4
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, hkv, hkv))
    sinks = 2 * torch.randn(h, generator=g)
    attn = TorchPagedAttention(h, hkv, d)
    blocks = list(reversed(range(8)))
    cache = torch.zeros(attn.kv_cache_shape(8 * bs))

    def run(rows: range, sink):
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in rows])
        meta = attn.build_metadata(AttentionBatch([len(rows)], [rows.stop], [blocks], slots, bs))
        return attn.forward(q[rows.start:rows.stop], k[rows.start:rows.stop],
                            v[rows.start:rows.stop], cache, meta, window, sink)

    got = torch.cat((run(range(0, t - 1), sinks), run(range(t - 1, t), sinks)))
    want = _sink_reference(q, k, v, sinks, d ** -0.5, window).reshape(t, -1).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    none = torch.full((h,), float("-inf"))
    plain = run(range(0, t), None)
    assert torch.equal(run(range(0, t), none), plain) if kernel else \
        torch.allclose(run(range(0, t), none), plain, atol=1e-6)


# -------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_tiny_gpt_oss_matches_transformers(oss_dir, tmp_path, source):
    """Every position, the prompt whole, token by token and in mixed chunks; the weights as
    loaded (torch's matmuls) and packed for kvserve's kernels (--quantization none); from the
    checkpoint and from a GGUF with F32 experts."""
    path = oss_dir
    if source == "gguf":
        path = tmp_path / "tiny.gguf"
        write_gpt_oss_gguf(oss_dir, path)
    ours = load_model(path, torch.float32, torch.device("cpu"), _backend).model
    assert isinstance(ours.layers[0].mlp, SparseMoE)
    expected = _hf_logits(_reference(oss_dir), IDS)
    for chunks in ([37], [1] * 37, [10, 17, 1, 9]):
        torch.testing.assert_close(paged_logits(ours, IDS, chunks, "cpu"), expected,
                                   atol=1e-4, rtol=1e-4)
    ours.pack_("none")
    torch.testing.assert_close(paged_logits(ours, IDS, [10, 27], "cpu"), expected,
                               atol=1e-4, rtol=1e-4)


def test_mxfp4_experts_match_their_dequantization(oss_dir, tmp_path):
    """MXFP4 experts: loaded as views of the file's blocks (no float copy), their floats
    matching transformers with its experts replaced by gguf's dequantization of those blocks
    (within 1e-4); read in place by gguf_linear under --quantization gguf, alone and all at
    once on gguf_grouped, close to the float model (int8 activations)."""
    path = tmp_path / "tiny-mxfp4.gguf"
    write_gpt_oss_gguf(oss_dir, path, MXFP4)
    floats, in_place = (load_model(path, torch.float32, torch.device("cpu"), _backend).model
                        for _ in range(2))
    expert = floats.layers[0].mlp.experts[1]
    assert {t.kind for t in expert.gate_up_proj.gguf_tensors.values()} == {"MXFP4"}
    ref = paged_logits(floats, IDS, [10, 27], "cpu")
    expected = _hf_logits(_reference(oss_dir, experts_from=path), IDS)
    torch.testing.assert_close(ref, expected, atol=1e-4, rtol=1e-4)
    in_place.pack_("gguf")
    for layer in in_place.layers:
        for e in layer.mlp.experts:
            for m in (e.gate_up_proj, e.down_proj):
                assert isinstance(m.packed, GGUFWeight) and set(m.packed.kinds) == {"MXFP4"}
                assert m.weight.numel() == 0
    if kernels.ops() is not None:
        assert all(layer.moe.grouped for layer in in_place.fused_weights().layers)
    # int8 activations; a token whose router's top choices nearly tie may take another
    # expert, so the bound is on the typical error, not the largest
    got = paged_logits(in_place, IDS, [10, 27], "cpu")
    err = (got - ref).abs().mean() / ref.abs().mean()
    assert err < 0.05, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    if kernels.ops() is None or not quant.gguf_auto_types():
        return
    # auto: the experts interleaved at load (MXFP4x8), the file's bits on other layouts
    auto = load_model(path, torch.float32, torch.device("cpu"), _backend).model
    auto.pack_("auto")
    experts = [m.packed for layer in auto.layers for e in layer.mlp.experts
               for m in (e.gate_up_proj, e.down_proj)]
    assert all(isinstance(p, GGUFWeight) and p.interleaved == [True] * len(p.kinds)
               for p in experts)
    n = sum(len(p.kinds) for p in experts)
    assert f"{n} MXFP4 tensors, {n} of them interleaved at load" in auto.weight_kernel()
    same = [(a.packed, b.packed) for a, b in zip(auto.modules(), in_place.modules(),
                                                 strict=True)
            if isinstance(getattr(a, "packed", None), GGUFWeight)]
    assert same and any(True in a.interleaved for a, _ in same)
    gen = torch.Generator().manual_seed(0)
    for interleaved, read_in_place in same:
        x = torch.randn(5, interleaved.k, generator=gen)
        assert torch.equal(interleaved.matmul(x), read_in_place.matmul(x))


def test_greedy_continuations_equal_transformers(oss_dir):
    """The engine (weights packed, the layers in the C++ loop) against transformers' argmax,
    token by token, past the sliding window."""
    llm = make_llm(oss_dir)
    if kernels.ops() is not None:
        fused = llm.engine.local_core.runner.model.fused_weights()
        assert all(layer.moe.top_k == 2 for layer in fused.layers)
    assert_greedy_is_the_references(llm, _reference(oss_dir), [IDS[:9], IDS[5:30]])


# ------------------------------------------------------------------ the C++ layer loop


@pytest.mark.parametrize("form", ["none", "bf16", "mxfp4"])
def test_layer_loop_is_the_module_path(oss_dir, tmp_path, form):
    """run_layers (sinks, biases, the clamped SwiGLU, the router's softmax over its choice)
    gives the modules' logits bit for bit, prompt whole and chunked; MXFP4 experts all at
    once on gguf_grouped where gguf_linear reads the type."""
    if kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    if form == "mxfp4":
        path = tmp_path / "tiny-mxfp4.gguf"
        write_gpt_oss_gguf(oss_dir, path, MXFP4)
        model = load_model(path, dtype, torch.device("cpu"), _backend).model
        model.pack_("gguf")
    else:
        model = load_model(oss_dir, dtype, torch.device("cpu"), _backend).model
        model.pack_("none")
    want = _module_path_logits(model, [37], IDS)
    for chunks in ([37], [1] * 5 + [32], [10, 17, 1, 9]):
        assert torch.equal(paged_logits(model, IDS, chunks, "cpu"),
                           want if chunks == [37] else _module_path_logits(model, chunks, IDS))


def test_requests_are_independent_of_their_batch(oss_dir, tmp_path):
    """Each request's tokens and logprobs, bit for bit, as it gives alone: batched, chunked,
    prefix-cache hits, preemption, n-gram speculation; greedy and seeded."""
    assert_requests_run_as_alone(str(oss_dir), tmp_path, seed=11, count=6, step=5,
                                 max_tokens=14,
                                 runs=((8, 14, True, None), (16, 24, True, "ngram")))


@pytest.mark.slow
def test_tp2_greedy_matches_one_process(oss_dir):
    """Two gloo ranks (each with half the query heads and their sinks, every expert cut by its
    features, the experts' down bias added once) give one process's greedy tokens, prompts
    chunked over 16-token steps beside decodes."""
    assert_tp2_greedy_matches_one_process(oss_dir, IDS, "none")


def test_mxfp4_blocks_in_a_checkpoint_are_refused_clearly(oss_dir, tmp_path):
    """OpenAI's own checkpoints hold the experts as MXFP4 `*_blocks` / `*_scales` tensors,
    which kvserve does not read from safetensors: the load says what to serve instead."""
    import shutil

    from safetensors.torch import save_file

    hf = tmp_path / "mxfp4-hf"
    shutil.copytree(oss_dir, hf)
    sd = load_file(hf / "model.safetensors")
    sd["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(8, 128, 2, 16,
                                                                        dtype=torch.uint8)
    save_file(sd, hf / "model.safetensors")
    with pytest.raises(ValueError, match="MXFP4 blocks .* serve the model's GGUF"):
        load_model(hf, torch.float32, torch.device("cpu"), _backend)
