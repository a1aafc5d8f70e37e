"""The engine core in its own process (`engine_process`): the same tokens, outputs and
errors as on the engine thread, through the server too, and a dead core is reported, not
waited on."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from kvserve.engine.core import EngineDeadError
from kvserve.engine.llm_engine import EngineArgs
from kvserve.outputs import OutputKind
from kvserve.sample.sampling_params import SamplingParams, StructuredOutputs
from kvserve.sample.structured import StructuredOutputError
from tests.conftest import make_llm
from tests.server_utils import openai_client, run_server

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13] * 6, [40, 41] * 20, [7] * 3, [8, 9] * 5]


def _generate(llm) -> list:
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=10, logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, seed=1, max_tokens=9, stop=["a"]),
              SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[3, 4, 5, 6]),
              SamplingParams(temperature=0.9, seed=2, max_tokens=20, prompt_logprobs=2,
                             structured_outputs=StructuredOutputs(regex="[a-c]{3}-[0-9]"))]
    outs = llm.generate(PROMPTS, params)
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason,
             [(lp.token_id, lp.logprob) for lp in c.logprobs or []])
            for o in outs for c in o.outputs] + [
        [(lp.token_id, lp.logprob) for lp in outs[-1].prompt_logprobs[1:]],
        llm.embed(PROMPTS[:2])]


def test_same_outputs_as_on_the_engine_thread(tiny_llama_dir):
    here = make_llm(tiny_llama_dir)
    want = _generate(here)
    with make_llm(tiny_llama_dir, engine_process=True) as there:
        assert _generate(there) == want
        engine = there.engine
        engine.check_integrity()  # a call across the pipe
        # the facts are here; the parts are in the child, and asking for them says so
        assert engine.model_config == here.engine.model_config
        assert engine.max_model_len == here.engine.max_model_len and engine.workers is None
        with pytest.raises(RuntimeError, match="--engine-process"):
            engine.local_core.kv  # noqa: B018
        assert engine.stats().kv_free_blocks == engine.stats().kv_blocks
        # Errors cross the pipe as the engine thread raises them.
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("big", [5] * 10, SamplingParams(max_tokens=10**6))
        with pytest.raises(StructuredOutputError, match="regex"):
            engine.add_request("re", [5], SamplingParams(
                structured_outputs=StructuredOutputs(regex="(")))
        # A stream of deltas and an abort.
        engine.add_request("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=30,
                                                          ignore_eos=True),
                           output_kind=OutputKind.DELTA)
        engine.step()
        engine.step()
        assert engine.abort_request("s")
        (out,) = engine.step()
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert engine.stats().kv_free_blocks == engine.stats().kv_blocks
    assert not engine.core._proc.is_alive()  # closed with the LLM


def test_a_dead_core_is_reported(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, engine_process=True)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    os.kill(engine.core._proc.pid, signal.SIGKILL)
    engine.core._proc.join(10)
    with pytest.raises(EngineDeadError, match="exited"):
        engine.step()
    assert "exited" in engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=5))
    llm.close()


def test_server_with_the_core_in_its_own_process(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                      num_kv_blocks=256, engine_process=True)
    with run_server(args) as (url, _):
        client = openai_client(f"{url}/v1", strict=False)  # LOOSE_BECAUSE
        kw = dict(model=client.models.list().data[0].id, prompt="hello", max_tokens=8,
                  temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw,
                                                                                 stream=True))
        assert whole.choices[0].text == streamed and whole.usage.completion_tokens == 8
        stats = httpx.get(f"{url}/v1/engine/stats").json()
        assert stats["kv"]["free_blocks"] == stats["kv"]["blocks"]
        assert httpx.get(f"{url}/v1/engine/steps").json()["data"]
        assert httpx.get(f"{url}/v1/requests/{whole.id}/timeline").status_code == 200
