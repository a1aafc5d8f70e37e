"""Frozen configuration dataclasses, validated once with clear messages."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, fields, replace

import torch


def json_fields(value: str | dict | None, flag: str, cls: type) -> dict | None:
    """A JSON-object flag's fields (from its string or a dict), checked against the
    dataclass `cls`'s fields; None for None or an empty value. Unknown fields are an error,
    not silently ignored."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--{flag} must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {flag} field(s): {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return value


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long contexts.

    kind: "none", "linear" (positions divided by factor), "llama3" (per-frequency smoothing
    as Llama 3.1 defines it), "longrope" (Phi-3: per-frequency divisors, `short_factors`
    for contexts up to original_max_position and `long_factors` beyond, and cos/sin scaled
    by `attn_factor`) or "yarn" (gpt-oss: each frequency blended between itself and itself
    divided by `factor` along a ramp over the dimensions between `beta_fast` and
    `beta_slow` rotations in original_max_position, the ramp's ends rounded outward where
    `truncate`; cos/sin scaled by `attn_factor`, 1 + 0.1 ln(factor) unless stated). A
    GGUF may instead ship explicit per-frequency divisors (`rope_freqs.weight`); those, and
    LongRoPE's once chosen, land in `freq_factors`.
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None
    attn_factor: float = 1.0
    short_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def for_context(self, max_len: int) -> RopeScaling:
        """LongRoPE's factors chosen for a configured context of `max_len` tokens: the long
        ones when it exceeds original_max_position (llama.cpp's rule; transformers switches
        per step with the sequence's length, which would make a request's numbers depend on
        how long it has grown). Other kinds are returned as they are."""
        if self.kind != "longrope":
            return self
        long = max_len > self.original_max_position
        return dataclasses.replace(
            self, freq_factors=self.long_factors if long else self.short_factors)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or config.json."""

    # "llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen2moe", "qwen3moe" or "gpt-oss"
    # (mistral and mixtral load as llama)
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    # Per layer, its attention's sliding window (0: the whole context); () for none at all.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of the sliding-window layers, where it differs
    attention_scale: float = 0.0  # softmax scale of q.k; 0: head_dim ** -0.5
    # Gemma 3: embeddings times sqrt(hidden); RMSNorm scaled by its weight in float32 before
    # rounding (the weight holds 1 + w, kept in float32); norms on the attention's and the
    # MLP's outputs too; GELU (tanh) gating the MLP.
    embedding_scale: float = 1.0
    norm_scale_in_float32: bool = False
    sandwich_norms: bool = False
    # "silu", "gelu_tanh", or "swiglu_oai" (gpt-oss: the gate clamped above at
    # `swiglu_limit`, the up projection to +-swiglu_limit, and (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate)). The defaults are gpt-oss's: its config.json states them,
    # llama.cpp's GGUF conversion does not write them (its graph uses these constants).
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: a bias on the attention's output projection, and one learned logit per query
    # head that joins the softmax's denominator (an "attention sink" no value comes from).
    o_bias: bool = False
    attention_sinks: bool = False
    name: str = ""
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; 0 experts: a dense model). A sparse
    # layer's MLP is `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok`
    # of them run per token and weighted by the router's softmax, renormalized over the
    # chosen ones with `norm_topk_prob`; plus, where `shared_expert_intermediate_size` is
    # set (Qwen2-MoE), a shared expert every token runs, gated by a sigmoid. `dense_layers`:
    # the layers of an MoE model whose MLP is dense (`intermediate_size`), as Qwen's
    # mlp_only_layers and decoder_sparse_step resolve (or a GGUF's tensors say).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # How the router's logits weight the chosen experts: "softmax" (over all experts, then
    # the k largest, renormalized where norm_topk_prob says) or "topk_softmax" (gpt-oss: the
    # k largest logits, then a softmax over those k). `moe_bias`: the router and every
    # expert's projections carry biases (gpt-oss).
    moe_gating: str = "softmax"
    moe_bias: bool = False

    def window(self, layer: int) -> int:
        """The sliding window of `layer`'s attention (0: none)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_windows)} layer windows for "
                             f"{self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(f"model config: unsupported activation {self.hidden_act!r} "
                             "(supported: silu, gelu_tanh, swiglu_oai)")
        if self.moe_gating not in ("softmax", "topk_softmax"):
            raise ValueError(f"model config: unsupported expert gating {self.moe_gating!r} "
                             "(supported: softmax, topk_softmax)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"model config: {self.num_experts_per_tok} experts per token "
                                 f"of {self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ValueError("model config: moe_intermediate_size must be > 0, got "
                                 f"{self.moe_intermediate_size}")
            if any(not 0 <= i < self.num_layers for i in self.dense_layers):
                raise ValueError(f"model config: dense layers {self.dense_layers} outside "
                                 f"0..{self.num_layers - 1}")
        elif self.num_experts_per_tok or self.shared_expert_intermediate_size or \
                self.dense_layers:
            raise ValueError("model config: expert settings without experts")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def check_kv_cache_dtype(name: str) -> str:
    """Validate a --kv-cache-dtype value: 'auto' (the compute dtype once the engine has
    resolved it, see resolve_kv_cache_dtype), a float dtype K/V are stored in, or 'int8'."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {name!r}")
    return name


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget that sets the block count."""

    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes
    num_blocks: int | None = None  # overrides the budget (tests, planning)
    kv_cache_dtype: str = "auto"  # resolved: "auto" = the compute dtype, a float dtype, "int8"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two > 0, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    # Short prompt work (at most a quarter of the budget: a question after a cached prefix,
    # a prompt's last chunk) gets steps of its own before decodes and long chunks.
    short_prompt_steps: bool = True
    # Latency targets (seconds; None: not targeted). With an ITL target, each step's prompt
    # work and the admission of new requests are sized by the step cost model (kvserve.sched.slo)
    # so that running decodes' steps stay within it; the TTFT target defines goodput and,
    # with `shed_late_requests`, refuses requests predicted to miss it (the server's 429).
    target_ttft_s: float | None = None
    target_itl_s: float | None = None
    shed_late_requests: bool = False
    # Whether the ITL target also governs admission and recovery (a --target-itl-ms given).
    # The default step budget only sizes the prompt work beside decodes: a default must not
    # cap how many requests decode at once, which is throughput the user did not trade.
    itl_admission: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("target_ttft_s", "target_itl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.shed_late_requests and self.target_ttft_s is None:
            raise ValueError("shedding late requests needs a TTFT target (--target-ttft-ms)")


def resolve_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """--max-model-len against the model's context length: the latter when not given."""
    max_len = requested or model.max_position
    if max_len > model.max_position:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's context length "
                         f"{model.max_position}")
    return max_len


