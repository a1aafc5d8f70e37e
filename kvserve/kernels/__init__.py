"""C++ kernels for the CPU, built when kvserve is installed (or else compiled on first use with
the system compiler), Triton kernels for paged attention on a GPU (triton_paged), and the one
place that decides whether a kernel or torch's fallback serves an operation.

The install (setup.py) builds `csrc/*.cpp` once per x86 level (build_spec.variants(): AVX2,
AVX-512 with VNNI and BF16, and that with AMX) into `kvserve.kernels._cpu_ops_<variant>`, each
with a record of the variant, the sources' fingerprint and torch's version
(build_spec.build_info). `ops()` imports the best variant this CPU runs
(build_spec.host_variant; $KVSERVE_CPU_VARIANT names another), when its record is this
checkout's and torch's, and logs which. Otherwise (csrc edited since the install, another
torch, an install without it) it says why and `torch.utils.cpp_extension` compiles that
variant from `csrc/*.cpp` with ninja (a pinned dependency) into the torch extensions cache
(~/.cache/torch_extensions) the first time it is needed (about a minute on 2 cores; the
model runner asks at start-up, not in the first request) and loads the cached build
afterwards. Where no compiler is available, the build fails, or KVSERVE_NO_CPP=1, `ops()`
returns None and callers keep their torch implementation.

The run-time load imports torch's extension builder (setuptools) and runs ninja over the build:
~0.2 s of every start. Once a build has loaded, the start-up cache (kvserve.disk_cache) notes
which library file it was for a digest of everything the build depends on (sources, flags,
torch, Python, the variant, TORCH_EXTENSIONS_DIR); later starts with the same digest import
that file directly, provided it still has the size and mtime noted.

The run-time build is named for the variant and for this checkout's csrc directory (`_name`): two
checkouts (git worktrees) on one machine then keep builds of their own instead of rebuilding
one library from alternating sources (a minute each time on 2 cores).

The kernels are batch-invariant (see csrc/common.h): a row's result does not depend on the
other rows of the call. torch's CPU matmuls and attention are not (their blocking, and so
their summation order, follows the shapes), which is why every choice below is made per
layer and configuration, never per step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvserve.disk_cache import atomic_write, cache_root, digest
from kvserve.kernels import build_spec, triton_paged
from kvserve.kernels.build_spec import CSRC, LDFLAGS, Variant
from kvserve.kernels.triton_paged import TritonPagedAttention

log = logging.getLogger(__name__)

# A load slower than this is a build: say so, so a first start does not look hung.
BUILD_NOTICE_S = 2.0


def variant() -> Variant | None:
    """The kernel build this CPU runs (build_spec.host_variant); None where none runs."""
    return build_spec.host_variant()


def _name(v: Variant) -> str:
    """The run-time build's name: per variant (and CPU, for `native`) and per checkout."""
    where = hashlib.blake2b(str(CSRC).encode(), digest_size=3).hexdigest()
    cpu = f"_{build_spec.cpu_tag()}" if v.native else ""
    return f"kvserve_cpu_ops_{v.name}{cpu}_{where}"


@cache
def ops() -> ModuleType | None:
    if _flag("KVSERVE_NO_CPP"):
        return None
    v = variant()
    if v is None:
        log.warning("no C++ CPU kernel build runs on this CPU (they need AVX2, FMA and F16C "
                    "on x86); using the torch implementation")
        return None
    module = build(v)
    if module is not None:
        log.info("C++ CPU kernels: the %s build, for %s", v.name, v.about)
    return module


@cache
def build(v: Variant) -> ModuleType | None:
    """Variant `v`'s kernels, served or not: the install's prebuilt library when it is this
    checkout's, else the run-time compile; None when that fails. `v` must run on this CPU
    (build_spec.runnable): the tests run an AVX-512 CPU's AVX2-only kernels this way."""
    return _load_prebuilt(v) or _load_runtime(v)


