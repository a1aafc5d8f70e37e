"""KV cache memory planning from a model's config alone (no weights loaded).

One source of truth for "how many bytes does a token of K/V take, and how many blocks fit":
the engine sizes its cache with `plan_num_blocks`, logs `kv_token_bytes`, and `kvserve plan`
prints `plan_kv` for each KV dtype. Row sizes come from the attention layout (`kv_quant`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.kv_quant import kv_row_width, kv_storage_dtype
from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv_cache.layout import KVLayout


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVTokenBytes:
    """K/V bytes of one token across the model: layers x 2 (K, V) x KV heads x row, where a
    row is head_dim values plus, when quantized, its scale."""

    kv_cache_dtype: str  # "auto" or "int8"
    storage_dtype: torch.dtype  # dtype of the cache tensor
    num_layers: int
    num_kv_heads: int
    head_dim: int
    value_bytes: int  # bytes per stored value
    scale_bytes: int  # bytes per row holding its scale (0 when unquantized)

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.value_bytes + self.scale_bytes

    @property
    def total(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    def breakdown(self) -> str:
        """e.g. '30 layers x 2 (K,V) x 3 KV heads x (64 x 1 B + 2 B scale) = 11880 B'."""
        row = f"{self.head_dim} x {self.value_bytes} B"
        if self.scale_bytes:
            row = f"({row} + {self.scale_bytes} B scale)"
        return (f"{self.num_layers} layers x 2 (K,V) x {self.num_kv_heads} KV heads x {row}"
                f" = {self.total} B")


def kv_token_bytes(cfg: ModelConfig, kv_cache_dtype: str,
                   compute_dtype: torch.dtype) -> KVTokenBytes:
    storage = kv_storage_dtype(kv_cache_dtype, compute_dtype)
    size = _itemsize(storage)
    width = kv_row_width(cfg.head_dim, kv_cache_dtype)
    return KVTokenBytes(kv_cache_dtype, storage, cfg.num_layers, cfg.num_kv_heads,
                        cfg.head_dim, size, (width - cfg.head_dim) * size)


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str,
                       compute_dtype: torch.dtype) -> int:
    """Bytes of KV cache one token slot takes, summed over layers."""
    return kv_token_bytes(cfg, kv_cache_dtype, compute_dtype).total


def num_blocks_in(budget: int, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks of `block_size` tokens that fit in `budget` bytes."""
    return budget // (block_size * bytes_per_token)


def slot_bytes(cfg: ModelConfig, kv_cache_dtype: str, compute_dtype: torch.dtype,
               layout: KVLayout | None = None) -> int:
    """Bytes of one token slot of a block: every layer's K/V with one KV group, one group's
    layers' with several (see kv_cache.layout)."""
    per_tok = kv_bytes_per_token(cfg, kv_cache_dtype, compute_dtype)
    return per_tok if layout is None else per_tok // cfg.num_layers * layout.group_size