SPEC_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, as `--speculative-config` takes it (JSON, vLLM's field names).

    Per step, every decoding request may carry up to `num_speculative_tokens` drafts, which
    the target verifies in the same forward as the rest of the batch. The adaptive policy:
    - no drafts while more than `max_batch_size` requests run: a large batch is already
      compute-bound, so verifying drafts that get rejected costs real time;
    - at most `max_draft_tokens` drafts per step in all, handed out to the requests with
      the best recent acceptance first, so a step stays small enough to be memory-bound;
    - a request whose recent acceptance (a moving average over about `acceptance_window`
      drafts) is below `min_acceptance` drafts nothing, except one probe token every
      `probe_interval` steps, so it can recover when the text turns predictable (with
      `adaptive_depth`, every `probe_interval` steps times the batch's requests, and only
      where a sure token would pay: see spec_decode.coordinator).
    """

    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match
    model: str | None = None  # draft_model: model name/path; mtp: safetensors file
    quantization: str = "auto"  # draft_model: its weights (auto: int4 on CPU, else none)
    # draft_model: draft from the first this many token ids only (0: the whole vocabulary).
    draft_vocab_size: int = 0
    # Each request drafts as far as the measured costs say pays (spec_decode.coordinator),
    # up to num_speculative_tokens; false: always num_speculative_tokens.
    adaptive_depth: bool = True
    # No drafts while more requests than this run (None: 8, or 1 for draft_model: on the real
    # Qwen2.5-Coder pair a 0.5B drafting for the 1.5B ran 0.88-0.93x of no speculation at 2,
    # 4 and 8 requests, where verify rows stop being nearly free).
    max_batch_size: int | None = None
    max_draft_tokens: int = 12
    min_acceptance: float = 0.3
    acceptance_window: int = 32
    probe_interval: int = 8
    # adaptive_depth: a step drafts only where its expected tokens a second beat the step
    # without drafts by this fraction, for what the fitted costs miss (a verify row's cost
    # is not linear in the rows; drafting has overheads of its own). With the trained MTP
    # drafter for the 1.5B at 8 requests: 0.97x of no speculation at 0, 0.99x at 0.05,
    # 1.00x at 0.1 (benchmarks/spec_concurrency.py, docs/results-history.md).
    min_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}; "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError("quantization must be one of auto, none, int8, int4; got "
                             f"{self.quantization!r}")
        if self.method == "mtp" and not self.model:
            raise ValueError('method "mtp" needs "model": the MTP safetensors file '
                             "(written by `kvserve train-mtp`)")
        if self.max_batch_size is None:
            object.__setattr__(self, "max_batch_size", 1 if self.method == "draft_model" else 8)
        for name in ("max_batch_size", "max_draft_tokens", "acceptance_window",
                     "probe_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 <= self.min_gain <= 1.0:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain}")
        if not isinstance(self.adaptive_depth, bool):
            raise ValueError(f"adaptive_depth must be true or false, got {self.adaptive_depth!r}")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            raise ValueError("draft_vocab_size must be an integer >= 0, got "
                             f"{self.draft_vocab_size!r}")
        if self.draft_vocab_size and self.method != "draft_model":
            raise ValueError('draft_vocab_size is for method "draft_model"')

    @classmethod
    def parse(cls, value: str | dict | None) -> SpecConfig | None:
        """From a JSON string or dict; None or an empty value means no speculation. Unknown
        fields are an error, not silently ignored."""
        value = json_fields(value, "speculative-config", cls)
        if value is None:
            return None
        if "method" not in value:
            raise ValueError('--speculative-config needs "method" (ngram, draft_model, mtp)')
        try:
            return cls(**value)
        except TypeError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None


KV_EVENT_PUBLISHERS = ("zmq", "null")
_TCP_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def check_zmq_endpoint(name: str, endpoint: object) -> str:
    """A ZeroMQ endpoint kvserve can bind or connect: tcp://HOST:PORT (HOST `*` for every
    interface), ipc://PATH or inproc://NAME."""
    if not isinstance(endpoint, str):
        raise ValueError(f"{name} must be a string, got {endpoint!r}")
    m = _TCP_ENDPOINT.fullmatch(endpoint)
    if m is not None:
        if not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{name} {endpoint!r}: port must be in 1..65535")
        return endpoint
    for scheme in ("ipc://", "inproc://"):
        if endpoint.startswith(scheme) and len(endpoint) > len(scheme):
            return endpoint
    raise ValueError(f"{name} {endpoint!r} is not tcp://HOST:PORT, ipc://PATH or "
                     "inproc://NAME")


