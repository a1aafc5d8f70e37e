"""What the C++ CPU kernels are built from, defined once for both builds: the install's
(setup.py, which loads this file by path, before kvserve is installed) and the run-time
compile in `kvserve.kernels.ops()`. Standard library only, for that reason.

**One build for every x86 level.** The install compiles the kernels once per `Variant`, each
with the instruction set of a level of x86 CPU (`-march=x86-64-v3` for AVX2, x86-64-v4 with
VNNI and BF16 for AVX-512, that plus AMX), into a module of its own
(`kvserve.kernels._cpu_ops_<name>`); at run time `ops()` imports the best one this CPU runs
(`host_variant`, by the CPU's flags). A wheel or container built anywhere then runs on every
x86 machine with AVX2, as llama.cpp's CPU backend variants do; CPUs without AVX2 (none made
since 2015 for servers) take the torch implementation. The kernels choose their code paths by
the compiler's ISA macros, so a variant is exactly the code a `-march=native` build on such a
CPU compiles, less tuning. Elsewhere (not x86-64) there is one variant, `native`
(-march=native), tied to the CPU it was built on by `cpu_tag`.

Each build carries a record of what it was built from (`BUILD_INFO_PREFIX` and a JSON object,
a string in the library's data, written by setup.py), which `read_build_info` finds in the
file without loading it: a library built for other instructions must not even be loaded
here, its static initializers may use instructions this CPU lacks.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
# -g0: the install's build starts from Python's own CFLAGS, which carry -g (debug info made
# the library 23 MB instead of 0.6 MB, and its compile slower); a no-op in the run-time build.
# -fvisibility=hidden: two variants loaded in one process (the tests compare them) must each
# call their own functions, never bind to the other's same-named symbols.
CFLAGS = ("-O3", "-fopenmp", "-g0", "-fvisibility=hidden")
LDFLAGS = ("-fopenmp",)
# The install's prebuilt modules: kvserve/kernels/_cpu_ops_<variant>.<python ABI tag>.so
EXTENSION = "kvserve.kernels._cpu_ops"
BUILD_INFO_PREFIX = b"kvserve-build-info:"
# Set to a variant's name, the kernels of that variant are served (where this CPU runs it):
# to measure or test one ISA level on a machine that has a better one.
VARIANT_ENV = "KVSERVE_CPU_VARIANT"


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: `march` are its instruction-set flags, `needs` the
    /proc/cpuinfo flags a CPU must show to run it (Linux shows only those the OS enabled)."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]
    about: str

    @property
    def extension(self) -> str:
        """The install's module for this variant."""
        return f"{EXTENSION}_{self.name}"

    @property
    def cflags(self) -> tuple[str, ...]:
        return (*CFLAGS, *self.march)

    @property
    def native(self) -> bool:
        """Built for the build machine's own CPU (not x86-64): its record names that CPU."""
        return "-march=native" in self.march


