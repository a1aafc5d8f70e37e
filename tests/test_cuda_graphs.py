"""Decode steps replayed from static buffers (worker.cuda_graphs), on the CPU: the Triton
attention kernels under Triton's interpreter (KVSERVE_TRITON_ON_CPU, conftest's
TRITON_INTERPRET) and `eager_capture` in place of a CUDA graph, so the buffers, the padding
and the choice of graph are the ones a GPU replays. The CUDA suite captures real graphs."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.kernels import triton_paged
from kvserve.sample.sampling_params import SamplingParams
from kvserve.worker.cuda_graphs import eager_capture
from kvserve.worker.forward import ForwardItem
from kvserve.worker.model_runner import run_forward

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not triton_paged.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton, run under its interpreter (conftest sets TRITON_INTERPRET=1 "
           "without a GPU)")]


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv("KVSERVE_TRITON_ON_CPU", "1")


def test_padding_rows_write_nothing_and_rows_match_eager(tiny_llama_dir):
    # target_itl_ms=0: no start-up calibration, whose steps the interpreter would run too
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=4, max_num_seqs=8,
              target_itl_ms=0)
    try:
        runner = llm.engine.local_core.runner
        assert runner.can_capture_graphs()
        runner.capture_decode_graphs(8, 64, capture=eager_capture)
        graphs = runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]

        def items(n: int, first_block: int) -> list[ForwardItem]:
            # request i at position 5 + 2i, its blocks first_block + 4i ...
            return [ForwardItem([(7 * i) % 200 + 3], 5 + 2 * i,
                                list(range(first_block + 4 * i, first_block + 4 * i + 4)), 1)
                    for i in range(n)]

        def run(step: list[ForwardItem]) -> torch.Tensor:
            """The step replayed; only its own slots of the caches change."""
            before = [kv.clone() for kv in runner.kv_caches]
            hidden = graphs.run(step)
            written = {it.block_ids[it.start // 4] * 4 + it.start % 4 for it in step}
            for kv, old in zip(runner.kv_caches, before, strict=True):
                changed = (kv != old).flatten(0, 1).any(0).any(-1).nonzero().flatten()
                assert set(changed.tolist()) == written
            return hidden

        five = items(5, 0)  # padded to 8
        hidden = run(five)
        assert graphs.replays == 1
        assert torch.equal(hidden, run_forward(runner.model, runner.kv_caches, 4, five,
                                               runner.device))
        three = items(3, 40)  # padded to 4: rows 3.. of the buffers held five's rows
        hidden = run(three)
        assert torch.equal(hidden, run_forward(runner.model, runner.kv_caches, 4, three,
                                               runner.device))
        assert not graphs.fits([ForwardItem([1, 2], 0, [0], 1)])  # a prompt chunk
        assert not graphs.fits(items(9, 0))
    finally:
        llm.close()


def test_engine_tokens_with_decode_graphs(tiny_gemma3_dir, monkeypatch):
    """The tiny Gemma 3 (sliding-window and global layers: two block tables per request):
    greedy tokens with decode steps replayed equal those of the C++ kernels' eager steps, as
    requests join (prompts run eagerly) and leave (the batch shrinks onto smaller padded
    sizes)."""
    prompts = [[(13 * i + 5 * j) % 200 + 2 for j in range(6 + 5 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(5)]

    def run(graphs: bool) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_gemma3_dir), dtype="float32", block_size=4, max_num_seqs=4,
                  target_itl_ms=0)  # no calibration: its steps would be interpreted too
        try:
            runner = llm.engine.local_core.runner
            if graphs:
                runner.capture_decode_graphs(4, 128, capture=eager_capture)
            outs = llm.generate(prompts, params)
            return ([list(o.outputs[0].token_ids) for o in outs],
                    runner.graphs.replays if runner.graphs else 0)
        finally:
            llm.close()

    monkeypatch.delenv("KVSERVE_TRITON_ON_CPU")
    cpp, _ = run(False)
    monkeypatch.setenv("KVSERVE_TRITON_ON_CPU", "1")
    replayed, replays = run(True)
    assert replayed == cpp
    assert replays > 5