def _load_runtime(v: Variant) -> ModuleType | None:
    """Variant `v` compiled from this checkout's csrc (once; then the cached build)."""
    name = _name(v)
    key = build_id(v)
    marker = _marker_path(name)
    module = _load_noted(marker, key) if marker is not None else None
    if module is not None:
        return module
    notice = threading.Timer(BUILD_NOTICE_S, log.info, (
        "compiling kvserve's C++ CPU kernels (once per machine and kvserve version; about a "
        "minute on 2 cores)...",))
    notice.daemon = True
    notice.start()
    try:
        from torch.utils.cpp_extension import load

        build_spec.ensure_ninja()
        module = load(name=name, sources=[str(s) for s in build_spec.sources()],
                      extra_include_paths=[str(CSRC)], extra_cflags=list(v.cflags),
                      extra_ldflags=list(LDFLAGS), verbose=False)  # lists load() extends
    except Exception as e:  # no compiler, no ninja, a failed build: keep the torch path
        log.warning("C++ CPU kernels unavailable (%s); using the torch implementation",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    finally:
        notice.cancel()
    if marker is not None:
        _note(marker, key, module)
    return module


def prebuilt_path(v: Variant) -> Path | None:
    """The install's library of variant `v` (setup.py), without loading it; None when it
    was not built."""
    try:
        spec = importlib.util.find_spec(v.extension)
    except ImportError:
        return None
    return None if spec is None or spec.origin is None else Path(spec.origin)


def _load_prebuilt(v: Variant) -> ModuleType | None:
    """The install's library of `v` when its record (build_spec.build_info) is what this
    checkout and torch would build now, else None after saying why (the run-time compile
    follows)."""
    path = prebuilt_path(v)
    if path is None:
        log.info("no prebuilt C++ CPU kernels of the %s build (kvserve was installed without "
                 "them): taking the run-time build", v.name)
        return None
    try:
        built = build_spec.read_build_info(path)
    except (OSError, ValueError) as e:
        built, reason = None, f"unreadable record: {e}"
    else:
        reason = "it carries no build record"
    if built is not None:
        now = build_spec.build_info(v, torch.__version__)
        what = {"fingerprint": "kernel sources or flags (csrc edited since the install)",
                "cpu": "CPU flags (built with -march=native on another CPU)",
                "torch": f"torch version (built against {built.get('torch')})",
                "variant": f"variant (built as {built.get('variant')})"}
        differ = [what.get(k, k) for k in sorted(set(now) | set(built))
                  if now.get(k) != built.get(k)]
        if not differ:
            try:
                return importlib.import_module(v.extension)
            except ImportError as e:
                reason = f"it does not import: {e}"
        else:
            reason = "its build record differs: " + "; ".join(differ)
    log.info("not using the prebuilt C++ CPU kernels %s: %s; taking the run-time build "
             "(scripts/setup.sh rebuilds the prebuilt one)", path.name, reason)
    return None


def loaded_build_id() -> str:
    """build_id() of the kernels `ops()` serves in this process (it loads them), or "none"
    without them."""
    v = variant()
    return "none" if ops() is None or v is None else build_id(v)


def expected_build_id() -> str:
    """loaded_build_id() as far as it is known without loading the kernels (a listing of the
    weight cache): "none" under KVSERVE_NO_CPP or on a CPU no variant runs on, else
    build_id() (a build that fails is only known by trying it)."""
    v = None if _flag("KVSERVE_NO_CPP") else variant()
    return "none" if v is None else build_id(v)


@cache
def build_id(v: Variant) -> str:
    """A digest of everything variant `v`'s build depends on: the sources and headers, its
    flags, torch and Python versions, the CPU's flags for `native`, and TORCH_EXTENSIONS_DIR.
    Also part of the weight cache's fingerprint (packed layouts are the kernels')."""
    return digest({"name": _name(v), "sources": build_spec.fingerprint(v),
                   "flags": [list(v.cflags), list(LDFLAGS)], "torch": torch.__version__,
                   "python": sys.version, "ext_dir": os.environ.get("TORCH_EXTENSIONS_DIR", "")})


def _marker_path(name: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / "kernels" / f"{name}.json"


def noted_builds(directory: Path) -> list[tuple[Path, dict[str, Any] | None]]:
    """The build notes in a cache's kernels/ directory, for a listing: each marker with its
    note ({"key", "module", "so", "stat"}), None for one that cannot be read."""
    notes: list[tuple[Path, dict[str, Any] | None]] = []
    for marker in sorted(directory.glob("*.json")):
        try:
            note = json.loads(marker.read_text())
        except (OSError, ValueError):
            note = None
        notes.append((marker, note if isinstance(note, dict) else None))
    return notes


def _load_noted(marker: Path, key: str) -> ModuleType | None:
    """The library a marker names, imported directly when the marker is for `key` and the
    file is still the one noted (size, mtime); None to take torch's load."""
    try:
        note = json.loads(marker.read_text())
        so = Path(note["so"])
        st = so.stat()
        if note["key"] != key or [st.st_size, st.st_mtime_ns] != note["stat"]:
            return None
        spec = importlib.util.spec_from_file_location(note["module"], so)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged marker or library: torch's load rebuilds or reloads
        log.warning("ignoring the noted C++ kernel build %s (%s)", marker, e)
        return None


def _note(marker: Path, key: str, module: ModuleType) -> None:
    try:
        so = Path(module.__file__ or "")
        st = so.stat()
        data = json.dumps({"key": key, "module": module.__name__, "so": str(so),
                           "stat": [st.st_size, st.st_mtime_ns]}).encode()
        atomic_write(marker, lambda f: f.write(data))
    except OSError as e:  # a read-only cache: every start takes torch's load
        log.debug("could not note the kernel build in %s: %s", marker, e)


def isa() -> str:
    """The instruction set the kernels run on here ("AVX-512", "AVX2"), or "none"."""
    return ops().isa() if ops() is not None else "none"


def _cpu(device: torch.device | str) -> ModuleType | None:
    return ops() if torch.device(device).type == "cpu" else None


def attention_kernels(dtype: torch.dtype, device: torch.device | str, head_dim: int,
                      kv_dtype: torch.dtype | None = None
                      ) -> ModuleType | TritonPagedAttention | None:
    """What serves a layer's `store_kv` and `paged_attention` for activations in `dtype` and a
    cache tensor in `kv_dtype` (None: `dtype`; int8: quantized rows): on the CPU the C++
    module, activations in float32 (AVX-512 or AVX2) or bf16 (AVX512-BF16), head_dim a
    multiple of 16, K/V in the compute dtype or int8, or in float16/bf16 under float32
    activations on AVX2 (`has_paged_attention` says which); on a GPU the Triton kernels
    (triton_paged), activations in bf16, float16 or float32, K/V in the same dtype, where
    Triton imports and KVSERVE_NO_TRITON is unset. KVSERVE_TRITON_ON_CPU=1 with
    TRITON_INTERPRET=1 puts the Triton kernels on the CPU, under Triton's interpreter: a test
    of them, slow, not a way to serve."""
    kv_dtype = kv_dtype or dtype
    kind = torch.device(device).type
    if kind == "cuda" or kind == "cpu" and _flag("KVSERVE_TRITON_ON_CPU"):
        if kv_dtype != dtype or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        return _triton()
    kernels = _cpu(device)
    if kernels is None or head_dim % 16 or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels if kernels.has_paged_attention(dtype, kv_dtype) else None


def kv_cache_dtype_for(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device | str,
                       head_dim: int) -> str:
    """The KV storage a layer with `head_dim` gets for --kv-cache-dtype `kv_cache_dtype` and
    activations in `dtype`: another name as it is; `auto` is float16 where the CPU kernel
    reads a float16 cache under float32 activations (the AVX2 build: F16C widens it exactly
    as it is read), which halves a token's K/V bytes (llama.cpp's default cache type), and
    the compute dtype ("auto") everywhere else: bf16 or float16 activations, GPUs, AVX-512
    builds (their kernel reads K/V only in the compute dtype) and machines without the
    kernels, where torch's path would convert the whole context on every read."""
    if kv_cache_dtype != "auto" or dtype != torch.float32:
        return kv_cache_dtype
    fast = attention_kernels(dtype, device, head_dim, torch.float16) is not None
    return "float16" if fast else "auto"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@cache
def _triton() -> TritonPagedAttention | None:
    if _flag("KVSERVE_NO_TRITON") or not triton_paged.available():
        return None
    return TritonPagedAttention()


def graph_safe(kernels: object) -> bool:
    """Whether an attention_kernels() answer runs from device tensors alone (no host reads,
    shapes fixed by the batch size), as a CUDA graph needs: the Triton kernels."""
    return isinstance(kernels, TritonPagedAttention)


def dense_kernels(dtype: torch.dtype, device: torch.device | str, n: int,
                  k: int) -> ModuleType | None:
    """The module when its `dense_linear` serves an [n, k] weight in `dtype` (float32 with
    AVX-512 or AVX2, bf16 with AVX512-BF16; n a multiple of 16, k even)."""
    kernels = _cpu(device)
    if kernels is None or n % 16 or k % 2 or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels if kernels.has_dense_linear(dtype) else None


def dense_half_kernels(device: torch.device | str, n: int, k: int) -> ModuleType | None:
    """The module when its `dense_linear` reads an [n, k] weight stored in 16 bits (bf16 or
    float16, `dense_pack_half`) with float32 activations, widened exactly as it is loaded, so
    the results are the float32 kernel's on the same values (AVX2; n a multiple of 16)."""
    kernels = _cpu(device)
    if kernels is None or n % 16 or k % 2:
        return None
    return kernels if kernels.has_dense_half() else None


def quant_kernels(dtype: torch.dtype, device: torch.device | str, n: int,
                  k: int) -> ModuleType | None:
    """The module when its int4/int8 x int8 kernel (`quant_linear`) serves an [n, k] weight
    for activations in `dtype` (float32 or bf16): n a multiple of 16, k of 32, a CPU with
    AVX512-VNNI/BF16 (vpdpbusd) or AVX2 (vpmaddubsw, the same integer sums)."""
    kernels = _cpu(device)
    if kernels is None or n % 16 or k % 32 or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels if kernels.has_quant_linear() else None


def norm_kernels(dtype: torch.dtype, device: torch.device | str) -> ModuleType | None:
    """The module when its `rms_norm` serves activations in `dtype`."""
    return _cpu(device) if dtype in (torch.float32, torch.bfloat16) else None


def gguf_kernels(dtype: torch.dtype, device: torch.device | str,
                 types: list[int]) -> ModuleType | None:
    """The module when its `gguf_linear` reads weights of these GGML types in the file's own
    blocks for activations in `dtype` (float32 or bf16; AVX2 where the CPU has it, else its
    portable C++ path)."""
    kernels = _cpu(device)
    if kernels is None or dtype not in (torch.float32, torch.bfloat16) or not types:
        return None
    return kernels if all(kernels.gguf_supports(t) for t in types) else None
