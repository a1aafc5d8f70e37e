"""GGUF loading: tiny GGUF files written here from the tiny random checkpoints, compared with
the checkpoint itself and with transformers reading the same GGUF."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.layers.quant import GGUFTensor, GGUFWeight
from kvserve.models.loader import load_model
from tests.conftest import parsed_gguf
from tests.test_model import paged_logits


def _backend(c):
    return TorchPagedAttention.for_model(c)


def write_shape(w: gguf.GGUFWriter, cfg: dict) -> dict:
    """A Hugging Face config's shape as GGUF metadata (layers, context, widths, heads, head
    dim, RoPE base); returns the config's RoPE parameters."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or cfg
    w.add_rope_freq_base(rope["rope_theta"])
    return rope


def write_tokens(w: gguf.GGUFWriter, n: int) -> None:
    """A placeholder vocabulary of n tokens ("t0", "t1", ...; GPT-2 style, no merges)."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges([])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of q/k rows to its pairwise RoPE order."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir, out, arch: str | None = None,
               qtype=gguf.GGMLQuantizationType.F32, bad_tensor_type=None,
               random_q6k_down: bool = False, random_k_quants: bool = False,
               random_iq4: bool = False, random_mxfp4: bool = False) -> None:
    """`random_q6k_down`: every ffn_down tensor as random Q6_K blocks (gguf cannot quantize to
    Q6_K), their scales at about the checkpoint's weights' size. `random_k_quants`: every
    layer matrix and the output as random K-quant blocks, as a Q4_K_M file mixes them (Q6_K
    for ffn_down, attn_v and the output, Q4_K for the rest). `random_iq4`: every layer matrix
    and the output as random IQ4_XS blocks, attn_v as IQ4_NL. `random_mxfp4`: every layer
    matrix and the output as random MXFP4 blocks (gpt-oss's experts' type), attn_v as
    IQ4_NL."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_arch = cfg["model_type"]
    arch = arch or model_arch
    sd = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(out), arch)
    rope = write_shape(w, cfg)
    if rope.get("rope_type") == "longrope":  # Phi-3: its factors as llama.cpp stores them
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     rope["original_max_position_embeddings"])
        stretch = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        w.add_float32(f"{arch}.rope.scaling.attn_factor", float(np.sqrt(
            1 + np.log(stretch) / np.log(rope["original_max_position_embeddings"]))))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    write_tokens(w, cfg["vocab_size"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.qkv_proj.weight": "attn_qkv.weight",
                 "mlp.gate_up_proj.weight": "ffn_up.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    for key, arr in sd.items():
        if key in names:
            name = names[key]
        else:
            _, _, idx, rest = key.split(".", 3)
            name = f"blk.{idx}.{per_layer[rest]}"
        if model_arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in name else cfg[
                "num_key_value_heads"]
            arr = _permute(arr, heads)
        if arr.ndim == 2 and name != "token_embd.weight" and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        elif (random_iq4 or random_mxfp4) and arr.ndim == 2 and name != "token_embd.weight":
            kind = ("IQ4_NL" if name.endswith("attn_v.weight") else
                    "MXFP4" if random_mxfp4 else "IQ4_XS")
            iq4 = gguf.GGMLQuantizationType[kind]
            blocks = _random_blocks(kind, *arr.shape, seed=len(key)).reshape(
                arr.shape[0], arr.shape[1] // gguf.GGML_QUANT_SIZES[iq4][0], -1)
            if kind != "MXFP4":  # (its exponents are _random_blocks')
                # d: weights of at most ~0.05 (IQ4_XS: d x a 6-bit scale (-32..31) x a level)
                blocks[..., :2] = np.full(blocks.shape[:2], 1.5e-5 if kind == "IQ4_XS" else 4e-4,
                                          np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
            w.add_tensor(name, blocks.reshape(arr.shape[0], -1), raw_dtype=iq4)
        elif random_k_quants and arr.ndim == 2 and name != "token_embd.weight":
            kind = "Q6_K" if name.endswith(("ffn_down.weight", "attn_v.weight",
                                             "output.weight")) else "Q4_K"
            blocks = _random_blocks(kind, *arr.shape, seed=len(key)).reshape(
                arr.shape[0], arr.shape[1] // 256, -1)
            fields = (208,) if kind == "Q6_K" else (0, 2)  # d (Q4_K: and dmin), ~0.05 weights
            for off in fields:
                blocks[..., off:off + 2] = np.full(blocks.shape[:2], 2e-4, np.float16).view(
                    np.uint8).reshape(*blocks.shape[:2], 2)
            w.add_tensor(name, blocks.reshape(arr.shape[0], -1),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        elif random_q6k_down and name.endswith("ffn_down.weight"):
            blocks = _random_blocks("Q6_K", *arr.shape, seed=len(key)).reshape(
                arr.shape[0], -1, 210)
            # d x sc x (q - 32) about the size of the checkpoint's weights (~0.1)
            blocks[..., 208:210] = np.full(blocks.shape[:2], 2e-4, np.float16).view(
                np.uint8).reshape(*blocks.shape[:2], 2)
            w.add_tensor(name, blocks.reshape(arr.shape[0], -1),
                         raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif bad_tensor_type is not None and name == "blk.0.ffn_up.weight":
            bs, ts = gguf.GGML_QUANT_SIZES[bad_tensor_type]
            raw = np.zeros((arr.shape[0], arr.shape[1] // bs * ts), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=bad_tensor_type)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


IDS = torch.randint(0, 320, (29,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_f32_gguf_matches_the_checkpoint(arch, request, tmp_path):
    """phi3: fused qkv and gate/up tensors, LongRoPE factors as tensors."""
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(hf_dir, path)
    from_gguf = load_model(path, torch.float32, torch.device("cpu"), _backend)
    from_dir = load_model(hf_dir, torch.float32, torch.device("cpu"), _backend)
    c1, c2 = from_gguf.config, from_dir.config
    fields = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
              "tie_word_embeddings", "qkv_bias", "qk_norm")
    assert [getattr(c1, f) for f in fields] == [getattr(c2, f) for f in fields]
    torch.testing.assert_close(paged_logits(from_gguf.model, IDS, [29], "cpu"),
                               paged_logits(from_dir.model, IDS, [29], "cpu"))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.F16])
def test_quantized_gguf_matches_transformers(qtype, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny-q.gguf"
    write_gguf(tiny_llama_dir, path, qtype=qtype)
    ours = load_model(path, torch.float32, torch.device("cpu"), _backend).model
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(paged_logits(ours, IDS, [29], "cpu"), expected,
                               atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_named(tiny_llama_dir, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(tiny_llama_dir, path, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        load_model(path, torch.float32, torch.device("cpu"), _backend)


def test_unsupported_tensor_type_is_named(tiny_llama_dir, tmp_path):
    path = tmp_path / "q81.gguf"
    write_gguf(tiny_llama_dir, path, bad_tensor_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight: unsupported GGUF tensor type Q8_1"):
        load_model(path, torch.float32, torch.device("cpu"), _backend)


def _packed_models(tmp_path_factory, name: str, packs: tuple[str, ...], model_kw: dict,
                   gguf_kw: dict):
    """A tiny llama written as a GGUF (write_gguf's `gguf_kw`), loaded in float32 once per
    quantization of `packs`, each packed so: (its path, the models)."""
    from tests.conftest import build_tiny_model

    hf_dir = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{name}"), "llama", **model_kw)
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    write_gguf(hf_dir, path, **gguf_kw)
    models = [load_model(path, torch.float32, torch.device("cpu"), _backend).model
              for _ in packs]
    for model, quantization in zip(models, packs, strict=True):
        model.pack_(quantization)
    return path, models


def test_q6k_layers_serve_their_own_codes(tmp_path_factory, kernel_build):
    """Q6_K projections (scales per 16 inputs) keep the file's codes: on the AVX2 int8 kernel
    under int8, read in place by gguf_linear under gguf (and auto); either model stays close
    to its float32 self on the same dequantized weights."""

    from tests.test_kernels import QUANT_HALVES, has_quant_halves

    kernel_build(lambda: has_quant_halves(torch.float32), QUANT_HALVES)
    _, (model, in_place, ref) = _packed_models(tmp_path_factory, "q6k", ("int8", "gguf", "none"),
                                               {"intermediate_size": 256},
                                               {"random_q6k_down": True})
    downs = [layer.mlp.down_proj.packed for layer in model.layers]
    assert all(p.exact and p.method == "int8" and p.q.dtype == torch.int8 for p in downs)
    downs = [layer.mlp.down_proj.packed for layer in in_place.layers]
    assert all(isinstance(p, GGUFWeight) and p.kinds == ["Q6_K"] for p in downs)
    a = paged_logits(ref, IDS, [29], "cpu")
    for m in (model, in_place):
        b = paged_logits(m, IDS, [20, 1, 8], "cpu")
        # int8: every projection's weights (the float ones quantized too) and activations, per
        # 32 inputs; in place only the down projections' activations, per 256 (llama.cpp's
        # Q8_K for the K-quants, coarser). Each moves 5-7% of the logits' range on this random
        # tiny model.
        assert 0 < (a - b).abs().max() / a.abs().max() < 0.1
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_k_quant_layers_under_auto_read_the_files_codes(tmp_path_factory, monkeypatch):
    """`auto` on a Q4_K_M-like file, where gguf_linear has a vector path (forced here on any
    CPU, after checking which CPUs get it): every matrix on gguf_linear (Q4_K and Q6_K interleaved
    8 rows at a time at load, the embedding looked up in place), with the same logits,
    bit for bit, as `gguf` reading the file's layout (chunked otherwise), and close to the
    float32 model on the same dequantized weights."""
    from kvserve import kernels
    from kvserve.layers import quant
    from kvserve.layers.linear import LinearBase

    if kernels.gguf_kernels(torch.float32, "cpu", [12, 14]) is None:
        pytest.fail("the GGUF kernels are built with the C++ kernels, which every test "
                    "machine has")
    print(f"gguf_linear's path here: {kernels.ops().gguf_path()}; auto's GGUF types: "
          f"{quant.gguf_auto_types()}")
    assert quant.gguf_auto_types() == (quant.GGUF_AUTO_TYPES
                                       if kernels.ops().gguf_path() in ("AVX2", "VNNI")
                                       else frozenset())
    monkeypatch.setattr(quant, "gguf_auto_types", lambda: quant.GGUF_AUTO_TYPES)
    path, (auto, in_place, ref) = _packed_models(
        tmp_path_factory, "km", ("auto", "gguf", "none"),
        {"hidden_size": 256, "intermediate_size": 256}, {"random_k_quants": True})
    layers = [m for m in auto.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) for m in layers)
    parts = [(k, x8) for m in layers for k, x8 in zip(m.packed.kinds, m.packed.interleaved,
                                                      strict=True)]
    assert {k for k, _ in parts} == {"Q4_K", "Q6_K"} and all(x8 for _, x8 in parts)
    assert auto.lm_head.packed.kinds == ["Q6_K"] and auto.lm_head.packed.interleaved == [True]
    assert auto.embed_tokens.gguf is None  # float32 in this file
    a = paged_logits(auto, IDS, [20, 1, 8], "cpu")
    assert torch.equal(a, paged_logits(in_place, IDS, [29], "cpu"))
    b = paged_logits(ref, IDS, [29], "cpu")
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    # kvserve plan's count of what auto holds: the file's bytes, none of them its pages
    from kvserve.models.gguf_file import gguf_weight_bytes

    tensors = parsed_gguf(path).tensors
    size = {k: sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == k)
            for k in ("Q4_K", "Q6_K")}
    floats = sum(int(t.n_elements) * 4 for t in tensors if t.tensor_type.name == "F32")
    held = gguf_weight_bytes(path, torch.float32, in_place=False)
    assert held.in_place == 0 and held.resident == size["Q4_K"] + size["Q6_K"] + floats


def test_iq4_layers_read_the_files_codes(tmp_path_factory):
    """An IQ4_XS file (attn_v in IQ4_NL): under `gguf` every matrix is read in place by
    gguf_linear, its 16 non-uniform levels as they are (the int4 tiles `auto` would make of
    them cannot hold them exactly); logits the same whatever the chunking and close to the
    float32 model on gguf's dequantization of the same blocks."""
    from kvserve.layers.linear import LinearBase

    _, (in_place, ref) = _packed_models(
        tmp_path_factory, "iq4", ("gguf", "none"),
        {"hidden_size": 256, "intermediate_size": 256}, {"random_iq4": True})
    layers = [m for m in in_place.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) for m in layers)
    kinds = {k for m in layers for k in m.packed.kinds}
    assert kinds == {"IQ4_XS", "IQ4_NL"} and in_place.lm_head.packed.kinds == ["IQ4_XS"]
    a = paged_logits(in_place, IDS, [20, 1, 8], "cpu")
    assert torch.equal(a, paged_logits(in_place, IDS, [29], "cpu"))
    b = paged_logits(ref, IDS, [29], "cpu")
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_mxfp4_layers_read_the_files_codes(tmp_path_factory):
    """An MXFP4 file (attn_v in IQ4_NL): under `gguf` every matrix is read in place by
    gguf_linear, logits the same whatever the chunking and close to the float32 model on
    gguf's dequantization of the same blocks. `auto` serves both on gguf_linear too (their own
    values: the int4 tiles would move them), interleaved at load, every layer giving the bits
    it gives in place; kvserve plan counts the file's bytes in place, and under auto the same
    bytes in the process's memory."""
    from kvserve.layers.linear import LinearBase
    from kvserve.models.gguf_file import gguf_weight_bytes

    path, (in_place, ref, auto) = _packed_models(
        tmp_path_factory, "mxfp4", ("gguf", "none", "auto"),
        {"hidden_size": 256, "intermediate_size": 256}, {"random_mxfp4": True})
    layers = [m for m in in_place.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) for m in layers)
    kinds = {k for m in layers for k in m.packed.kinds}
    assert kinds == {"MXFP4", "IQ4_NL"} and in_place.lm_head.packed.kinds == ["MXFP4"]
    a = paged_logits(in_place, IDS, [20, 1, 8], "cpu")
    assert torch.equal(a, paged_logits(in_place, IDS, [29], "cpu"))
    b = paged_logits(ref, IDS, [29], "cpu")
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    auto_layers = [m for m in auto.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) and all(m.packed.interleaved)
               for m in auto_layers)
    assert {k for m in auto_layers for k in m.packed.kinds} == {"MXFP4", "IQ4_NL"}
    assert torch.equal(paged_logits(auto, IDS, [29], "cpu"), a)
    tensors = parsed_gguf(path).tensors
    quantized = [t for t in tensors if t.tensor_type.name in ("MXFP4", "IQ4_NL")]
    assert {t.tensor_type.name for t in quantized} == {"MXFP4", "IQ4_NL"}
    floats = sum(int(t.n_elements) * 4 for t in tensors if t.tensor_type.name == "F32")
    held = gguf_weight_bytes(path, torch.float32, in_place=True)
    assert held.in_place == sum(int(t.n_bytes) for t in quantized)
    assert held.resident == held.in_place + floats
    held = gguf_weight_bytes(path, torch.float32, in_place=False)
    assert held.in_place == 0  # interleaved at load into the process's memory
    assert held.resident == sum(int(t.n_bytes) for t in quantized) + floats


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(path, torch.float32, torch.device("cpu"), _backend)


def _random_blocks(kind: str, rows: int, cols: int, seed: int):
    """Random raw blocks of a GGUF type, their float16 scale fields set to sane values (any
    bits are a valid block but for NaN/inf halves); MXFP4's exponents e to weights of at most
    12 x 2^(e - 128) = 0.047 (e <= 120), as a real block's."""
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    if kind == "MXFP4":
        blocks[..., 0] = rng.integers(117, 121, size=(rows, cols // per), dtype=np.uint8)
        return blocks.reshape(rows, -1)
    if kind == "Q6_K":  # its float16 d is the block's last field
        d = (rng.random((rows, cols // per, 1)) * 0.02 + 0.001).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // per, 2)
        return blocks.reshape(rows, -1)
    halves = 2 if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1
    vals = (rng.random((rows, cols // per, halves)) * 0.02 + 0.001).astype(np.float16)
    if kind in ("Q4_1", "Q5_1"):
        vals[..., 1] = -vals[..., 1]  # the minimum
    blocks[..., :2 * halves] = vals.view(np.uint8).reshape(rows, cols // per, 2 * halves)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                  "Q6_K"])
def test_gguf_blocks_decode_to_the_kernels_groups(kind):
    """Each type's blocks as the VNNI kernel's groups (codes, scale, minimum per 32; per 16 for
    Q6_K, symmetric) stand for exactly the weights gguf dequantizes; K-quants up to the
    float16 rounding of a super-block scale times a sub-block scale."""
    from kvserve.models.gguf_quants import decode_groups

    raw = _random_blocks(kind, 8, 512, seed=len(kind))
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    groups = decode_groups(raw, kind, 8, 512)
    assert groups.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert groups.group == (16 if kind == "Q6_K" else 32)
    if kind == "Q6_K":  # 6-bit codes q - 32, stored as q - 32 + 128
        assert int(groups.q.min()) >= 96 and int(groups.q.max()) <= 159
        assert torch.equal(groups.m, -128 * groups.d)
    else:
        assert int(groups.q.max()) < 2 ** (4 if groups.bits == 4 else 5 if kind != "Q8_0"
                                           else 8)
    got = groups.dequantized().numpy()
    if kind.endswith("_K"):
        _assert_within_half_rounding(groups, got, ref)
    else:
        np.testing.assert_array_equal(got, ref)


def _assert_within_half_rounding(groups, got, ref) -> None:
    """|got - ref| within what rounding each group's scale and minimum to float16 allows:
    2^-11 relative on each, q * |d| + |m| per weight."""
    d = groups.d.abs().repeat_interleave(groups.group, 1)
    m = groups.m.abs().repeat_interleave(groups.group, 1)
    # symmetric (per 16): w = (q - 128) d, so only |q - 128| d is rounded
    rounded = ((groups.q.float() - 128).abs() * d if groups.group == 16
               else groups.q.float() * d + m)
    # plus float32's own rounding of q d + m
    bound = (2.0 ** -11 * rounded + 2.0 ** -22 * (groups.q.float() * d + m)).numpy() + 1e-7
    assert (np.abs(got - ref) <= bound).all()


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q5_0,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_floats_from_the_groups_equal_gguf_dequantization(qtype, tiny_llama_dir, tmp_path,
                                                         monkeypatch):
    """The loader reads these types' projection floats from the kernel groups, or leaves them
    in place (GGUFTensor): every tensor it yields, dequantized, is bit for bit what gguf's own
    dequantization gives, in the weight's row order."""
    from kvserve.models import gguf_file, loader

    path = tmp_path / "tiny-q.gguf"
    write_gguf(tiny_llama_dir, path, qtype=qtype)
    cfg = loader.read_model_config(path)

    def tensors():
        return [(n, w.dequantized() if isinstance(w, GGUFTensor) else w) for n, w, _ in
                gguf_file.iter_gguf_tensors(gguf.GGUFReader(str(path)), cfg)]

    in_place = tensors()
    monkeypatch.setattr(gguf_file, "gguf_native", lambda kind: False)
    fast = tensors()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(in_place, fast, strict=True))
    monkeypatch.setattr(gguf_file, "_EXACT_FROM_GROUPS", set())
    slow = tensors()
    assert [n for n, _ in fast] == [n for n, _ in slow]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fast, slow, strict=True))


@pytest.mark.slow
def test_gemma3_tensors_keep_their_codes(gemma3_path):
    """On the real Gemma 3 270M file: every projection decodes to gguf's dequantization (Q6_K
    with its scales per 16 inputs)."""
    from kvserve.models.gguf_quants import decode_groups

    reader = parsed_gguf(gemma3_path)
    seen = set()
    for t in reader.tensors:
        if not t.name.startswith("blk.1.") or len(t.shape) != 2:
            continue
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        groups = decode_groups(t.data, t.tensor_type.name, *ref.shape)
        seen.add(t.tensor_type.name)
        assert groups.group == (16 if t.tensor_type.name == "Q6_K" else 32)
        got = groups.dequantized().numpy()
        if t.tensor_type.name.endswith("_K"):
            _assert_within_half_rounding(groups, got, ref)
        else:
            np.testing.assert_array_equal(got, ref)
    assert {"Q4_K", "Q5_0", "Q8_0", "Q6_K"} <= seen


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q5_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_quantized_gguf_serves_its_own_codes(qtype, tiny_llama_dir, tmp_path):
    """`--quantization auto` in bf16: every projection keeps the file's codes on the VNNI
    kernel, in its own precision class; `gguf` reads them in place (gguf_linear); either
    model stays close to its float32 self."""
    from kvserve import kernels
    from kvserve.layers.linear import LinearBase

    if kernels.quant_kernels(torch.bfloat16, "cpu", 16, 32) is None:
        pytest.skip("needs the VNNI kernel")
    path = tmp_path / "tiny-q.gguf"
    write_gguf(tiny_llama_dir, path, qtype=qtype)
    model, in_place = (load_model(path, torch.bfloat16, torch.device("cpu"), _backend).model
                       for _ in range(2))
    ref = load_model(path, torch.float32, torch.device("cpu"), _backend).model
    model.pack_("auto")
    in_place.pack_("gguf")
    bits = 4 if qtype == gguf.GGMLQuantizationType.Q4_0 else 8
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m is not model.lm_head]
    assert all(m.packed.exact and m.packed.method == f"int{bits}" for m in layers)
    layers = [m for m in in_place.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) and set(m.packed.kinds) == {qtype.name}
               for m in layers)
    a = paged_logits(ref, IDS, [29], "cpu")
    for m in (model, in_place):
        b = paged_logits(m, IDS, [29], "cpu").float()
        # bf16 activations, quantized to int8 per group, against float32 throughout (bf16
        # alone moves this tiny model's logits by 3-4% of their range; the codes' exactness
        # is checked block by block above)
        assert (a - b).abs().max() / a.abs().max() < 0.1
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85


def _assert_same_parse(ours, theirs) -> None:
    """Two readers of one file give the same fields (names, offsets, types, data indices,
    parts as the same bytes in the same dtypes and shapes) and the same tensors' metadata."""
    assert list(ours.fields) == list(theirs.fields)
    for name, a in ours.fields.items():
        b = theirs.fields[name]
        assert (a.name, a.offset, a.types, a.data, len(a.parts)) == \
            (b.name, b.offset, b.types, b.data, len(b.parts)), name
        for x, y in zip(a.parts, b.parts, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    assert [(t.name, t.tensor_type, list(t.shape), t.n_elements, t.data_offset)
            for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.n_elements, t.data_offset)
         for t in theirs.tensors]


def _assert_same_reading(path) -> None:
    """kvserve's reader and gguf's own parse alike (_assert_same_parse); an array's values
    read in one pass (array_values) are its elements read from gguf's parts one by one."""
    from kvserve.gguf_reader import GGUFReader, array_values

    ours, theirs = GGUFReader(path), gguf.GGUFReader(path)
    _assert_same_parse(ours, theirs)
    arrays = 0
    for name, a in ours.fields.items():
        b = theirs.fields[name]
        if a.types[:1] == [gguf.GGUFValueType.ARRAY]:
            strings = a.types[1:] == [gguf.GGUFValueType.STRING]
            want = [bytes(b.parts[i]).decode("utf-8", "replace") if strings
                    else b.parts[i][0].item() for i in b.data]
            got = array_values(a)
            assert got == want and [type(v) for v in got] == [type(v) for v in want], name
            arrays += 1
    assert arrays > 0


def test_reader_fields_equal_gguf_readers_on_a_written_file(tiny_llama_dir, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, path, qtype=gguf.GGMLQuantizationType.Q8_0)
    _assert_same_reading(path)


@pytest.mark.slow
@pytest.mark.real_model
def test_reader_fields_equal_gguf_readers_on_the_default_model(real_model_path):
    _assert_same_reading(real_model_path)


def test_the_references_plain_view_reader_parses_as_gguf_reader(tiny_llama_dir, tmp_path):
    """The references parse files with gguf-py's reader over a plain ndarray view of its
    memory map (`conftest.parsed_gguf`, for speed): the same fields, parts and tensors, byte
    for byte, as gguf-py's reader over the memmap itself."""
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, path, qtype=gguf.GGMLQuantizationType.Q8_0)
    plain, theirs = parsed_gguf(path), gguf.GGUFReader(path)
    assert type(plain.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    _assert_same_parse(plain, theirs)
    assert len(plain.tensors) > 0
    for a, b in zip(plain.tensors, theirs.tensors, strict=True):
        assert a.data.dtype == b.data.dtype and a.data.tobytes() == b.data.tobytes(), a.name
