"""C++ kernels for the CPU, compiled on first use with the system compiler, and the one place
that decides whether a kernel or torch's fallback serves an operation.

`torch.utils.cpp_extension` builds `csrc/*.cpp` with ninja (a pinned dependency) into the torch
extensions cache (~/.cache/torch_extensions) the first time they are needed (~30 s here; the
model runner asks at start-up, not in the first request) and loads the cached build
afterwards. Where no compiler is available, the build fails, or KVSERVE_NO_CPP=1, `ops()`
returns None and callers keep their torch implementation.

The kernels are batch-invariant (see csrc/common.h): a row's result does not depend on the
other rows of the call. torch's CPU matmuls and attention are not (their blocking, and so
their summation order, follows the shapes), which is why every choice below is made per
layer and configuration, never per step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "layers.cpp", CSRC / "attention.cpp", CSRC / "linear.cpp"]


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses -march=native,
    so a cached build from another CPU (a shared home directory) must not be loaded here."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


@cache
def ops() -> ModuleType | None:
    if os.environ.get("KVSERVE_NO_CPP", "") not in ("", "0"):
        return None
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the pinned `ninja` package's binary, unactivated venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        return load(name=f"kvserve_cpu_ops_{_cpu_tag()}", sources=[str(s) for s in SOURCES],
                    extra_include_paths=[str(CSRC)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: keep the torch path
        log.warning("C++ CPU kernels unavailable (%s); using the torch implementation",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def isa() -> str:
    """The instruction set the kernels run on here ("AVX-512", "AVX2"), or "none"."""
    return ops().isa() if ops() is not None else "none"


def _cpu(device: torch.device | str) -> ModuleType | None:
    return ops() if torch.device(device).type == "cpu" else None


def attention_kernels(dtype: torch.dtype, device: torch.device | str,
                      head_dim: int) -> ModuleType | None:
    """The module when its `paged_attention` serves a layer: on the CPU, activations in
    float32 (AVX-512 or AVX2) or bf16 (AVX512-BF16), head_dim a multiple of 16; any K/V
    storage."""
    kernels = _cpu(device)
    if kernels is None or head_dim % 16 or dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels if kernels.has_paged_attention(dtype) else None


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
