"""Engine end to end on a tiny random model: batching invariance under chunked prefill and
preemption, n > 1 sharing the prompt's blocks, seeds, stop strings, aborts, clear errors."""

from __future__ import annotations

import random

import pytest

from kvserve.outputs import OutputKind
from kvserve.sample.sampling_params import SamplingParams
from tests.conftest import make_llm

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


@pytest.mark.slow
def test_batching_invariance_with_chunking_and_preemption(tiny_llama_dir):
    prompts = random_prompts(16)
    alone_llm = make_llm(tiny_llama_dir)
    alone = [alone_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    # A small budget chunks the long prompts; 60 blocks of 4 cannot hold 16 requests of up
    # to 93 tokens, so requests get preempted and recomputed.
    llm = make_llm(tiny_llama_dir, num_kv_blocks=60, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.local_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    preempted = llm.engine.local_core.scheduler.num_preemptions
    assert sum(o.metrics.num_preemptions for o in outs) == preempted
    llm.engine.check_integrity()
    assert llm.engine.local_core.kv.num_free_blocks == llm.engine.local_core.kv.num_blocks


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234,
                            ignore_eos=True)
    prompt = random_prompts(1, seed=5)[0]
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = [prompt if i == 3 else p for i, p in enumerate(random_prompts(8, seed=6))]
    params = [seeded if i == 3 else others for i in range(8)]
    assert llm.generate(batch, params)[3].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_kv_blocks=64)
    engine = llm.engine
    prompt = random_prompts(1, seed=9)[0] + list(range(2, 42))  # >= 10 full blocks
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    engine.add_request("x", prompt, params)
    while len(engine.local_core.scheduler.running) < 4:  # the prompt spans two steps' budgets
        engine.step()
    full = (len(prompt) - 1) // 4
    tables = [r.block_ids for r in engine.local_core.scheduler.running]
    assert len(tables) == 4
    for t in tables[1:]:
        assert t[:full] == tables[0][:full]  # the prompt's full blocks are shared
    assert engine.local_core.kv.num_blocks - engine.local_core.kv.num_free_blocks < 4 * (full + 1)
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    # sample i is seeded with seed + i, so the samples differ and are reproducible
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    engine.check_integrity()


def _ascii_run(text: str) -> int | None:
    """Start of the first 3-character printable ASCII run that occurs only there."""
    for i in range(1, len(text) - 3):
        sub = text[i:i + 3]
        if all(" " <= ch <= "~" for ch in sub) and text.find(sub) == i:
            return i
    return None


def test_stop_string_across_tokens_is_cut_from_text(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    # The random model babbles bytes; find a prompt whose output has an ASCII run to stop on.
    for seed in range(50):
        prompt = random_prompts(1, seed=seed)[0]
        free = llm.generate([prompt], GREEDY)[0].outputs[0]
        at = _ascii_run(free.text)
        if at is not None:
            break
    assert at is not None
    stop = free.text[at:at + 3]  # one token per byte: the stop string spans three tokens
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:at]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                include_stop_str_in_output=True,
                                                ignore_eos=True))[0].outputs[0]
    assert out.text == free.text[:at + 3]


def test_stop_token_ids_and_eos(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=3)[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0]
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free.token_ids[:first + 1]
    # min_tokens holds the stop token back
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=10,
                                                stop_token_ids=[target]))[0].outputs[0]
    assert len(out.token_ids) >= 10


