"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): tiny random models built with
transformers' own classes, served from their Hugging Face directories and from GGUF files
written here, against transformers on the same weights; the C++ layer loop (run_layers'
moe_mlp) against the torch modules bit for bit; routing and determinism; experts cut across
tensor-parallel ranks. gpt-oss: tests/test_gpt_oss.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvserve import kernels
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.distributed.parallel import TensorParallel
from kvserve.kv_cache.planner import param_count
from kvserve.layers.quant import GGUFTensor, GGUFWeight, QuantizedWeight
from kvserve.models.loader import build_model, load_model, read_model_config
from kvserve.models.moe import SparseMoE, experts_read, route
from kvserve.sample.sampling_params import SamplingParams
from tests.conftest import TINY_CHAT_TEMPLATE, byte_level_tokenizer_json, make_llm
from tests.test_determinism import (
    Alone,
    _property,
    engine_args,
    run_workload,
)
from tests.test_gguf import _permute, _random_blocks, write_shape, write_tokens
from tests.test_model import paged_logits

ARCHS = ("qwen3moe", "qwen2moe", "mixtral")
IDS = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()


def _backend(c):
    return TorchPagedAttention.for_model(c)


def build_tiny_moe(root: Path, arch: str, seed: int = 0, hidden: int = 64,
                   experts_size: int = 64) -> Path:
    """A random MoE checkpoint (config.json + safetensors + tokenizer) of 2 layers, `hidden`
    wide, experts of `experts_size` features (dense and shared MLPs of twice that), top-2
    routing. qwen3moe: 8
    experts, q/k norms, weights renormalized; qwen2moe: 4 experts plus a shared expert,
    layer 1 dense (mlp_only_layers), qkv biases, weights not renormalized; mixtral: 8
    experts. Weights drawn at 0.2 (peaked logits, as conftest's tiny models) and rounded to
    float16 values, so that an F16 GGUF of them is exact."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=320, hidden_size=hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=1, num_experts_per_tok=2)
    torch.manual_seed(seed)
    if arch == "qwen3moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=2 * experts_size,
            moe_intermediate_size=experts_size, num_experts=8, norm_topk_prob=True))
    elif arch == "qwen2moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, intermediate_size=2 * experts_size, moe_intermediate_size=experts_size,
            num_experts=4, shared_expert_intermediate_size=2 * experts_size,
            mlp_only_layers=[1], norm_topk_prob=False))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=experts_size,
                                                 num_local_experts=8))
    else:
        raise ValueError(f"no tiny {arch} model")
    return save_random_checkpoint(model, root, seed)


def save_random_checkpoint(model, root: Path, seed: int) -> Path:
    """`model` (a transformers model) with every parameter redrawn, routers too (transformers
    zeroes them): norms 1 + N(0, 0.1), biases N(0, 0.1), attention sinks N(0, 1), the rest
    N(0, 0.2) (peaked logits, as conftest's tiny models), all rounded to float16 values (so an
    F16 GGUF of them is exact); saved to `root` with a byte-level tokenizer and the tiny chat
    template."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                new = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith("sinks"):
                new = torch.randn(p.shape, generator=g)
            elif "bias" in name:
                new = 0.1 * torch.randn(p.shape, generator=g)
            else:
                new = 0.2 * torch.randn(p.shape, generator=g)
            p.copy_(new.half().float())
    model.save_pretrained(root, safe_serialization=True)
    (root / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    return {arch: build_tiny_moe(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
            for arch in ARCHS}


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


# ------------------------------------------------------------------------------- routing


def test_routing_ties_go_to_the_lower_expert_id():
    """Equal probabilities: the lowest ids win, whatever else is in the batch."""
    weights, ids = route(torch.zeros(3, 8), 2, normalize=True)
    assert ids.tolist() == [[0, 1]] * 3
    assert torch.equal(weights, torch.full((3, 2), 0.5))
    # one clear winner (id 5), then a three-way tie among 1, 4 and 6: 1 is taken
    row = torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0, 3.0, 2.0, 0.0]])
    _, ids = route(row, 2, normalize=False)
    assert ids.tolist() == [[1, 5]]  # in id order (the order outputs are summed in)
    _, ids = route(row, 3, normalize=False)
    assert ids.tolist() == [[1, 4, 5]]
    # the same row among others routes the same
    batch = torch.cat([torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), row])
    assert route(batch, 3, normalize=False)[1][-1].tolist() == [1, 4, 5]


def test_routing_weights_follow_the_models_normalization():
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0]])
    probs = logits.softmax(-1)[0]
    weights, ids = route(logits, 2, normalize=False)  # Qwen2-MoE's default: the softmax's
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights[0], probs[[1, 3]])
    weights, _ = route(logits, 2, normalize=True)  # Mixtral, norm_topk_prob
    torch.testing.assert_close(weights[0], probs[[1, 3]] / probs[[1, 3]].sum())
    assert weights.dtype == torch.float32