def plan_num_blocks(cfg: ModelConfig, cache: CacheConfig, compute_dtype: torch.dtype,
                    extra_bytes_per_token: int = 0, layout: KVLayout | None = None) -> int:
    """Blocks the engine allocates: those that fit in the KV memory budget, or the explicit
    override. A block holds `block_size` token slots of `layout`'s group size in layers.
    `extra_bytes_per_token` is state kept per token slot beside the target's K/V (a draft
    model's cache), paid from the same budget. Raises ValueError when the budget holds no
    block."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_tok = slot_bytes(cfg, cache.kv_cache_dtype, compute_dtype, layout) + \
        extra_bytes_per_token
    num = num_blocks_in(cache.kv_cache_memory, cache.block_size, per_tok)
    if num < 1:
        raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} bytes holds no block "
                         f"({cache.block_size * per_tok} bytes per block of "
                         f"{cache.block_size} tokens)")
    return num


# GPU memory kept out of the KV budget for activations, the sampler's logits and the CUDA
# graphs' pool: a 512-token step of an 8B model needs well under 0.2 GiB of them.
GPU_ACTIVATION_RESERVE = 1 << 30


def gpu_kv_budget(total: int, free: int, utilization: float,
                  reserve: int = GPU_ACTIVATION_RESERVE) -> int:
    """The KV cache's bytes on a GPU of `total` bytes with `free` left after loading, as
    vLLM's --gpu-memory-utilization reads: this process may use `utilization` of the device
    in all; what is in use now (the weights, other processes) and `reserve` come out of it.
    Raises ValueError when nothing is left."""
    used = total - free
    budget = int(utilization * total) - used - reserve
    if budget <= 0:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise ValueError(f"--gpu-memory-utilization {utilization} allows {gib(utilization * total)}"
                         f" of the GPU's {gib(total)}, but {gib(used)} are in use after loading "
                         f"(weights, other processes) and {gib(reserve)} are kept for "
                         f"activations: no room for a KV cache (raise it, or give "
                         f"--kv-cache-memory)")
    return budget


def capacity_gain(cfg: ModelConfig, kv_cache_dtype: str, compute_dtype: torch.dtype) -> float:
    """Tokens per byte of `kv_cache_dtype` relative to an unquantized cache."""
    return (kv_bytes_per_token(cfg, "auto", compute_dtype)
            / kv_bytes_per_token(cfg, kv_cache_dtype, compute_dtype))


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the Llama-family model `cfg` describes (a tied lm head counted once;
    every expert of a mixture of experts, with its router and shared expert)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if cfg.qkv_bias else 0)
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    norms = 2 * h * (2 if cfg.sandwich_norms else 1)  # input, post-attention (+ outputs')
    dense = 3 * h * cfg.intermediate_size  # gate, up, down
    shared = cfg.shared_expert_intermediate_size
    sparse = (cfg.num_experts * (3 * h * cfg.moe_intermediate_size + h)  # experts, router
              + (3 * h * shared + h if shared else 0))  # the shared expert and its gate
    layers = sum(attn + norms + (sparse if cfg.sparse(i) else dense)
                 for i in range(cfg.num_layers))
    embed = cfg.vocab_size * h
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return embed + layers + h + lm_head


def weight_bytes(cfg: ModelConfig, compute_dtype: torch.dtype) -> int:
    """Memory of the weights once dequantized into the compute dtype."""
    return param_count(cfg) * _itemsize(compute_dtype)


@dataclass(frozen=True)
class KVPlan:
    """What a KV budget holds for one KV dtype."""

    token_bytes: KVTokenBytes
    budget: int
    block_size: int
    num_blocks: int
    seq_len: int  # prompt + output tokens of one sequence
    slot_bytes: int  # one token slot of a block (slot_bytes())
    layout: KVLayout | None = None  # KV groups; None: one block table for every layer
    chunk: int = 512  # tokens per step (--max-num-batched-tokens), for sliding windows

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.slot_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes actually allocated (whole blocks; at most the budget)."""
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        """Tokens the allocation holds in every layer."""
        return self.kv_bytes // self.token_bytes.total

    @property
    def blocks_per_seq(self) -> int:
        # as the scheduler counts: whole blocks for prompt + max_tokens (sliding-window
        # groups: their window and a step's tokens)
        if self.layout is None:
            return cdiv(self.seq_len, self.block_size)
        return self.layout.blocks_for(self.seq_len, self.block_size, self.chunk)

    @property
    def max_seqs(self) -> int:
        """Sequences of `seq_len` tokens whose K/V fit at once (no prefix sharing)."""
        return self.num_blocks // self.blocks_per_seq


def plan_kv(cfg: ModelConfig, budget: int, block_size: int, kv_cache_dtype: str,
            compute_dtype: torch.dtype, seq_len: int, layout: KVLayout | None = None,
            chunk: int = 512) -> KVPlan:
    tb = kv_token_bytes(cfg, kv_cache_dtype, compute_dtype)
    cache = CacheConfig(block_size, budget, kv_cache_dtype=kv_cache_dtype)  # validates
    per_tok = slot_bytes(cfg, kv_cache_dtype, compute_dtype, layout)
    num = num_blocks_in(cache.kv_cache_memory, cache.block_size, per_tok)
    return KVPlan(tb, budget, block_size, num, seq_len, per_tok, layout, chunk)