def _offset_endpoint(endpoint: str, rank: int) -> str:
    m = _TCP_ENDPOINT.fullmatch(endpoint)
    if m is not None:
        port = int(m.group(2)) + rank
        if port >= 65536:
            raise ValueError(f"kv-events endpoint {endpoint!r} for rank {rank}: port {port} "
                             "is past 65535")
        return endpoint[:m.start(2)] + str(port) + endpoint[m.end(2):]
    return f"{endpoint}_dp{rank}"  # ipc:// and inproc://


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events, as `--kv-events-config` takes them (JSON, vLLM's KVEventsConfig
    fields): batches of BlockStored / BlockRemoved / AllBlocksCleared (kv_cache.events),
    published after each engine step (engine.kv_events).

    publisher: "zmq" (a PUB socket on `endpoint`, each message [topic, 8-byte big-endian
    sequence number, payload]) or "null" (collected, not sent); unset: "zmq" when enabled.
    An endpoint with `*`, `::`, ipc:// or inproc:// is bound, any other connected (to a
    collector that binds). replay_endpoint: a ROUTER socket that sends the last
    `buffer_steps` batches again from a sequence number a client asks for. hwm: ZeroMQ's
    high-water mark of the PUB socket (0: none). max_queue_size: batches waiting for the
    publisher thread; past it a batch is dropped, never waited for."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv-events publisher must be one of "
                             f"{', '.join(KV_EVENT_PUBLISHERS)}; got {self.publisher!r}")
        check_zmq_endpoint("kv-events endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_zmq_endpoint("kv-events replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ValueError("kv-events replay_endpoint must differ from endpoint")
        for name, least in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv-events {name} must be an integer >= {least}, "
                                 f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv-events topic must be a string, got {self.topic!r}")

    @property
    def enabled(self) -> bool:
        """Whether the engine collects events at all (vLLM's rule: only when enabled)."""
        return self.enable_kv_cache_events

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The endpoints of data-parallel rank `rank`, so that one config serves every replica
        (vLLM's rule): a tcp endpoint's port plus the rank, an ipc or inproc name with
        `_dp{rank}` appended; rank 0's are the ones given."""
        if rank == 0:
            return self
        return replace(self, endpoint=_offset_endpoint(self.endpoint, rank),
                       replay_endpoint=None if self.replay_endpoint is None
                       else _offset_endpoint(self.replay_endpoint, rank))

    def check_ranks(self, ranks: int) -> None:
        """ValueError where ranks 0..ranks-1 would share an endpoint (a replay endpoint a few
        ports above the events' would be another rank's events endpoint)."""
        seen: dict[str, int] = {}
        for rank in range(ranks):
            cfg = self.for_rank(rank)
            for endpoint in (cfg.endpoint, cfg.replay_endpoint):
                if endpoint is None:
                    continue
                if endpoint in seen:
                    raise ValueError(
                        f"kv-events: with {ranks} replicas, rank {rank} and rank "
                        f"{seen[endpoint]} would both use {endpoint} (each rank adds its "
                        "number to the ports): put replay_endpoint at least that many ports "
                        "away from endpoint")
                seen[endpoint] = rank

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """From a JSON string or dict (or a KVEventsConfig, as it is); None or an empty value
        means no events. Unknown fields are an error, not silently ignored."""
        if isinstance(value, KVEventsConfig):
            return value
        value = json_fields(value, "kv-events-config", cls)
        return None if value is None else cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0


def supports_fast_bf16() -> bool:
    """True when this CPU has native bf16 matmul (AVX-512 BF16 / AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str | torch.dtype) -> str:
    """--kv-cache-dtype as the engine passes it on (to every rank): `auto` is float32 when
    float32 was asked for by name (which asks for exactness, as it does of the weights: see
    resolve_quantization), else left for the model's attention layers to resolve against the
    kernels (kernels.kv_cache_dtype_for: float16 on AVX2 CPUs under float32 activations)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto" and (dtype is torch.float32 or
                                     isinstance(dtype, str) and dtype in ("float32", "fp32")):
        return "float32"
    return kv_cache_dtype


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map --dtype to a torch dtype. 'auto' picks bf16 on GPUs and on CPUs with native bf16
    (its batched matmuls several times faster than float32's there), float32 otherwise."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name == "auto":
        if device.type == "cuda" or supports_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in table:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {name!r}")
    return table[name]
