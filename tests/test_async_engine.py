"""AsyncEngine on a tiny model: concurrent streams, early exit aborts, errors surface."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from kvserve.engine.async_engine import AsyncEngine, QueueFullError
from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def make(path, **kw) -> AsyncEngine:
    args = EngineArgs(model=str(path), dtype="float32", block_size=4, num_kv_blocks=128)
    return AsyncEngine(lambda: build_engine(args), **kw)


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
            if llm.local_core.kv.num_free_blocks == llm.local_core.kv.num_blocks and \
                    not engine.num_unfinished:
                break
            await asyncio.sleep(0.01)
        engine.stop()
        return llm

    llm = asyncio.run(run())
    assert llm.local_core.kv.num_free_blocks == llm.local_core.kv.num_blocks
    assert not llm.has_unfinished_requests()
    llm.check_integrity()


def test_bad_request_and_full_queue(tiny_llama_dir):
    async def run():
        engine = make(tiny_llama_dir, max_waiting_requests=0)
        await engine.start()
        with pytest.raises(QueueFullError):
            await engine.add_request("q", [1, 2], PARAMS)
        # a request that could never run is told so, full queue or not
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("big", [5] * 600, PARAMS)
        engine.max_waiting_requests = None
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("big", [5] * 600, PARAMS)
        assert engine.num_unfinished == 0
        engine.stop()

    asyncio.run(run())


def test_requests_predicted_to_miss_the_ttft_target_are_shed(tiny_llama_dir):
    """--shed-late-requests: the start-up calibration has fitted the step cost model, so
    from the first request on a target no request can meet refuses new ones at once, with a
    Retry-After of at least a second, and a generous one refuses none. (Before the
    calibration, nothing was refused until the model had seen 16 steps.)"""
    async def run(target_ms: float) -> None:
        args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", block_size=4,
                          num_kv_blocks=128, target_ttft_ms=target_ms,
                          shed_late_requests=True)
        engine = AsyncEngine(lambda: build_engine(args))
        await engine.start()
        if target_ms < 1:
            with pytest.raises(QueueFullError, match="predicted time to first token") as e:
                await engine.add_request("late", [5, 6, 7], PARAMS)
            assert e.value.retry_after >= 1
            assert engine.num_unfinished == 0
        else:
            assert await _tokens(engine, "in-time", [5, 6, 7]) != []
        engine.stop()

    asyncio.run(run(1e-3))
    asyncio.run(run(60_000))


def test_load_failure_is_raised(tmp_path):
    async def run():
        engine = AsyncEngine(lambda: build_engine(EngineArgs(model=str(tmp_path / "nope.gguf"))))
        with pytest.raises(ValueError, match="not found"):
            await engine.start()

    asyncio.run(run())


def test_readers_on_other_threads_see_only_snapshots(tiny_llama_dir):
    """While the engine thread steps a busy batch, a plain thread polls the published stats
    and the event loop asks for timelines and the dashboard between steps: every snapshot is
    consistent and frozen, and one held across many steps never changes."""
    errors: list[BaseException] = []
    seen: list = []
    stop = threading.Event()

    def poll(engine: AsyncEngine) -> None:
        try:
            while not stop.is_set():
                st = engine.stats
                if st is None:
                    continue
                assert 0 <= st.kv_free_blocks <= st.kv_blocks
                assert st.running + st.waiting <= 12
                numbers = [r.step for r in st.steps]
                assert numbers == sorted(set(numbers))
                assert not st.steps or st.steps[-1].step <= st.num_steps
                seen.append(st)
        except BaseException as e:  # reported by the test body
            errors.append(e)

    async def run():
        engine = make(tiny_llama_dir)
        await engine.start()
        first = engine.stats
        kept = repr(first)
        reader = threading.Thread(target=poll, args=(engine,))
        reader.start()
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

        async def one(i: int) -> None:
            async for _ in engine.generate(f"r{i}", [5 + i, 6, 7, 8 + i], params):
                timeline = await engine.call(lambda e, i=i: e.request_timeline(f"r{i}"))
                assert timeline is None or timeline["id"] == f"r{i}"
                dash = await engine.call(lambda e: e.dashboard_state())
                assert dash["running"] + dash["waiting"] <= 12

        await asyncio.gather(*(one(i) for i in range(12)))
        stop.set()
        reader.join()
        last = engine.stats
        engine.stop()
        return first, kept, last

    first, kept, last = asyncio.run(run())
    assert not errors, errors
    assert len(seen) > 10 and last.num_steps > first.num_steps
    assert repr(first) == kept  # held across the whole run, unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.running = 0  # type: ignore[misc]
    assert sum(r.decode_tokens + r.prefill_tokens for r in last.steps) > 12 * 40
