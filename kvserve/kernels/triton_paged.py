"""Paged attention for GPUs in Triton: the step's K/V written into the paged cache, then every
query row attended to its sequence's context read straight through the block table.

The same calls as the C++ CPU kernel (`store_kv`, `paged_attention`; see csrc/attention.cpp)
on the same cache layout, [2, Hkv, num_slots, D] addressed by slot = block * block size +
offset, so TorchPagedAttention runs either without knowing which. Decode rows, speculative
drafts and prompt chunks all go through the one kernel.

A program owns one KV head and a tile of up to ROWS query rows of one sequence, with the
GROUP query heads that share the KV head stacked into the rows of its matmuls. It walks the
context in tiles of TILE_N key positions from a multiple of TILE_N, with an online softmax in
float32. A row's result therefore depends only on its own query, its context and its
position, never on the other rows of the step: tiles a row does not need (before its window,
after its position) are fully masked, and a fully masked tile leaves the running maximum,
sum and accumulator exactly as they were. So a request's attention does not depend on its
batch or on how its prompt was chunked (torch's GPU matmuls elsewhere in the model still do;
see LlamaForCausalLM.batch_variant_parts).

The grid is (T // ROWS + S, Hkv) for T rows in S sequences: an upper bound on the tiles the
step needs, fixed by the batch's shape alone, so the launch needs no host-side count (and a
CUDA graph can hold it); programs past the last tile return at once. Each finds its sequence
by counting the sequences whose tiles end at or before it.

Tests run these kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1), where
the products are summed one by one (see attention_launch), and compile them for sm_90
(compile_for_gpu). On a GPU the invariance above also rests on tl.dot giving an element the
same value at any row of a tile (the MMA instructions' fixed order): the same tests, run
compiled by the CUDA suite, are what check that.
"""

from __future__ import annotations

from functools import cache

import torch

