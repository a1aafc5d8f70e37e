"""Optional C++ kernels for the CPU, compiled on first use with the system compiler.

`torch.utils.cpp_extension` builds `kvserve/csrc/cpu_ops.cpp` with ninja (a pinned dependency)
into the torch extensions cache (~/.cache/torch_extensions) the first time they are needed (~20 s
here; the model runner asks at start-up, not in the first request) and loads the cached build
afterwards. Where no compiler is available, the build fails, or KVSERVE_NO_CPP=1, `ops()`
returns None and callers keep their torch implementation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent.parent / "csrc" / "cpu_ops.cpp"]


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses -march=native, so a cached build
    from another CPU (a shared home directory) must not be loaded here."""
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
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: keep the torch path
        log.warning("C++ CPU kernels unavailable (%s); using the torch implementation",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
