"""The C++ kernels the install built (setup.py), one library per x86 level: `ops()` serves the
best this CPU runs when its record is this checkout's and torch's, and otherwise says why and
takes the run-time build of that variant."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.utils.cpp_extension

from kvserve import kernels
from kvserve.kernels import build_spec


@pytest.fixture
def fresh_ops():
    """ops() and the builds it loads, loaded afresh (and again after the test)."""
    kernels.ops.cache_clear()
    kernels.build.cache_clear()
    yield
    kernels.ops.cache_clear()
    kernels.build.cache_clear()


def test_ops_serves_the_prebuilt_extension(fresh_ops, monkeypatch):
    """scripts/setup.sh always builds every variant (KVSERVE_NO_CPP=1 at install is the one
    way without), so they are asserted, not skipped: a run-time compile here is a broken
    install. ops() serves the best variant this CPU runs."""
    monkeypatch.delenv("KVSERVE_NO_CPP", raising=False)
    monkeypatch.delenv(build_spec.VARIANT_ENV, raising=False)
    for v in build_spec.variants():
        path = kernels.prebuilt_path(v)
        assert path is not None, f"no {v.extension}: rerun scripts/setup.sh"
        assert build_spec.read_build_info(path) == build_spec.build_info(v, torch.__version__)
    v = kernels.variant()
    assert v is not None and v == build_spec.runnable()[0]
    module = kernels.ops()
    assert module is not None and module.__name__ == v.extension
    assert module.__file__ == str(kernels.prebuilt_path(v))
    assert module.isa() == ("AVX2" if v.name == "avx2" else "AVX-512")


@pytest.mark.parametrize("field,built,why", [
    ("fingerprint", "edited", "kernel sources or flags"),
    ("torch", "0.0.0", "torch version (built against 0.0.0)"),
    ("variant", "other", "variant (built as other)")])
def test_a_prebuilt_extension_for_other_sources_is_not_loaded(fresh_ops, monkeypatch, caplog,
                                                                field, built, why):
    """csrc edited since the install (or another torch, or a library of another variant under
    this one's name): ops() says why and takes the run-time build of the same variant (faked
    here: torch's load, with no start-up cache)."""
    monkeypatch.delenv(build_spec.VARIANT_ENV, raising=False)
    v = kernels.variant()
    assert v is not None and kernels.prebuilt_path(v) is not None, "rerun scripts/setup.sh"
    read = build_spec.read_build_info
    monkeypatch.setattr(build_spec, "read_build_info",
                        lambda path: {**read(path), field: built})
    monkeypatch.setenv("KVSERVE_NO_WEIGHT_CACHE", "1")  # no noted run-time build either
    monkeypatch.delenv("KVSERVE_NO_CPP", raising=False)
    runtime = types.ModuleType("kvserve_cpu_ops_runtime")
    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        return runtime

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    with caplog.at_level(logging.INFO, logger="kvserve.kernels"):
        assert kernels.ops() is runtime
    assert [c["sources"] for c in calls] == [[str(p) for p in build_spec.sources()]]
    assert calls[0]["extra_cflags"] == list(v.cflags) and calls[0]["name"].startswith(
        f"kvserve_cpu_ops_{v.name}_")
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "not using the prebuilt C++ CPU kernels" in message and why in message
    assert f"C++ CPU kernels: the {v.name} build" in message


# /proc/cpuinfo flags of the three kinds of machine this project meets (trimmed to what the
# variants ask about), and one without AVX2.
ZEN3 = "fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave sha_ni"
ZEN4 = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " amx_tile amx_int8 amx_bf16"
CASCADE_LAKE = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni"


@pytest.mark.parametrize("flags,expected", [
    (ZEN3, ["avx2"]), (ZEN4, ["avx512", "avx2"]), (SAPPHIRE_RAPIDS, ["amx", "avx512", "avx2"]),
    (CASCADE_LAKE, ["avx2"]), ("fpu sse2 avx", [])])
def test_each_cpu_runs_the_variants_its_flags_allow(monkeypatch, flags, expected):
    monkeypatch.setattr(build_spec, "variants", lambda: build_spec.X86_VARIANTS)
    monkeypatch.setattr(build_spec, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.delenv(build_spec.VARIANT_ENV, raising=False)
    assert [v.name for v in build_spec.runnable()] == expected
    best = build_spec.host_variant()
    assert (best.name if best else None) == (expected[0] if expected else None)
    if expected:
        monkeypatch.setenv(build_spec.VARIANT_ENV, expected[-1])
        assert build_spec.host_variant().name == expected[-1]


def test_a_variant_is_named_or_refused_clearly(monkeypatch, fresh_ops):
    monkeypatch.setattr(build_spec, "variants", lambda: build_spec.X86_VARIANTS)
    monkeypatch.setattr(build_spec, "cpu_flags", lambda: frozenset(ZEN3.split()))
    monkeypatch.setenv(build_spec.VARIANT_ENV, "sse9")
    with pytest.raises(ValueError, match="no kernel variant; known: amx, avx512, avx2"):
        kernels.ops()
    monkeypatch.setenv(build_spec.VARIANT_ENV, "avx512")
    with pytest.raises(ValueError, match="this CPU lacks avx512_bf16, avx512_vnni, avx512bw"):
        kernels.ops()


def test_a_cpu_no_variant_runs_on_takes_the_torch_path(monkeypatch, fresh_ops, caplog):
    monkeypatch.setattr(build_spec, "variants", lambda: build_spec.X86_VARIANTS)
    monkeypatch.setattr(build_spec, "cpu_flags", lambda: frozenset(["fpu", "sse2", "avx"]))
    monkeypatch.delenv(build_spec.VARIANT_ENV, raising=False)
    monkeypatch.delenv("KVSERVE_NO_CPP", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels"):
        assert kernels.ops() is None
    assert "need AVX2, FMA and F16C" in caplog.text
    assert kernels.expected_build_id() == "none"


def test_sources_are_every_cpp_file_in_csrc():
    """One list for both builds, globbed: a new csrc/*.cpp is built without being listed."""
    assert build_spec.sources() == sorted(build_spec.CSRC.glob("*.cpp"))
    assert {p.name for p in build_spec.sources()} >= {"layers.cpp", "attention.cpp",
                                                      "linear.cpp"}


def test_build_record_round_trips(tmp_path):
    """The record setup.py compiles in is found in the file without loading it."""
    info = {"variant": "v", "fingerprint": "f", "torch": 'a "quoted" \\ version'}
    src = build_spec.info_source(info)
    assert 'extern "C"' in src
    library = tmp_path / "lib.so"
    literal = src.split('= "', 1)[1].rsplit('";', 1)[0]
    text = literal.encode().decode("unicode_escape").encode()  # as the compiler stores it
    library.write_bytes(b"\x7fELF\0junk\0" + text + b"\0more")
    assert build_spec.read_build_info(library) == info
    library.write_bytes(b"\x7fELF\0no record")
    assert build_spec.read_build_info(library) is None
