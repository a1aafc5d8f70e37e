"""A start in seconds: the start-up cache (kvserve.disk_cache) maps packed weights back bit
for bit and generating the same tokens, misses on any change of fingerprint, detects and
rebuilds damaged entries, writes nothing when it is off; the tokenizer's entry, the kernels'
build note, the CLI's first and second start, and the KV cache's lazily zeroed memory. Every
test has a cache directory of its own (tests/conftest.py keeps the suite's off)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from kvserve import kernels
from kvserve.distributed.parallel import SINGLE, TensorParallel
from kvserve.layers.linear import LinearBase
from kvserve.layers.quant import GGUFWeight
from kvserve.models.loader import DeferredReader
from kvserve.models.weight_cache import find_entry
from kvserve.sample.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer
from kvserve.worker.model_runner import load_target, zeros

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(root))
    monkeypatch.delenv("KVSERVE_NO_WEIGHT_CACHE", raising=False)
    return root


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, where: str) -> None:
    """Bit for bit: tensors by dtype, shape, strides and bytes; objects by type and their
    attributes, recursively; modules (the kernels) by identity."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        assert torch.equal(_bytes(a), _bytes(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, ModuleType) or callable(a) and not hasattr(a, "__dict__"):
        assert a is b, where
    elif hasattr(a, "__dict__") and not isinstance(a, nn.Module | type):
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), f"{where}.")
    else:
        assert a == b, where


def assert_same_model(fresh: nn.Module, cached: nn.Module) -> None:
    """Every submodule's parameters, buffers and public attributes (packed forms, GGUF types,
    ...) equal, and parameters shared (a tied LM head) exactly where they were."""
    fresh_mods, cached_mods = dict(fresh.named_modules()), dict(cached.named_modules())
    assert fresh_mods.keys() == cached_mods.keys()
    for name, m in fresh_mods.items():
        c = cached_mods[name]
        assert type(m) is type(c), name
        assert_same(dict(m._parameters), dict(c._parameters), f"{name} parameters")
        assert_same(dict(m._buffers), dict(c._buffers), f"{name} buffers")
        public = {k: v for k, v in vars(m).items() if not k.startswith("_")}
        assert_same(public, {k: v for k, v in vars(c).items() if not k.startswith("_")}, name)
    assert fresh._fused is None and cached._fused is None

    def ties(model):
        first: dict[int, str] = {}
        return {n: first.setdefault(id(p), n)
                for n, p in model.named_parameters(remove_duplicate=False)}

    assert ties(fresh) == ties(cached)


def _load(path, dtype=torch.bfloat16, quantization="auto", tp=SINGLE):
    return load_target(str(path), dtype, CPU, "auto", quantization, tp)


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.real_model
def test_gguf_read_in_place_is_the_files_pages_and_not_cached(real_model_path, cache_dir,
                                                              caplog):
    """`--quantization gguf` on the default model reads every matrix in the GGUF's own
    blocks: each one a view of the file's mapping (no weight in anonymous memory), and
    nothing is cached."""
    caplog.set_level(logging.INFO, logger="kvserve")
    loaded, applied = _load(real_model_path, quantization="gguf")
    model = loaded.model
    assert applied == "gguf" and model.reads_gguf_in_place()
    assert "nothing to cache" in _messages(caplog)
    assert not list((cache_dir / "weights").glob("*"))
    target = str(real_model_path.resolve())
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.packed, GGUFWeight) for m in linears)
    views = [t for m in linears for t in m.packed.data] + [model.embed_tokens.gguf.data]
    assert all(_mapped_from(t) == target for t in views)
    # what else the model holds (norms) is small beside the file
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held < real_model_path.stat().st_size / 100


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_hit_restores_the_fresh_model_bit_for_bit(real_model_path, cache_dir, caplog,
                                                 quantization):
    caplog.set_level(logging.INFO, logger="kvserve")
    fresh, applied = _load(real_model_path, quantization=quantization)
    entry = find_entry(real_model_path, torch.bfloat16, CPU, quantization)
    assert entry is not None and entry.data.is_file() and entry.manifest.is_file()
    assert "mapped from the weight cache" not in _messages(caplog)
    cached, applied_again = _load(real_model_path, quantization=quantization)
    assert "mapped from the weight cache" in _messages(caplog)
    assert isinstance(cached.gguf_reader, DeferredReader)
    assert applied_again == applied
    assert (cached.config, cached.checkpoint_config, cached.weight_format) == \
        (fresh.config, fresh.checkpoint_config, fresh.weight_format)
    assert_same_model(fresh.model, cached.model)
    # the parameters are views of the mapped file, not copies
    assert _mapped_from(cached.model.embed_tokens.weight) == str(entry.data)