def test_length_finish_and_metrics(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    m = out.metrics
    assert m.num_prompt_tokens == 3 and m.num_generation_tokens == 5
    assert 0 <= m.queue_time <= m.ttft <= m.e2e_time
    assert m.prefill_time >= 0 and m.decode_time >= 0 and m.tpot > 0


def test_logprobs(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)


def test_abort_frees_blocks_and_reports(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_request("a", random_prompts(1)[0], GREEDY)
    engine.add_request("b", random_prompts(1, seed=1)[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].outputs[0].finish_reason == "abort" and aborted[0].finished
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.local_core.kv.num_free_blocks == engine.local_core.kv.num_blocks


def test_streaming_deltas_add_up(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_request("s", "hello there", SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True))
    text, ids = "", []
    while engine.has_unfinished_requests():
        for o in engine.step():
            text += o.outputs[0].delta_text
            ids += o.outputs[0].delta_token_ids
            last = o
    assert last.finished and text == last.outputs[0].text and ids == last.outputs[0].token_ids


def test_output_kinds_hold_the_same_generation(tiny_llama_dir):
    """CUMULATIVE, DELTA and FINAL_ONLY outputs of one request (n=2, logprobs, a stop
    string) put back together are the same text, tokens and logprobs; DELTA outputs hold
    only what is new and FINAL_ONLY ones nothing before the last."""
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    prompt = random_prompts(1, seed=4)[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:2]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, logprobs=2,
                            stop=[stop] if stop else None, ignore_eos=True)
    runs = {}
    for kind in OutputKind:
        engine.add_request(kind.value, prompt, params, output_kind=kind)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == kind.value]
        runs[kind] = outs
        for o in outs:
            for c in o.outputs:
                assert c.num_output_tokens >= len(c.delta_token_ids)
                if kind is OutputKind.DELTA:
                    assert c.text == c.delta_text and c.token_ids == c.delta_token_ids
                    assert len(c.logprobs) == len(c.token_ids)
                if kind is OutputKind.FINAL_ONLY and not o.finished:
                    assert c.text == "" and c.token_ids == [] and c.logprobs == []
    final = runs[OutputKind.CUMULATIVE][-1]
    assert final.finished and runs[OutputKind.FINAL_ONLY][-1].outputs == final.outputs
    for c in final.outputs:
        assert c.num_output_tokens == len(c.token_ids) == len(c.logprobs)
        deltas = [o.outputs[c.index] for o in runs[OutputKind.DELTA]]
        assert "".join(d.text for d in deltas) == c.text
        assert [t for d in deltas for t in d.token_ids] == c.token_ids
        assert [lp for d in deltas for lp in d.logprobs] == c.logprobs
        steps = [o.outputs[c.index] for o in runs[OutputKind.CUMULATIVE]]
        assert "".join(d.delta_text for d in steps) == c.text
    engine.check_integrity()


def test_chat_uses_the_template(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == \
        "<s>user: hi</s><s>assistant: "


@pytest.mark.parametrize("prompt, params, match", [
    ([5] * 500, SamplingParams(max_tokens=20), "max_model_len"),
    ([1, 2, 3], SamplingParams(max_tokens=600), "max_model_len"),
    ([1, 2, 999], SamplingParams(), "out of range"),
    ([], SamplingParams(), "empty"),
    ([1, 2], SamplingParams(logit_bias={400: 1.0}), "logit_bias"),
])
def test_bad_requests_are_rejected_clearly(tiny_llama_dir, prompt, params, match):
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_a_batch_of_prompts_is_queued_whole_or_not_at_all(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 3], [4, 5], [1, 999]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().waiting == 0 and llm.engine.stats().running == 0
    with pytest.raises(ValueError, match="given twice"):
        llm.engine.add_requests([("x", [1, 2], GREEDY), ("x", [3, 4], GREEDY)])
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]]


def test_bad_sampling_values_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_prompt_logprobs_match_transformers_across_chunks_and_cache(tiny_llama_dir):
    """Prompt logprobs computed chunk by chunk (16-token steps) are those of one transformers
    pass; a repeat of the prompt, whose blocks are cached, still gets them all."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16)
    prompt = random_prompts(1, seed=9)[0] + list(range(5, 40))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    (out,) = llm.generate([prompt], params)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i, lp in enumerate(lps[1:]):
        assert lp.token_id == prompt[i + 1]
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()
    (again,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                      prompt_logprobs=3))
    assert [(lp.token_id, lp.logprob) for lp in again.prompt_logprobs[1:]] == \
        [(lp.token_id, lp.logprob) for lp in lps[1:]]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    llm.engine.check_integrity()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_transformers_and_share_batches(tiny_llama_dir, pooling):
    import torch
    from transformers import AutoModel

    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16)
    prompts = [list(range(5, 45)), [7, 8, 9]]
    alone = llm.embed(prompts, pooling)
    hf = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for p, e in zip(prompts, alone, strict=True):
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0]
        ref = torch.nn.functional.normalize(h.mean(0) if pooling == "mean" else h[-1], dim=0)
        assert torch.allclose(torch.tensor(e), ref, atol=1e-5)
    # Embedding and generation requests in one batch: neither changes the other.
    gen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (want,) = llm.generate([[3, 4, 5]], gen)
    outs = llm.generate([prompts[0], [3, 4, 5], prompts[1]],
                        [SamplingParams(max_tokens=1, pooling=pooling), gen,
                         SamplingParams(max_tokens=1, pooling=pooling)])
    assert [outs[0].embedding, outs[2].embedding] == alone
    assert outs[1].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == [] and outs[0].finished
    llm.engine.check_integrity()