# x86-64-v3: AVX, AVX2, BMI1/2, F16C, FMA, LZCNT (shown as abm), MOVBE, XSAVE; v4 adds
# AVX-512 F, BW, CD, DQ and VL.
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_VNNI_BF16 = ("-mavx512vnni", "-mavx512bf16")
# Best first: host_variant takes the first this CPU runs. AVX-512 CPUs without BF16 (Skylake-X,
# Cascade Lake, Ice Lake) take avx2: the kernels' AVX-512 forms of the int8 matmuls and of
# bf16 need both VNNI and BF16, so such a CPU would lose more than it gains.
X86_VARIANTS = (
    Variant("amx", ("-march=x86-64-v4", *_VNNI_BF16, "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
            _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
            "AVX-512 with VNNI, BF16 and AMX tiles (Sapphire Rapids and later)"),
    Variant("avx512", ("-march=x86-64-v4", *_VNNI_BF16), _V4 | {"avx512_vnni", "avx512_bf16"},
            "AVX-512 with VNNI and BF16 (AMD Zen 4 and later, Intel Cooper Lake)"),
    Variant("avx2", ("-march=x86-64-v3",), _V3,
            "AVX2, FMA and F16C (AMD Zen 1-3, Intel Haswell and later, AVX-512 CPUs without BF16)"),
)
NATIVE = Variant("native", ("-march=native",), frozenset(), "this machine's own CPU")


def variants() -> tuple[Variant, ...]:
    """The variants an install builds here: every x86 level on x86-64, else `native`."""
    return X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else (NATIVE,)


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags as Linux shows them (empty where /proc/cpuinfo is not to be read);
    read once per process (build ids and the weight cache's keys ask again)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def runnable() -> list[Variant]:
    """The variants this CPU runs, best first."""
    flags = cpu_flags()
    return [v for v in variants() if v.needs <= flags]


def host_variant() -> Variant | None:
    """The variant the kernels run as here: $KVSERVE_CPU_VARIANT when set, else the best this
    CPU runs; None where none runs (an x86 CPU without AVX2). A name that is no variant, or
    one this CPU cannot run, is refused with what would be accepted."""
    chosen = os.environ.get(VARIANT_ENV, "")
    ok = runnable()
    if not chosen:
        return ok[0] if ok else None
    known = {v.name: v for v in variants()}
    if chosen not in known:
        raise ValueError(f"{VARIANT_ENV}={chosen!r} is no kernel variant; known: "
                         f"{', '.join(known)}")
    if known[chosen] not in ok:
        missing = sorted(known[chosen].needs - cpu_flags())
        raise ValueError(f"{VARIANT_ENV}={chosen}: this CPU lacks {', '.join(missing)}; it "
                         f"runs {', '.join(v.name for v in ok) or 'none'}")
    return known[chosen]


def sources() -> list[Path]:
    """The translation units: every csrc/*.cpp (a new file is built without being listed)."""
    return sorted(CSRC.glob("*.cpp"))


def fingerprint(variant: Variant) -> str:
    """A digest of what a variant's library depends on: every file in csrc (sources and
    headers) and its flags. Editing a kernel changes it, so a stale build is not loaded."""
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(CSRC.glob("*.[ch]*")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(json.dumps([variant.cflags, LDFLAGS]).encode())
    return h.hexdigest()


def cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the `native` variant is built for the build
    machine's CPU, so one made on another CPU (a shared home directory, a copied venv) must
    not be loaded here."""
    return hashlib.blake2b(" ".join(sorted(cpu_flags())).encode(), digest_size=4).hexdigest()


def build_info(variant: Variant, torch_version: str) -> dict[str, str]:
    """The record a variant's build made here, now, carries: compared field by field at load.
    A `native` build also names the CPU (cpu_tag); an x86 level runs on any CPU with its
    flags, which host_variant checks."""
    info = {"variant": variant.name, "fingerprint": fingerprint(variant), "torch": torch_version}
    if variant.native:
        info["cpu"] = cpu_tag()
    return info


def info_source(info: dict[str, str]) -> str:
    """A C++ translation unit holding `info` as a string the linker keeps (`used`)."""
    text = BUILD_INFO_PREFIX.decode() + json.dumps(info, sort_keys=True)
    literal = text.replace("\\", "\\\\").replace('"', '\\"')
    return ("// Generated by setup.py (kvserve/kernels/build_spec.py): what the library is built"
            " from.\n"
            f'extern "C" __attribute__((used)) const char kvserve_build_info[] = "{literal}";\n')


def read_build_info(library: Path) -> dict[str, str] | None:
    """The record in a built library's file (None when it has none), read without loading it."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(BUILD_INFO_PREFIX)
        if start < 0:
            return None
        start += len(BUILD_INFO_PREFIX)
        end = data.find(b"\0", start)
        return json.loads(data[start:end if end >= 0 else len(data)])


def ensure_ninja() -> None:
    """Put the pinned `ninja` package's binary on PATH where no ninja is (an unactivated venv):
    torch's builds run it by name. Without the package, torch says what is missing."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
