"""The Triton paged-attention kernels (kernels/triton_paged.py) against a float64 reference,
with padding rows, and a row's independence of its batch and of how its prompt was chunked,
bit for bit.

On a machine without CUDA they run on the CPU under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), which executes the kernels' own program logic (tiles, masks, the online
softmax) with numpy; on a GPU the same tests run the compiled kernels on it."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.kernels import triton_paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not triton_paged.available(), reason="triton not installed"),
    pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="without a GPU these run under Triton's interpreter "
                              "(TRITON_INTERPRET=1, set by conftest)"),
]

OPS = triton_paged.TritonPagedAttention()


class Paged:
    """A cache of random K/V for sequences of given context lengths, scattered over
    shuffled blocks."""

    def __init__(self, ctx_lens: list[int], hkv: int, d: int, block_size: int,
                 dtype=torch.float32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.bs, self.hkv, self.d = block_size, hkv, d
        num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
        self.cache = torch.zeros(2, hkv, num_blocks * block_size, d, dtype=dtype,
                                 device=DEVICE)
        free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
        for table, c in zip(self.tables, ctx_lens, strict=True):
            k = torch.randn(c, hkv, d, generator=g).to(DEVICE, dtype)
            v = torch.randn(c, hkv, d, generator=g).to(DEVICE, dtype)
            OPS.store_kv(self.cache, self.slots(table, 0, c), k, v)

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        return torch.tensor([table[p // self.bs] * self.bs + p % self.bs
                             for p in range(start, end)], device=DEVICE)

    def attend(self, q: torch.Tensor, seqs: list[tuple[int, int]], which: list[int],
               window: int = 0) -> torch.Tensor:
        """q [T, H, D] for sequences `which` with (rows, context length) `seqs`."""
        first, rows = 0, []
        for n, c in seqs:
            rows.append((first, n, c))
            first += n
        width = max(len(self.tables[i]) for i in which)
        tables = torch.tensor([self.tables[i] + [0] * (width - len(self.tables[i]))
                               for i in which], device=DEVICE)
        return OPS.paged_attention(q.to(DEVICE), self.cache, torch.tensor(rows, device=DEVICE),
                                   tables, self.bs, self.d ** -0.5, window).cpu()

    def reference(self, q: torch.Tensor, seqs: list[tuple[int, int]], which: list[int],
                  window: int = 0) -> torch.Tensor:
        out, first = torch.zeros(q.shape, dtype=torch.float64), 0
        group = q.shape[1] // self.hkv
        for (n, c), i in zip(seqs, which, strict=True):
            s = self.slots(self.tables[i], 0, c)
            k, v = self.cache[0][:, s].double().cpu(), self.cache[1][:, s].double().cpu()
            for r in range(n):
                p = c - n + r
                lo = max(0, p - window + 1) if window else 0
                for h in range(q.shape[1]):
                    scores = k[h // group, lo:p + 1] @ q[first + r, h].double()
                    out[first + r, h] = (scores * self.d ** -0.5).softmax(0) @ \
                        v[h // group, lo:p + 1]
            first += n
        return out


# (rows, context): a prompt chunk after context, a decode, a fresh prompt, drafts verified,
# and a decode over three key tiles (TILE_N = 64).
MIXED = [(5, 20), (1, 33), (19, 19), (3, 41), (2, 150)]
assert MIXED[-1][1] > 2 * triton_paged.TILE_N


@pytest.mark.parametrize("block_size", [4, 48])
@pytest.mark.parametrize("window", [0, 7, 70])
def test_matches_the_reference(block_size, window):
    # 6 query heads over 2 KV heads (a group of 3, padded to 4 in the kernel), head_dim 48
    # (padded to 64): neither a power of two.
    paged = Paged([c for _, c in MIXED], hkv=2, d=48, block_size=block_size)
    q = torch.randn(sum(n for n, _ in MIXED), 6, 48, generator=torch.Generator().manual_seed(1))
    which = list(range(len(MIXED)))
    out = paged.attend(q, MIXED, which, window)
    torch.testing.assert_close(out.double(), paged.reference(q, MIXED, which, window),
                               atol=2e-6, rtol=2e-6)


def test_bf16_matches_the_reference():
    paged = Paged([c for _, c in MIXED], hkv=1, d=64, block_size=16, dtype=torch.bfloat16)
    q = torch.randn(sum(n for n, _ in MIXED), 4, 64,
                    generator=torch.Generator().manual_seed(2)).bfloat16()
    which = list(range(len(MIXED)))
    out = paged.attend(q, MIXED, which)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), paged.reference(q, MIXED, which),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [0, 9, 70])
def test_a_row_ignores_its_batch_and_its_chunking(window):
    """A 150-token prompt (three key tiles) attended whole, in chunks of 5/70/75 (each after
    the ones before), and its rows alone or beside other sequences: every row's output is
    the same bits. Rows share query tiles differently each time, so each sees different
    fully masked key tiles before and after its own."""
    ctx = [150, 33, 12]
    paged = Paged(ctx, hkv=2, d=32, block_size=4)
    q = torch.randn(150, 4, 32, generator=torch.Generator().manual_seed(3))
    other = torch.randn(12 + 1, 4, 32, generator=torch.Generator().manual_seed(4))
    whole = paged.attend(q, [(150, 150)], [0], window)
    pieces, start = [], 0
    for n in (5, 70, 75):
        pieces.append(paged.attend(q[start:start + n], [(n, start + n)], [0], window))
        start += n
    assert torch.equal(torch.cat(pieces), whole)
    # The middle chunk between a decode and a fresh prompt, and a decode of the last row.
    batch = torch.cat((other[:1], q[5:75], other[1:]))
    mixed = paged.attend(batch, [(1, 33), (70, 75), (12, 12)], [1, 0, 2], window)
    assert torch.equal(mixed[1:71], whole[5:75])
    decode = paged.attend(q[149:150], [(1, 150)], [0], window)
    assert torch.equal(decode, whole[149:150])


def test_store_skips_padding_rows_and_reads_strided_inputs():
    cache = torch.zeros(2, 2, 16, 8, device=DEVICE)
    qkv = torch.randn(3, 6, 8, device=DEVICE)  # [T, q + k + v heads, D]: strided k and v
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    OPS.store_kv(cache, torch.tensor([5, -1, 9], device=DEVICE), k, v)
    assert torch.equal(cache[0][:, 5], k[0]) and torch.equal(cache[1][:, 9], v[2])
    untouched = torch.ones(16, dtype=torch.bool, device=DEVICE)
    untouched[[5, 9]] = False
    assert not cache[:, :, untouched].any()  # the padding row (slot -1) wrote nothing


def test_programs_past_the_last_tile_do_nothing():
    """The grid (T // ROWS + S programs) is a bound fixed by the batch's shape: two
    sequences of 10 rows need 2 tiles and get 3 programs; the extra one must not write."""
    paged = Paged([10, 14], hkv=1, d=16, block_size=4)
    q = torch.randn(20, 2, 16, generator=torch.Generator().manual_seed(5))
    seqs = [(10, 10), (10, 14)]
    torch.testing.assert_close(paged.attend(q, seqs, [0, 1]).double(),
                               paged.reference(q, seqs, [0, 1]), atol=2e-6, rtol=2e-6)


def test_kernel_choice_on_cuda_and_the_cpu_switch(monkeypatch):
    from kvserve import kernels

    meta = torch.device("meta")
    assert kernels.attention_kernels(torch.float32, meta, 64) is None
    assert kernels.attention_kernels(torch.bfloat16, "cuda", 64) is kernels._triton()
    assert kernels.attention_kernels(torch.bfloat16, "cuda", 64, torch.int8) is None
    assert kernels.attention_kernels(torch.float32, "cuda", 64, torch.float16) is None
    monkeypatch.setenv("KVSERVE_TRITON_ON_CPU", "1")
    assert kernels.attention_kernels(torch.float32, "cpu", 64) is kernels._triton()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CUDA suite runs the engine on a GPU")
def test_engine_tokens_with_triton_attention(tiny_gemma3_dir, monkeypatch):
    """The engine on the Triton kernels (interpreted, on the CPU): greedy tokens as on the
    C++ kernel, and batched as alone. The tiny Gemma 3 has sliding-window and global
    layers."""
    from kvserve.engine.llm import LLM
    from kvserve.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[(11 * i + 3 * j) % 200 + 2 for j in range(9 + 7 * i)] for i in range(3)]

    def run(batched: bool) -> list[list[int]]:
        llm = LLM(str(tiny_gemma3_dir), dtype="float32", block_size=4,
                  max_num_batched_tokens=16,
                  target_itl_ms=0)  # no calibration: its steps would be interpreted too
        try:
            if batched:
                outs = llm.generate(prompts, params)
            else:
                outs = [llm.generate([p], params)[0] for p in prompts]
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.close()

    cpp = run(True)
    monkeypatch.setenv("KVSERVE_TRITON_ON_CPU", "1")
    assert run(True) == cpp
    assert run(False) == cpp


COMPILE = """
import torch
from kvserve.kernels import triton_paged as tp

for h, hkv, d, dtype in [(32, 8, 128, torch.bfloat16), (9, 3, 64, torch.float32),
                         (4, 1, 256, torch.float16)]:
    q = torch.zeros(40, h, d, dtype=dtype)
    cache = torch.zeros(2, hkv, 64, d, dtype=dtype)
    seqs = torch.zeros(3, 3, dtype=torch.long)
    tables = torch.zeros(3, 4, dtype=torch.long)
    launch = tp.attention_launch(q, cache, seqs, tables, 16, 0.1, 0, torch.empty_like(q), False)
    assert "cubin" in tp.compile_for_gpu("attention", launch).asm
    k = torch.zeros(40, hkv, d, dtype=dtype)
    launch = tp.store_kv_launch(cache, torch.zeros(40, dtype=torch.long), k, k)
    assert "cubin" in tp.compile_for_gpu("store_kv", launch).asm
# Compiled once whatever the step's sequence count and block table width (see STEP_VARYING).
attention = tp._jit()[1]
fixed = {p.name for p in attention.params if p.do_not_specialize}
assert fixed == set(tp.STEP_VARYING) <= set(attention.arg_names), fixed
print("compiled")
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernels are launched, not only built")
def test_the_kernels_compile_for_a_hopper_gpu():
    """The interpreter runs the kernels' logic but not Triton's compiler, which is stricter
    (types must agree across branches, dot shapes have minimums): the kernels are compiled
    here for sm_90, as an H200's first launch would compile them, down to ptxas's binary,
    in bf16, float32 and float16 for the 8B, SmolLM2 and Gemma 3 head shapes."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
