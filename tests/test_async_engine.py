"""AsyncEngine on a tiny model: concurrent streams, early exit aborts, errors surface."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.async_engine import AsyncEngine, QueueFullError
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def make(path, **kw) -> AsyncEngine:
    args = EngineArgs(model=str(path), dtype="float32", block_size=4, num_kv_blocks=128)
    return AsyncEngine(lambda: LLMEngine(args), **kw)


async def _tokens(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    last = None
    async for out in engine.generate(rid, prompt, PARAMS):
        last = out
    assert last is not None and last.finished
    return last.outputs[0].token_ids


def test_concurrent_streams_equal_sequential(tiny_llama_dir):
    async def run():
        engine = make(tiny_llama_dir)
        await engine.start()
        prompts = [[5 + i, 6, 7 + i] for i in range(8)]
        alone = [await _tokens(engine, f"a{i}", p) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(_tokens(engine, f"b{i}", p)
                                          for i, p in enumerate(prompts)))
        engine.stop()
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert alone == together


def test_leaving_a_stream_early_aborts_and_frees_blocks(tiny_llama_dir):
    async def run():
        engine = make(tiny_llama_dir)
        llm = await engine.start()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        async for _ in engine.generate("x", [5, 6, 7], params):
            break  # the caller goes away after the first output
        for _ in range(100):
            if llm.kv.num_free_blocks == llm.kv.num_blocks and not engine.num_unfinished:
                break
            await asyncio.sleep(0.01)
        engine.stop()
        return llm

    llm = asyncio.run(run())
    assert llm.kv.num_free_blocks == llm.kv.num_blocks
    assert not llm.has_unfinished_requests()
    llm.check_integrity()


def test_bad_request_and_full_queue(tiny_llama_dir):
    async def run():
        engine = make(tiny_llama_dir, max_waiting_requests=0)
        await engine.start()
        with pytest.raises(QueueFullError):
            await engine.add_request("q", [1, 2], PARAMS)
        engine.max_waiting_requests = None
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("big", [5] * 600, PARAMS)
        assert engine.num_unfinished == 0
        engine.stop()

    asyncio.run(run())


def test_load_failure_is_raised(tmp_path):
    async def run():
        engine = AsyncEngine(lambda: LLMEngine(EngineArgs(model=str(tmp_path / "nope.gguf"))))
        with pytest.raises(ValueError, match="not found"):
            await engine.start()

    asyncio.run(run())
