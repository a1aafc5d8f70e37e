"""The C++ kernels the install built (setup.py): `ops()` serves them when their record is this
checkout's, CPU's and torch's, and otherwise says why and takes the run-time build."""

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
    kernels.ops.cache_clear()
    yield
    kernels.ops.cache_clear()


def test_ops_serves_the_prebuilt_extension(fresh_ops, monkeypatch):
    """scripts/setup.sh always builds it (KVSERVE_NO_CPP=1 at install is the one way
    without), so it is asserted, not skipped: a run-time compile here is a broken install."""
    monkeypatch.delenv("KVSERVE_NO_CPP", raising=False)
    path = kernels.prebuilt_path()
    assert path is not None, "no kvserve.kernels._cpu_ops: rerun scripts/setup.sh"
    assert build_spec.read_build_info(path) == build_spec.build_info(torch.__version__)
    module = kernels.ops()
    assert module is not None and module.__name__ == build_spec.EXTENSION
    assert module.__file__ == str(path)
    assert module.isa() in ("AVX-512", "AVX2")


@pytest.mark.parametrize("field,why", [
    ("fingerprint", "kernel sources or flags"), ("cpu_tag", "CPU flags"),
    ("torch", "torch version")])
def test_a_prebuilt_extension_for_other_sources_is_not_loaded(fresh_ops, monkeypatch, caplog,
                                                                field, why):
    """csrc edited since the install (or another CPU, another torch): ops() says why and
    takes the run-time build (faked here: torch's load, with no start-up cache)."""
    if kernels.prebuilt_path() is None:
        pytest.fail("no kvserve.kernels._cpu_ops: rerun scripts/setup.sh")
    if field == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.0")
    else:
        monkeypatch.setattr(build_spec, field, lambda: "edited")
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
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "not using the prebuilt C++ CPU kernels" in message and why in message


def test_sources_are_every_cpp_file_in_csrc():
    """One list for both builds, globbed: a new csrc/*.cpp is built without being listed."""
    assert build_spec.sources() == sorted(build_spec.CSRC.glob("*.cpp"))
    assert {p.name for p in build_spec.sources()} >= {"layers.cpp", "attention.cpp",
                                                      "linear.cpp"}


def test_build_record_round_trips(tmp_path):
    """The record setup.py compiles in is found in the file without loading it."""
    info = {"fingerprint": "f", "cpu": "c", "torch": 'a "quoted" \\ version'}
    src = build_spec.info_source(info)
    assert 'extern "C"' in src
    library = tmp_path / "lib.so"
    literal = src.split('= "', 1)[1].rsplit('";', 1)[0]
    text = literal.encode().decode("unicode_escape").encode()  # as the compiler stores it
    library.write_bytes(b"\x7fELF\0junk\0" + text + b"\0more")
    assert build_spec.read_build_info(library) == info
    library.write_bytes(b"\x7fELF\0no record")
    assert build_spec.read_build_info(library) is None