ROWS = 16  # query rows per program
TILE_N = 64  # key positions per iteration (as flash attention's common 64 x 64 tiles)
# Integer arguments that change from step to step. Triton compiles a kernel anew for each
# integer argument that is 1, a multiple of 16, or neither: unmarked, these would make
# mid-serving eager steps (prefill chunks, which CUDA graphs do not hold) stop for a
# compile of about a second whenever a batch first has 1 sequence or a table width of 16.
STEP_VARYING = ("num_seqs", "t_s", "table_width")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@cache
def _jit():
    """(store_kv kernel, attention kernel, whether they were decorated for Triton's
    interpreter), compiled by Triton on first launch; built on first use so that importing
    kvserve never imports Triton."""
    import triton
    import triton.language as tl
    from triton import knobs

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, cache_ptr, slots_ptr, k_st, k_sh, v_st, v_sh,
                        c_skv, c_sh, c_ss, HKV: tl.constexpr, D: tl.constexpr,
                        HKV_PAD: tl.constexpr, D_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t)
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        # A negative slot is a padding row. (The slot is broadcast before the comparison:
        # Triton's interpreter rejects a mask made with a scalar comparison.)
        mask = (h < HKV) & (d < D) & (slot + tl.zeros([HKV_PAD, D_PAD], tl.int64) >= 0)
        k = tl.load(k_ptr + t * k_st + h * k_sh + d, mask=mask)
        v = tl.load(v_ptr + t * v_st + h * v_sh + d, mask=mask)
        dst = cache_ptr + h.to(tl.int64) * c_sh + slot * c_ss + d
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + c_skv, v.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=STEP_VARYING)
    def attention_kernel(q_ptr, cache_ptr, out_ptr, seqs_ptr, tables_ptr, tile_ends_ptr,
                         num_seqs, q_st, q_sh, o_st, o_sh, c_skv, c_sh, c_ss, t_s,
                         block_size, table_width, scale, window,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                         D: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr,
                         SEQ_PAD: tl.constexpr, PRECISION: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        # This program's sequence: the number of sequences whose tiles end at or before it.
        seq_idx = tl.arange(0, SEQ_PAD)
        ends = tl.load(tile_ends_ptr + seq_idx, mask=seq_idx < num_seqs, other=2**30)
        s = tl.sum((ends <= pid).to(tl.int32), axis=0)
        if s < num_seqs:
            first = tl.load(seqs_ptr + s * 3)
            rows = tl.load(seqs_ptr + s * 3 + 1).to(tl.int32)
            ctx = tl.load(seqs_ptr + s * 3 + 2).to(tl.int32)
            end = tl.load(tile_ends_ptr + s).to(tl.int32)
            r0 = (pid - (end - (rows + ROWS - 1) // ROWS)) * ROWS  # the tile's first row

            m = tl.arange(0, ROWS * GROUP_PAD)
            row = r0 + m // GROUP_PAD
            g = m % GROUP_PAD
            valid = (row < rows) & (g < GROUP)
            pos = ctx - rows + row  # each row's position in its sequence
            d = tl.arange(0, D_PAD)
            head = kvh * GROUP + g
            q = tl.load(q_ptr + (first + row)[:, None] * q_st + head[:, None] * q_sh
                        + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)
            if INTERPRETED:
                q = q.to(tl.float32)

            last = ctx - rows + tl.minimum(r0 + ROWS, rows) - 1  # the tile's last position
            lo = 0
            if window > 0:
                lo = tl.maximum(ctx - rows + r0 - window + 1, 0) // TILE_N * TILE_N
            m_i = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS * GROUP_PAD], tl.float32)
            acc = tl.zeros([ROWS * GROUP_PAD, D_PAD], tl.float32)
            n = tl.arange(0, TILE_N)
            for start in range(lo, last + 1, TILE_N):
                keys = start + n
                inside = keys <= last
                block = tl.load(tables_ptr + s * t_s + keys // block_size,
                                mask=inside & (keys // block_size < table_width), other=0)
                slot = block.to(tl.int64) * block_size + keys % block_size
                kv_mask = inside[:, None] & (d[None, :] < D)
                kv_at = cache_ptr + kvh.to(tl.int64) * c_sh + slot[:, None] * c_ss + d[None, :]
                k = tl.load(kv_at, mask=kv_mask, other=0.0)
                v = tl.load(kv_at + c_skv, mask=kv_mask, other=0.0)
                if INTERPRETED:
                    k, v = k.to(tl.float32), v.to(tl.float32)
                    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
                else:
                    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                see = valid[:, None] & (keys[None, :] <= pos[:, None])
                if window > 0:
                    see = see & (keys[None, :] > pos[:, None] - window)
                scores = tl.where(see, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                # A row that has seen no key yet keeps max -inf: exp(-inf - 0) = 0, no NaN.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(scores - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if INTERPRETED:
                    pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                else:
                    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (first + row)[:, None] * o_st + head[:, None] * o_sh
                     + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None] & (d[None, :] < D))

    return store_kv_kernel, attention_kernel, bool(knobs.runtime.interpret)


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or installed without a working backend
        return False
    return True


Launch = tuple[tuple[int, ...], tuple, dict]  # grid, arguments, constexprs


def store_kv_launch(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> Launch:
    t, hkv, d = k.shape
    return ((t,), (k, v, cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   cache.stride(0), cache.stride(1), cache.stride(2)),
            dict(HKV=hkv, D=d, HKV_PAD=_pow2(hkv), D_PAD=max(16, _pow2(d))))


def attention_launch(q: torch.Tensor, cache: torch.Tensor, seqs: torch.Tensor,
                     tables: torch.Tensor, block_size: int, scale: float, window: int,
                     out: torch.Tensor, interpreted: bool) -> Launch:
    t, h, d = q.shape
    hkv, num_seqs = cache.shape[1], seqs.shape[0]
    group = h // hkv
    tile_ends = torch.cumsum((seqs[:, 1] + ROWS - 1) // ROWS, 0)
    return ((t // ROWS + num_seqs, hkv),
            (q, cache, out, seqs, tables, tile_ends, num_seqs, q.stride(0), q.stride(1),
             out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
             tables.stride(0), block_size, tables.shape[1], scale, window),
            dict(GROUP=group, GROUP_PAD=_pow2(group), ROWS=ROWS, D=d, D_PAD=max(16, _pow2(d)),
                 TILE_N=TILE_N, SEQ_PAD=max(16, _pow2(num_seqs)),
                 PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                 # Under Triton's interpreter tl.dot is numpy's matmul, whose result for a
                 # row depends on the row's place in the tile (BLAS blocking), and which
                 # multiplies 16-bit floats wrongly (3.9): there products are summed one by
                 # one in float32.
                 INTERPRETED=interpreted))


def compile_for_gpu(kernel, launch: Launch, capability: int = 90) -> object:
    """Compile `kernel` ("store_kv" or "attention") for a CUDA GPU of `capability` (90: an
    H100/H200) with `launch`'s argument types and constexprs, without a GPU or a launch:
    Triton's front end, its passes and ptxas, as a first launch would run them. A check
    for machines without a GPU (the tests'); needs TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = dict(zip(("store_kv", "attention"), _jit()[:2], strict=True))[kernel]
    _, args, constexprs = launch
    names = [n for n in fn.arg_names if n not in constexprs]
    codes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.int64: "i64", torch.int32: "i32"}

    def kind(a: object) -> str:
        if isinstance(a, torch.Tensor):
            return "*" + codes[a.dtype]
        if isinstance(a, float):
            return "fp32"
        return "i32" if -2**31 <= int(a) < 2**31 else "i64"

    signature = {n: kind(a) for n, a in zip(names, args, strict=True)}
    signature |= {n: "constexpr" for n in constexprs}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", capability, 32))


class TritonPagedAttention:
    """The Triton kernels behind the C++ kernel module's attention calls (see the module
    docstring); activations in bf16, float16 or float32, the cache in the same dtype."""

    def store_kv(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """k/v [T, Hkv, D] into cache [2, Hkv, num_slots, D] at slots [T] (negative: skip)."""
        if k.shape[0] == 0:
            return
        grid, args, constexprs = store_kv_launch(cache, slots, k, v)
        _jit()[0][grid](*args, **constexprs)

    def paged_attention(self, q: torch.Tensor, cache: torch.Tensor, seqs: torch.Tensor,
                        tables: torch.Tensor, block_size: int, scale: float,
                        window: int = 0) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]; seqs [S, 3] (first row, rows, context length) and
        tables [S, nb] as csrc/attention.cpp takes them."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0 or seqs.shape[0] == 0:
            return out
        _, attention, interpreted = _jit()
        grid, args, constexprs = attention_launch(q, cache, seqs, tables, block_size, scale,
                                                  window, out, interpreted)
        attention[grid](*args, **constexprs)
        return out
