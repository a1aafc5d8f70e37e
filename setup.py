"""Builds kvserve's C++ CPU kernels (kvserve/kernels/csrc/*.cpp) at install time, once per
x86 level (kvserve.kernels._cpu_ops_avx2, _avx512, _amx: build_spec.variants()), so that the
first start on any x86 CPU with AVX2 needs neither a compiler nor a minute of compiling.
Everything else about the package is in pyproject.toml.

torch's own extension support (CppExtension, BuildExtension: its headers, libraries, ABI
flags and ninja) builds it, so torch must import here: scripts/setup.sh installs the pinned
torch first and builds with --no-build-isolation (an isolated build would install a second
torch, 180 MB, into a throwaway environment on every install); pyproject's build-system
requires the same torch for a plain isolated `pip install .`. The sources, variants and
flags are kvserve/kernels/build_spec.py's, which the run-time compile uses too; each library
carries a record of them (build_spec.build_info) that `kvserve.kernels.ops()` checks before
loading it. KVSERVE_NO_CPP=1 installs without the kernels (the torch implementation runs).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _build_spec():
    # By path: importing kvserve.kernels would import the package, which is not installed yet.
    path = ROOT / "kvserve" / "kernels" / "build_spec.py"
    spec = importlib.util.spec_from_file_location("kvserve_build_spec", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _record(library: Path):
    try:
        return _build_spec().read_build_info(library)
    except (OSError, ValueError):  # none yet, or a damaged one: build
        return None


def _ext_modules():
    if os.environ.get("KVSERVE_NO_CPP", "") not in ("", "0"):
        return [], {}
    # numpy may not be installed yet (setup.sh installs the build requirements only): torch
    # warns about it, and nothing here needs it.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    bs = _build_spec()
    bs.ensure_ninja()
    records, exts = {}, []
    for variant in bs.variants():
        # The record of what this build is made from, in a source of its own (not in csrc,
        # so the run-time compile and the fingerprint never see it).
        record = bs.build_info(variant, torch.__version__)
        info = ROOT / "build" / "kvserve_build_info" / variant.name / "build_info.cpp"
        info.parent.mkdir(parents=True, exist_ok=True)
        text = bs.info_source(record)
        if not info.exists() or info.read_text() != text:  # unchanged: no recompile of it
            info.write_text(text)
        records[variant.extension] = record
        exts.append(CppExtension(
            variant.extension,
            sources=[os.path.relpath(p, ROOT) for p in [*bs.sources(), info]],
            include_dirs=[os.path.relpath(bs.CSRC, ROOT)],
            extra_compile_args=list(variant.cflags), extra_link_args=list(bs.LDFLAGS)))

    class BuildKernels(BuildExtension):
        def build_extension(self, ext):
            # An editable install builds in a fresh temporary directory every time: reuse the
            # library already in the package when its record is this build's (rerunning
            # scripts/setup.sh then costs no compile).
            built = Path(self.get_ext_fullpath(ext.name))
            here = ROOT / "kvserve" / "kernels" / built.name
            if here != built and _record(here) == records[ext.name]:
                print(f"{here.name} is up to date with its sources", file=sys.stderr)
                built.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(here, built)
                return
            super().build_extension(ext)

    return exts, {"build_ext": BuildKernels}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