def _mapped_from(t: torch.Tensor) -> str | None:
    """The file whose mapping holds `t`'s memory (/proc/self/maps), if any."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= ptr < hi:
            return rest[-1] if len(rest) == 5 else None
    return None


def test_dense_and_tied_models_restore_bit_for_bit(tiny_llama_dir, tiny_qwen2_dir, cache_dir):
    for path in (tiny_llama_dir, tiny_qwen2_dir):  # dense kernel; a tied LM head with bias
        for dtype, quantization in ((torch.float32, "none"), (torch.float32, "int4")):
            fresh, _ = _load(path, dtype, quantization)
            cached, _ = _load(path, dtype, quantization)
            assert cached.gguf_reader is None
            assert_same_model(fresh.model, cached.model)
    assert len(list((cache_dir / "weights").glob("*.bin"))) == 4


def _greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.real_model
def test_hit_generates_the_same_tokens(real_model_path, cache_dir, monkeypatch):
    from kvserve.engine.llm import LLM

    def llm():
        return LLM(str(real_model_path), kv_cache_memory="64MiB")

    monkeypatch.setenv("KVSERVE_NO_WEIGHT_CACHE", "1")
    uncached = _greedy(llm())
    monkeypatch.delenv("KVSERVE_NO_WEIGHT_CACHE")
    first = _greedy(llm())  # builds and writes the entries
    assert list((cache_dir / "weights").glob("*.bin"))
    assert list((cache_dir / "tokenizers").glob("*.json"))
    again = llm()
    assert isinstance(again.engine.tokenizer, Tokenizer)
    assert _greedy(again) == first == uncached


def test_a_changed_fingerprint_misses(tiny_llama_dir, tmp_path, cache_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvserve")
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    _load(model, torch.float32, "none")
    entry = find_entry(model, torch.float32, CPU, "none")
    assert entry is not None and entry.manifest.is_file()
    others = [find_entry(model, torch.bfloat16, CPU, "none"),
              find_entry(model, torch.float32, CPU, "int8"),
              find_entry(model, torch.float32, CPU, "none", TensorParallel(0, 2)),
              find_entry(model, torch.float32, CPU, "none", TensorParallel(1, 2))]
    assert all(e is not None for e in others)
    assert len({entry.data, *(e.data for e in others)}) == 5  # type: ignore[union-attr]
    assert find_entry(model, torch.float32, torch.device("meta"), "none") is None

    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    touched = find_entry(model, torch.float32, CPU, "none")
    assert touched is not None and touched.data != entry.data
    caplog.clear()
    _load(model, torch.float32, "none")
    assert "preparing" in _messages(caplog)
    assert touched.manifest.is_file()
    assert not entry.manifest.exists() and not entry.data.exists()  # the slot's older entry


def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "manifest", "fingerprint"])
def test_a_damaged_entry_is_detected_and_rebuilt(tiny_llama_dir, cache_dir, caplog, damage):
    caplog.set_level(logging.INFO, logger="kvserve")
    fresh, _ = _load(tiny_llama_dir, torch.float32, "int4")
    entry = find_entry(tiny_llama_dir, torch.float32, CPU, "int4")
    assert entry is not None
    if damage == "flipped byte":
        _corrupt_middle(entry.data)
    elif damage == "truncated":
        entry.data.write_bytes(entry.data.read_bytes()[:-100])
    elif damage == "manifest":
        entry.manifest.write_text(entry.manifest.read_text()[:50])
    else:  # an entry made from something else, under this name
        manifest = json.loads(entry.manifest.read_text())
        manifest["header"]["dtype"] = "torch.bfloat16"
        entry.manifest.write_text(json.dumps(manifest))
    caplog.clear()
    rebuilt, _ = _load(tiny_llama_dir, torch.float32, "int4")
    assert "is unusable" in _messages(caplog) and "rebuilding" in _messages(caplog)
    assert "mapped from the weight cache" not in _messages(caplog)
    assert_same_model(fresh.model, rebuilt.model)
    caplog.clear()
    again, _ = _load(tiny_llama_dir, torch.float32, "int4")  # rewritten whole
    assert "mapped from the weight cache" in _messages(caplog)
    assert_same_model(fresh.model, again.model)


def test_off_writes_nothing(tiny_llama_dir, real_model_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_NO_WEIGHT_CACHE", "1")
    _load(tiny_llama_dir, torch.float32, "none")
    Tokenizer.from_gguf(real_model_path)
    assert find_entry(tiny_llama_dir, torch.float32, CPU, "none") is None
    assert kernels._marker_path("x") is None
    assert not cache_dir.exists()


@pytest.mark.slow
@pytest.mark.real_model
def test_tokenizer_entry_is_the_built_tokenizer(real_model_path, cache_dir, caplog):
    built = Tokenizer.from_gguf(real_model_path)
    (entry,) = (cache_dir / "tokenizers").glob("*.json")
    cached = Tokenizer.from_gguf(real_model_path, reader=DeferredReader(Path("/nonexistent")))
    assert cached.backend.to_str() == built.backend.to_str()
    for attr in ("decode_kind", "bos_token_id", "eos_token_id", "eos_token_ids",
                 "pad_token_id", "add_bos_token", "add_eos_token", "chat_template",
                 "vocab_size", "_special_ids"):
        assert getattr(cached, attr) == getattr(built, attr), attr
    text = "Hello <|im_start|>user 1234 héllo\n\tworld<|im_end|> 🙂"
    assert cached.encode(text) == built.encode(text)
    ids = built.encode(text)
    assert cached.decode(ids, skip_special_tokens=False) == \
        built.decode(ids, skip_special_tokens=False)

    _corrupt_middle(entry)
    caplog.set_level(logging.WARNING, logger="kvserve")
    rebuilt = Tokenizer.from_gguf(real_model_path)
    assert "is unusable" in _messages(caplog)
    assert rebuilt.backend.to_str() == built.backend.to_str()


def test_kernel_build_note(tmp_path):
    module = kernels.ops()
    if module is None:
        pytest.skip("no C++ kernels here")
    marker = tmp_path / "kernels" / "note.json"
    key = kernels.build_id(kernels.variant())
    kernels._note(marker, key, module)
    loaded = kernels._load_noted(marker, key)
    assert loaded is not None and loaded.__name__ == module.__name__
    assert loaded.isa() == module.isa()
    assert kernels._load_noted(marker, "another build") is None
    note = json.loads(marker.read_text())
    note["stat"][1] += 1  # the library was rebuilt since
    marker.write_text(json.dumps(note))
    assert kernels._load_noted(marker, key) is None


@pytest.mark.slow
@pytest.mark.real_model
def test_cli_says_what_it_prepares_then_starts_from_the_cache(cache_dir):
    """The first start says on stderr what it prepares; the next maps it; same output."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_NO_WEIGHT_CACHE"}

    def run():
        r = subprocess.run([sys.executable, "-m", "kvserve", "generate", "Hello",
                            "--max-tokens", "8", "--temperature", "0", "--ignore-eos"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        return r

    first, second = run(), run()
    assert "preparing SmolLM2-135M-Instruct.Q4_1.gguf" in first.stderr
    assert "mapped from the weight cache" not in first.stderr
    assert "mapped from the weight cache" in second.stderr
    assert "preparing" not in second.stderr and "compiling" not in second.stderr
    assert second.stdout == first.stdout and len(first.stdout) > len("Hello")


def test_kv_cache_memory_reads_zero_until_written():
    """The KV cache's anonymous memory is zeros, whatever the process freed before."""
    garbage = torch.full((1 << 20,), 7.0)
    del garbage
    a, b = (zeros((4, 1024, 3, 64), torch.bfloat16, CPU) for _ in range(2))
    assert a.dtype == torch.bfloat16 and a.shape == (4, 1024, 3, 64) and a.is_contiguous()
    assert not a.any() and not b.any()
    a[1, 2] = 1.5
    assert a.sum().item() == 1.5 * 3 * 64 and not b.any()  # separate memory
    assert zeros((0, 5), torch.int8, CPU).shape == (0, 5)


def test_every_source_a_cache_digests_exists():
    """The start-up caches key their entries on kvserve's own files (so an edit retires what
    they made): a file moved or renamed must be named again there, not silently skipped."""
    from kvserve.engine import calibration_cache
    from kvserve.models import weight_cache

    for code in (calibration_cache._CODE, weight_cache._CODE):
        assert code and not [p for p in code if not p.is_file()]