def test_experts_read_is_the_expected_share_under_uniform_routing():
    """One token reads its k of E; T tokens 1 - (1 - k/E)^T, nearing all of them; k = E
    reads every expert at any batch, no tokens none."""
    assert experts_read(8, 2, 1) == 0.25 and experts_read(128, 8, 1) == 8 / 128
    assert experts_read(8, 2, 2) == pytest.approx(1 - 0.75 * 0.75)  # 2 of 8 twice: 7/16
    assert experts_read(8, 2, 32) == pytest.approx(1 - 0.75**32)
    shares = [experts_read(128, 8, t) for t in (1, 2, 8, 32, 256)]
    assert shares == sorted(shares) and shares[-1] < 1
    assert experts_read(128, 8, 1000) == pytest.approx(1, abs=1e-12)
    assert experts_read(8, 8, 1) == experts_read(8, 8, 32) == 1.0
    assert experts_read(8, 2, 0) == 0.0
    for bad in ((8, 0, 1), (8, 9, 1), (8, 2, -1)):
        with pytest.raises(ValueError):
            experts_read(*bad)


# ------------------------------------------------------------------ configs and refusals


def test_configs_read_from_the_checkpoints(moe_dirs):
    q3, q2, mx = (read_model_config(moe_dirs[a]) for a in ARCHS)
    assert (q3.architecture, q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size,
            q3.norm_topk_prob, q3.qk_norm, q3.dense_layers) == ("qwen3moe", 8, 2, 64, True,
                                                                True, ())
    assert (q2.architecture, q2.num_experts, q2.shared_expert_intermediate_size,
            q2.norm_topk_prob, q2.qkv_bias, q2.dense_layers, q2.intermediate_size) == (
        "qwen2moe", 4, 128, False, True, (1,), 128)
    assert [q2.sparse(i) for i in range(2)] == [True, False]
    assert (mx.architecture, mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob) == (
        "llama", 8, 64, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_counts_every_expert(moe_dirs, arch):
    """kvserve plan's count: the module's parameters, and transformers' model's."""
    cfg = read_model_config(moe_dirs[arch])
    model = build_model(cfg, torch.float32, _backend)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert param_count(cfg) == sum(p.numel() for p in _reference(moe_dirs[arch]).parameters())


def test_experts_are_cut_by_their_features_across_ranks(moe_dirs):
    """Under tensor parallelism each rank holds every expert (and a shared expert) cut by
    intermediate features, as a dense MLP is, and the router and shared gate whole."""
    cfg = read_model_config(moe_dirs["qwen2moe"])
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    for rank in (0, 1):
        moe = SparseMoE(cfg, TensorParallel(rank=rank, size=2))
        assert len(moe.experts) == cfg.num_experts
        for mlp, width in [(e, inter) for e in moe.experts] + [(moe.shared_expert, shared)]:
            assert mlp is not None
            assert tuple(mlp.gate_up_proj.weight.shape) == (2 * (width // 2), cfg.hidden_size)
            assert tuple(mlp.down_proj.weight.shape) == (cfg.hidden_size, width // 2)
        assert moe.router.weight.shape[0] == cfg.num_experts and moe.shared_gate is not None


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "quantization"),
                         [(a, "none") for a in ARCHS] + [("qwen2moe", "int8")])
def test_tp2_greedy_matches_one_process(moe_dirs, arch, quantization):
    """Two gloo ranks, experts cut by their features, give one process's greedy tokens
    (float32; int8 experts, a shard scaled by its whole rows as one process scales them),
    prompts chunked over 16-token steps beside decodes."""
    assert_tp2_greedy_matches_one_process(moe_dirs[arch], IDS, quantization)


def assert_tp2_greedy_matches_one_process(model: Path, ids: list[int], quantization: str
                                          ) -> None:
    """Greedy tokens of three prompts cut from `ids`, chunked over 16-token steps beside
    decodes, equal on one process and on two gloo ranks."""
    prompts = [ids[:9], ids[3:37], ids[20:25]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for size in (1, 2):
        with make_llm(model, tensor_parallel_size=size, quantization=quantization,
                      max_num_batched_tokens=16) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


# ------------------------------------------------------------ against transformers (HF dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_moe_matches_transformers(moe_dirs, arch):
    """Every position, the prompt whole, token by token and in mixed chunks; the weights as
    loaded (torch's matmuls) and packed for kvserve's kernels (--quantization none)."""
    ours = load_model(moe_dirs[arch], torch.float32, torch.device("cpu"), _backend).model
    assert isinstance(ours.layers[0].mlp, SparseMoE)
    expected = _hf_logits(_reference(moe_dirs[arch]), IDS)
    for chunks in ([37], [1] * 37, [10, 17, 1, 9]):
        torch.testing.assert_close(paged_logits(ours, IDS, chunks, "cpu"), expected,
                                   atol=1e-4, rtol=1e-4)
    ours.pack_("none")
    torch.testing.assert_close(paged_logits(ours, IDS, [10, 27], "cpu"), expected,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuations_equal_transformers(moe_dirs, arch):
    """The engine (weights packed, its layers in the C++ loop) against transformers' argmax,
    token by token."""
    ref = _reference(moe_dirs[arch])
    prompts = [IDS[:9], IDS[5:30]]
    llm = make_llm(moe_dirs[arch])
    model = llm.engine.local_core.runner.model
    if kernels.ops() is not None:
        fused = model.fused_weights()
        assert sum(layer.moe.top_k > 0 for layer in fused.layers) == len(
            [layer for layer in model.layers if isinstance(layer.mlp, SparseMoE)]) > 0
    assert_greedy_is_the_references(llm, ref, prompts)


def assert_greedy_is_the_references(llm, ref, prompts: list[list[int]], n: int = 12) -> None:
    """`llm`'s greedy continuations of `prompts` (n tokens) are transformers' model `ref`'s
    argmax, token by token."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(_hf_logits(ref, ids)[-1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]


def _module_path_logits(model, chunks: list[int], ids: list[int] = IDS) -> torch.Tensor:
    """paged_logits with the layers run as torch modules (the backend offers run_layers no
    inputs), the reference the C++ loop is held to."""
    backend = model.layers[0].self_attn.backend
    backend.fused_inputs = lambda meta, dtype: None
    try:
        return paged_logits(model, ids, chunks, "cpu")
    finally:
        del backend.fused_inputs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("form", ["none", "bf16", "q8_0", "k-quants"])
def test_layer_loop_is_the_module_path(moe_dirs, tmp_path, monkeypatch, arch, form):
    """run_layers' expert loop gives the modules' logits bit for bit, prompt whole and
    chunked: experts on kvserve's dense kernel one after another (none, bf16), and in GGUF
    blocks all at once on gguf_grouped (Q8_0 read in place; Q4_K/Q6_K interleaved under
    auto, on every machine as tests/test_gguf.py forces it)."""
    from kvserve.layers import quant

    if kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    if form in ("none", "bf16"):
        model = load_model(moe_dirs[arch], dtype, torch.device("cpu"), _backend).model
        model.pack_("none")
    else:
        path = tmp_path / f"tiny-{arch}-{form}.gguf"
        if form == "q8_0":
            write_moe_gguf(moe_dirs[arch], path, arch, gguf.GGMLQuantizationType.Q8_0)
        else:
            monkeypatch.setattr(quant, "gguf_auto_types", lambda: quant.GGUF_AUTO_TYPES)
            hf_dir = build_tiny_moe(tmp_path / "hf", arch, hidden=256, experts_size=256)
            write_moe_gguf(hf_dir, path, arch, random_k_quants=True)
        model = load_model(path, dtype, torch.device("cpu"), _backend).model
        model.pack_("gguf" if form == "q8_0" else "auto")
    sparse = [layer.moe for layer in model.fused_weights().layers if layer.moe.top_k]
    assert sparse and all(m.grouped == (form in ("q8_0", "k-quants")) for m in sparse)
    want = _module_path_logits(model, [37])
    for chunks in ([37], [1] * 5 + [32], [10, 17, 1, 9]):
        assert torch.equal(paged_logits(model, IDS, chunks, "cpu"),
                           want if chunks == [37] else _module_path_logits(model, chunks))


def test_mxfp4_experts_are_read_in_place_all_at_once(tmp_path):
    """MXFP4 experts (gpt-oss's type) under `gguf`: every expert a view of the file's blocks
    read by gguf_linear, the layer loop's experts on gguf_grouped giving the modules' logits
    bit for bit (whole and chunked), close to the float32 model of gguf's dequantization of
    the same blocks; kvserve plan counts the stacks at the file's bytes, in its pages."""
    from kvserve.models.gguf_file import gguf_weight_bytes

    if kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    hf_dir = build_tiny_moe(tmp_path / "hf", "qwen3moe", hidden=256, experts_size=256)
    path = tmp_path / "tiny-qwen3moe-mxfp4.gguf"
    write_moe_gguf(hf_dir, path, "qwen3moe", random_mxfp4=True)
    in_place, ref = (load_model(path, torch.float32, torch.device("cpu"), _backend).model
                     for _ in range(2))
    in_place.pack_("gguf")
    ref.pack_("none")
    packed = [m.packed for layer in in_place.layers if isinstance(layer.mlp, SparseMoE)
              for e in layer.mlp.experts for m in (e.gate_up_proj, e.down_proj)]
    assert packed and all(isinstance(p, GGUFWeight) and p.kinds == ["MXFP4"] * len(p.kinds)
                          for p in packed)
    sparse = [layer.moe for layer in in_place.fused_weights().layers if layer.moe.top_k]
    assert sparse and all(m.grouped for m in sparse)
    a = paged_logits(in_place, IDS, [37], "cpu")
    assert torch.equal(a, _module_path_logits(in_place, [37]))
    assert torch.equal(paged_logits(in_place, IDS, [10, 17, 1, 9], "cpu"),
                       _module_path_logits(in_place, [10, 17, 1, 9]))
    b = paged_logits(ref, IDS, [37], "cpu")
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    tensors = gguf.GGUFReader(str(path)).tensors
    stacks = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "MXFP4")
    floats = sum(int(t.n_elements) * 4 for t in tensors if t.tensor_type.name == "F32")
    assert stacks == sum(int(t.n_bytes) for t in tensors if "_exps." in t.name) > 0
    held = gguf_weight_bytes(path, torch.float32, in_place=True)
    assert held.in_place == stacks and held.resident == stacks + floats


def test_converted_expert_stacks_load_as_the_original_layout(moe_dirs, tmp_path):
    """transformers 5's own layout (save_original_format=False: one gate_up_proj and one
    down_proj stack per layer) gives the same model."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen2moe"], dtype=torch.float32)
    ref.save_pretrained(tmp_path, save_original_format=False)
    assert any(k.endswith("experts.gate_up_proj") for k in
               load_file(tmp_path / "model.safetensors"))
    a = load_model(moe_dirs["qwen2moe"], torch.float32, torch.device("cpu"), _backend).model
    b = load_model(tmp_path, torch.float32, torch.device("cpu"), _backend).model
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------- determinism


def test_an_expert_width_off_the_vector_step_is_reported(moe_dirs):
    """torch's SiLU computes a tensor's last values on a scalar path: experts (or an MLP) of
    a width that is not a multiple of 64 make a row's activations depend on the rows after
    it, and the start-up warning's list says so."""
    import dataclasses

    cfg = read_model_config(moe_dirs["qwen2moe"])
    assert not any("MLP activation" in p for p in
                   build_model(cfg, torch.float32, _backend).batch_variant_parts())
    odd = build_model(dataclasses.replace(cfg, moe_intermediate_size=96), torch.float32,
                      _backend)
    assert "the MLP activation over 96 features" in "; ".join(odd.batch_variant_parts())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_rows_do_not_depend_on_the_batch(moe_dirs, dtype):
    """A token's final hidden state is bit for bit the same alone and beside eleven other
    requests, whose tokens share some of its experts and not others (Qwen2-MoE: routed and
    shared experts, and a dense layer)."""
    from kvserve.worker.forward import ForwardItem
    from kvserve.worker.model_runner import allocate_kv_caches, run_forward

    model = load_model(moe_dirs["qwen2moe"], dtype, torch.device("cpu"), _backend).model
    model.pack_("none")
    variant = model.batch_variant_parts()
    if variant:
        pytest.skip(f"no batch-invariant kernels here: {'; '.join(variant)}")
    g = torch.Generator().manual_seed(3)
    items = [ForwardItem(torch.randint(2, 300, (3 + 5 * i,), generator=g).tolist(), 0,
                         list(range(16 * i, 16 * i + 16)), 1) for i in range(12)]
    caches = allocate_kv_caches(model, 16 * 12 * 4, dtype, torch.device("cpu"))
    together = run_forward(model, caches, 4, items, torch.device("cpu"))
    # the routing, seen by the modules' router (the layers run as modules once)
    logits = []
    hook = model.layers[0].mlp.router.register_forward_hook(
        lambda module, args, out: logits.append(out))
    backend = model.layers[0].self_attn.backend
    backend.fused_inputs = lambda meta, dtype: None
    caches = allocate_kv_caches(model, 16 * 12 * 4, dtype, torch.device("cpu"))
    assert torch.equal(run_forward(model, caches, 4, items, torch.device("cpu")), together)
    del backend.fused_inputs
    hook.remove()
    # the step's rows do not all pick the same pair of experts (of 4): rows share some
    pairs = {tuple(p) for p in route(logits[0], 2, False)[1].tolist()}
    assert 1 < len(pairs) < sum(len(it.token_ids) for it in items)
    for i, it in enumerate(items):
        caches = allocate_kv_caches(model, 16 * 12 * 4, dtype, torch.device("cpu"))
        alone = run_forward(model, caches, 4, [it], torch.device("cpu"))
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_are_independent_of_their_batch(moe_dirs, arch, tmp_path):
    """Each request's tokens and logprobs, bit for bit, as it gives alone: batched with
    others (rows sharing experts and not), its prompt chunked (8- and 16-token steps),
    prefix-cache hits, preemption (a pool of 50 blocks of 4 for 8 requests of up to 67
    tokens), n-gram speculation and a draft model (the MoE model drafting for itself: a
    random model's drafts for another are all rejected); greedy and seeded requests."""
    assert_requests_run_as_alone(
        str(moe_dirs[arch]), tmp_path, seed=7, count=8, step=4, max_tokens=16,
        runs=((8, 12, True, None), (512, 256, False, "ngram"), (16, 24, True, "ngram"),
              (16, 24, True, "draft_model")))


def assert_requests_run_as_alone(model: str, tmp_path, seed: int, count: int, step: int,
                                 max_tokens: int, runs) -> None:
    """`count` requests (all but the last three sharing a 20-token prefix, tails growing by
    `step` tokens, greedy and seeded in turn, arriving over three steps), each run's tokens
    and logprobs bit for bit the request's alone, for each of `runs` (step budget, pool
    blocks of 4, prefix caching, speculation: None, "ngram" or "draft_model", the model
    drafting for itself); some run preempts."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 320, 20).tolist()
    requests = []
    for i in range(count):
        tail = rng.integers(2, 320, 3 + step * i).tolist()
        params = (SamplingParams(temperature=0, logprobs=1, max_tokens=max_tokens,
                                 ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=1.0, seed=i, logprobs=1, max_tokens=max_tokens,
                                 ignore_eos=True))
        requests.append(((prefix if i < count - 3 else []) + tail, params, i % 3))
    alone = Alone()
    preempted = 0
    for budget, blocks, caching, spec in runs:
        cfg = {"model": model, "draft_model": model, "max_num_batched_tokens": budget,
               "block_size": 4, "num_kv_blocks": blocks, "enable_prefix_caching": caching,
               "short_prompt_steps": True, "tier": None, "speculation": spec}
        args = engine_args(cfg, "float32", tmp_path)
        counts: dict[str, int] = {}
        got = run_workload(args, requests, counts, must_be_invariant=True)
        preempted += counts["preemptions"]
        if spec == "draft_model":  # its drafts were verified and kept
            assert 0 < counts["accepted"] <= counts["drafts"], counts
        for (prompt, params, _), out in zip(requests, got, strict=True):
            assert out == alone(args, prompt, params), (budget, prompt, params)
    assert preempted > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype,arch", [("float32", "qwen2moe"), ("bfloat16", "qwen3moe"),
                                        ("bfloat16", "mixtral")])
def test_random_workloads_are_independent_of_their_batch(moe_dirs, dtype, arch,
                                                         tmp_path_factory):
    """tests/test_determinism.py's property on the MoE models: random workloads (shared
    prefixes, arrivals, step budgets, small pools, host and disk tiers, n > 1, n-gram and
    draft-model drafts, K/V as auto picks and int8) against each request alone."""
    _property(str(moe_dirs[arch]), dtype, ["auto", "int8"], tmp_path_factory, Alone())


# --------------------------------------------------------------------------------- GGUF


def add_gguf_tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray,
                    kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> None:
    """`arr` as tensor `name` of `w`: F32 as it is, any other type quantized by gguf."""
    if kind == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    else:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr), kind), raw_dtype=kind)


def write_moe_gguf(hf_dir: Path, out: Path, arch: str,
                   qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                   random_k_quants: bool = False, random_mxfp4: bool = False) -> None:
    """The checkpoint as llama.cpp's converter lays an MoE out: experts stacked per layer
    (ffn_gate_exps, ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]) in `qtype`, the router
    ffn_gate_inp and the shared expert's gate ffn_gate_inp_shexp (a vector) in F32, the shared
    expert as ffn_*_shexp; Mixtral as a llama file (q/k rows permuted) with an expert
    count and no expert_feed_forward_length. Every other tensor F32. `random_k_quants`: the
    experts as random blocks of a Q4_K_M file's types instead (Q4_K gate and up, Q6_K down;
    gguf cannot quantize to them), scaled to weights of ~0.05. `random_mxfp4`: the experts as
    random MXFP4 blocks (gpt-oss's experts' type), their exponents to weights of <= 0.047."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k.removeprefix("model."): v.float().numpy()
          for k, v in load_file(hf_dir / "model.safetensors").items()}
    file_arch = "llama" if arch == "mixtral" else arch
    w = gguf.GGUFWriter(str(out), file_arch)
    write_shape(w, cfg)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "mixtral":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    write_tokens(w, cfg["vocab_size"])

    def add(name: str, arr: np.ndarray, kind=gguf.GGMLQuantizationType.F32) -> None:
        add_gguf_tensor(w, name, arr, kind)

    add("token_embd.weight", sd["embed_tokens.weight"])
    add("output_norm.weight", sd["norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    attn = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
            "o_proj": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    proj = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    mixtral = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf, ours in attn.items():
            for what in ("weight", "bias"):
                if (key := f"{p}self_attn.{hf}.{what}") in sd:
                    arr = sd[key]
                    if arch == "mixtral" and hf in ("q_proj", "k_proj"):
                        arr = _permute(arr, cfg["num_attention_heads"] if hf == "q_proj"
                                       else cfg["num_key_value_heads"])
                    add(f"blk.{i}.{ours}.{what}", arr)
        block = p + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        if block + "gate.weight" not in sd:  # a dense layer
            for hf, ours in proj.items():
                add(f"blk.{i}.{ours}.weight", sd[f"{block}{hf}.weight"])
            continue
        add(f"blk.{i}.ffn_gate_inp.weight", sd[block + "gate.weight"])
        for hf, ours in proj.items():
            names = [k for k, v in mixtral.items() if v == hf] if arch == "mixtral" else [hf]
            stack = np.stack([sd[f"{block}experts.{e}.{names[0]}.weight"]
                              for e in range(experts)])
            if random_k_quants:
                kind = "Q6_K" if ours == "ffn_down" else "Q4_K"
                rows, cols = stack.shape[1:]
                blocks = _random_blocks(kind, experts * rows, cols, seed=i * 3 + len(ours))
                blocks = blocks.reshape(experts, rows, cols // 256, -1)
                for off in (208,) if kind == "Q6_K" else (0, 2):  # d (Q4_K: and dmin)
                    blocks[..., off:off + 2] = np.full(blocks.shape[:3], 2e-4, np.float16).view(
                        np.uint8).reshape(*blocks.shape[:3], 2)
                w.add_tensor(f"blk.{i}.{ours}_exps.weight", blocks.reshape(experts, rows, -1),
                             raw_dtype=gguf.GGMLQuantizationType[kind])
                continue
            if random_mxfp4:
                rows, cols = stack.shape[1:]
                blocks = _random_blocks("MXFP4", experts * rows, cols, seed=i * 3 + len(ours))
                w.add_tensor(f"blk.{i}.{ours}_exps.weight", blocks.reshape(experts, rows, -1),
                             raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                continue
            add(f"blk.{i}.{ours}_exps.weight", stack, qtype)
        if block + "shared_expert_gate.weight" in sd:
            for hf, ours in proj.items():
                add(f"blk.{i}.{ours}_shexp.weight", sd[f"{block}shared_expert.{hf}.weight"])
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[block + "shared_expert_gate.weight"][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32,
                                   gguf.GGMLQuantizationType.F16])
def test_float_gguf_matches_the_checkpoint(moe_dirs, tmp_path, arch, qtype):
    """F32 and F16 experts (the weights are float16 values: both exact) give the HF
    directory's config and logits, and transformers' within 1e-4."""
    path = tmp_path / f"tiny-{arch}.gguf"
    write_moe_gguf(moe_dirs[arch], path, arch, qtype)
    from_gguf = load_model(path, torch.float32, torch.device("cpu"), _backend)
    from_dir = load_model(moe_dirs[arch], torch.float32, torch.device("cpu"), _backend)
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "dense_layers", "qkv_bias", "qk_norm",
              "intermediate_size")
    assert [getattr(from_gguf.config, f) for f in fields] == \
        [getattr(from_dir.config, f) for f in fields]
    got = paged_logits(from_gguf.model, IDS, [10, 27], "cpu")
    torch.testing.assert_close(got, paged_logits(from_dir.model, IDS, [10, 27], "cpu"))
    torch.testing.assert_close(got, _hf_logits(_reference(moe_dirs[arch]), IDS),
                               atol=1e-4, rtol=1e-4)


def _dequantized_reference(hf_dir: Path, path: Path):
    """transformers' model of `hf_dir` with its experts replaced by gguf's dequantization of
    the file's expert stacks (an independent reading of the file's blocks)."""
    ref = _reference(hf_dir)
    reader = gguf.GGUFReader(str(path))
    stacks = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
              for t in reader.tensors if "_exps" in t.name}
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for i in range(ref.config.num_hidden_layers):
            if f"blk.{i}.ffn_gate_exps.weight" not in stacks:
                continue
            gate_up = torch.cat([stacks[f"blk.{i}.ffn_gate_exps.weight"],
                                 stacks[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
            params[f"model.layers.{i}.mlp.experts.gate_up_proj"].copy_(gate_up)
            params[f"model.layers.{i}.mlp.experts.down_proj"].copy_(
                stacks[f"blk.{i}.ffn_down_exps.weight"])
    return ref


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_q8_0_experts_stay_in_their_blocks(moe_dirs, tmp_path, arch):
    """Q8_0 experts: loaded as views of the file's blocks (no float copy), their floats
    matching gguf's dequantization under transformers within 1e-4; read in place by
    gguf_linear under --quantization gguf, and as their own codes on the int8 kernel under
    auto, each close to the float model (int8 activations)."""
    from kvserve import kernels

    path = tmp_path / f"tiny-{arch}-q8.gguf"
    write_moe_gguf(moe_dirs[arch], path, arch, gguf.GGMLQuantizationType.Q8_0)
    models = [load_model(path, torch.float32, torch.device("cpu"), _backend).model
              for _ in range(3)]
    expert = models[0].layers[0].mlp.experts[1]
    assert isinstance(expert.gate_up_proj.gguf_tensors[0], GGUFTensor)
    assert {t.kind for t in expert.gate_up_proj.gguf_tensors.values()} == {"Q8_0"}
    ref = paged_logits(models[0], IDS, [10, 27], "cpu")
    expected = _hf_logits(_dequantized_reference(moe_dirs[arch], path), IDS)
    torch.testing.assert_close(ref, expected, atol=1e-4, rtol=1e-4)
    in_place, codes = models[1], models[2]
    in_place.pack_("gguf")
    experts = [e for layer in in_place.layers if isinstance(layer.mlp, SparseMoE)
               for e in layer.mlp.experts]
    for e in experts:
        for m in (e.gate_up_proj, e.down_proj):
            assert isinstance(m.packed, GGUFWeight) and set(m.packed.kinds) == {"Q8_0"}
            assert m.weight.numel() == 0
    checked = [in_place]
    if kernels.quant_kernels(torch.float32, "cpu", 16, 32) is not None:
        codes.pack_("auto")
        for layer in codes.layers:
            if isinstance(layer.mlp, SparseMoE):
                assert all(isinstance(m.packed, QuantizedWeight) and m.packed.exact
                           for e in layer.mlp.experts for m in (e.gate_up_proj, e.down_proj))
        checked.append(codes)
    for m in checked:
        got = paged_logits(m, IDS, [10, 27], "cpu")
        assert (got - ref).abs().max() / ref.abs().max() < 0.05
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_weight_cache_restores_experts_bit_for_bit(moe_dirs, tmp_path, monkeypatch,
                                                   caplog):
    """The start-up cache (kvserve.models.weight_cache) holds every expert, router (padded
    for the dense kernel) and shared gate as it was packed: an HF directory under none, and a
    Q8_0 GGUF under int8 (the experts' own codes)."""
    from kvserve.worker.model_runner import load_target
    from tests.test_weight_cache import assert_same_model

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVSERVE_NO_WEIGHT_CACHE", raising=False)
    caplog.set_level(logging.INFO, logger="kvserve")
    gguf_path = tmp_path / "tiny-qwen2moe-q8.gguf"
    write_moe_gguf(moe_dirs["qwen2moe"], gguf_path, "qwen2moe", gguf.GGMLQuantizationType.Q8_0)
    for path, quantization in ((moe_dirs["qwen2moe"], "none"), (gguf_path, "int8")):
        fresh, _ = load_target(str(path), torch.float32, torch.device("cpu"), "auto",
                               quantization)
        cached, _ = load_target(str(path), torch.float32, torch.device("cpu"), "auto",
                                quantization)
        assert_same_model(fresh.model, cached.model)
    hits = [r for r in caplog.records if "mapped from the weight cache" in r.getMessage()]
    assert len(hits) == 2
    assert len(list((tmp_path / "cache" / "weights").glob("*.bin"))) == 2


def test_k_quant_experts_under_auto_are_interleaved_in_place(tmp_path, monkeypatch, capsys):
    """A Q4_K_M-like MoE file (Q4_K gate/up and Q6_K down experts) under `auto`, where
    gguf_linear has a vector path (forced here on any CPU, as tests/test_gguf.py does): every
    expert read from its own blocks, interleaved 8 rows at a time at load into exactly the
    bytes kvserve.models.paths.interleaved_bytes reserves, with the same logits, bit for bit,
    as `gguf` reading the file's layout, and close to the float32 model of the same
    dequantized weights."""
    from kvserve import kernels
    from kvserve.entrypoints import cli
    from kvserve.layers import quant
    from kvserve.models.gguf_file import gguf_weight_bytes
    from kvserve.models.paths import interleaved_bytes

    if kernels.gguf_kernels(torch.float32, "cpu", [12, 14]) is None:
        pytest.fail("the GGUF kernels are built with the C++ kernels, which every test "
                    "machine has")
    monkeypatch.setattr(quant, "gguf_auto_types", lambda: quant.GGUF_AUTO_TYPES)
    hf_dir = build_tiny_moe(tmp_path / "hf", "qwen3moe", hidden=256, experts_size=256)
    path = tmp_path / "tiny-qwen3moe-k.gguf"
    write_moe_gguf(hf_dir, path, "qwen3moe", random_k_quants=True)
    auto, in_place, ref = (load_model(path, torch.float32, torch.device("cpu"), _backend).model
                           for _ in range(3))
    auto.pack_("auto")
    in_place.pack_("gguf")
    ref.pack_("none")
    packed = [m.packed for layer in auto.layers for e in layer.mlp.experts
              for m in (e.gate_up_proj, e.down_proj)]
    assert all(isinstance(p, GGUFWeight) and all(p.interleaved) for p in packed)
    assert {k for p in packed for k in p.kinds} == {"Q4_K", "Q6_K"}
    taken = sum(t.numel() for p in packed for t in p.data)
    assert interleaved_bytes(path) == taken > 0
    a = paged_logits(auto, IDS, [20, 1, 16], "cpu")
    assert torch.equal(a, paged_logits(in_place, IDS, [37], "cpu"))
    b = paged_logits(ref, IDS, [37], "cpu")
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    # kvserve plan's count of what auto holds: the expert stacks at the file's bytes
    tensors = gguf.GGUFReader(str(path)).tensors
    quantized = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name in ("Q4_K", "Q6_K"))
    floats = sum(int(t.n_elements) * 4 for t in tensors if t.tensor_type.name == "F32")
    held = gguf_weight_bytes(path, torch.float32, in_place=False)
    assert quantized == taken and held.resident == quantized + floats
    # a token reads its k of E experts: kvserve plan's batch-1 floor
    cfg = json.loads((hf_dir / "config.json").read_text())
    k, e = cfg["num_experts_per_tok"], cfg.get("num_experts") or cfg["num_local_experts"]
    stacks = [int(t.n_bytes) for t in tensors if "_exps." in t.name]
    assert k < e and stacks
    assert held.one_token == held.per_token - sum(s - s * k // e for s in stacks)
    # a step of 32 tokens, routed uniformly and independently: each expert unread by all 32
    # with probability (1 - k/E)^32
    batch32 = held.per_token - sum(stacks) * (1 - k / e) ** 32
    assert held.reads(32) == pytest.approx(batch32)
    assert held.reads(1) == pytest.approx(held.per_token - sum(stacks) * (1 - k / e))
    assert held.one_token < held.reads(32) < held.per_token
    assert cli.main(["plan", "--model", str(path), "--dtype", "float32", "--kv-cache-memory",
                     "1MiB", "--max-model-len", "64", "--prompt-len", "40", "--output-len",
                     "8", "--bandwidth", "10"]) == 0
    mib = 2**20
    assert (f"a decode step of one token reads {held.one_token / mib:.1f} MiB ({k} of {e} "
            f"experts a layer), {batch32 / mib:.1f} MiB at batch 32 (uniform routing), "
            f"{held.per_token / mib:.1f} MiB with every expert touched") in \
        capsys.readouterr().out


def test_layer_loop_phases_are_profiler_scopes(moe_dirs):
    """run_layers names its phases for torch.profiler (benchmarks/step_phases.py reads them):
    Qwen2-MoE's sparse layer (routed and shared experts) and its dense layer."""
    from torch.profiler import ProfilerActivity, profile

    if kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    model = load_model(moe_dirs["qwen2moe"], torch.float32, torch.device("cpu"), _backend).model
    model.pack_("none")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged_logits(model, IDS[:9], [9], "cpu")
    names = {e.key for e in prof.key_averages()}
    assert {f"kvserve::{p}" for p in ("qkv_proj", "attention", "o_proj", "mlp", "moe_router",
                                      "moe_experts", "moe_combine", "moe_shared_expert")} <= names


def test_benchmark_repeats_a_files_layers_block_for_block(moe_dirs, tmp_path, monkeypatch):
    """benchmarks/moe_vs_llamacpp.py's a3b shape: a quantized file's layers copied to more
    layers (layer i = layer i % L, every tensor's bytes as written), the metadata the
    source's but the layer count, and the result a model kvserve loads."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from moe_vs_llamacpp import repeat_layers

    src, out = tmp_path / "two.gguf", tmp_path / "five.gguf"
    write_moe_gguf(moe_dirs["qwen3moe"], src, "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    repeat_layers(src, out, {"name": "five layers", "layers": 5})
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    assert int(b.fields["qwen3moe.block_count"].contents()) == 5
    assert b.fields["general.name"].contents() == "five layers"
    assert b.fields["qwen3moe.expert_count"].contents() == \
        a.fields["qwen3moe.expert_count"].contents()
    have = int(a.fields["qwen3moe.block_count"].contents())
    source = {t.name: t for t in a.tensors}
    for t in b.tensors:
        parts = t.name.split(".")
        name = ".".join(["blk", str(int(parts[1]) % have), *parts[2:]]) \
            if parts[0] == "blk" else t.name
        s = source[name]
        assert t.tensor_type == s.tensor_type and np.array_equal(t.data, s.data), t.name
    assert len(b.tensors) == len(a.tensors) + (5 - have) * len(
        [t for t in a.tensors if t.name.startswith("blk.0.")])
    assert read_model_config(out).num_layers == 5
    load_model(out, torch.float32, torch.device("cpu"), _backend)


@pytest.mark.parametrize("arch", ["qwen2moe", "dense"])
def test_step_records_split_forward_by_layer_phase(moe_dirs, tiny_llama_dir, arch):
    """Each step's record splits its forward into the C++ layer loop's phases (the wall time
    of each, summed over the layers): a sparse layer's router, experts, sum and shared
    expert, a dense layer's MLP, and every layer's projections and attention, together no
    more than the forward they are part of."""
    if kernels.ops() is None:
        pytest.fail("the C++ kernels are built on every test machine")
    with make_llm(tiny_llama_dir if arch == "dense" else moe_dirs[arch]) as llm:
        llm.generate([IDS[:20]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        steps = list(llm.engine.local_core.steps)
    assert len(steps) >= 4
    moe = {"moe_router", "moe_experts", "moe_combine", "moe_shared_expert"}
    for s in steps:
        want = {"qkv_proj", "attention", "o_proj"} | (moe | {"mlp"} if arch != "dense" else
                                                      {"mlp"})
        assert set(s.layers) == want, s.layers  # qwen2moe: one sparse layer, one dense
        assert all(v > 0 for v in s.layers.values())
        assert sum(s.layers.values()) <= s.forward
        assert s.as_json()["layers"].keys() == s.layers.keys()
