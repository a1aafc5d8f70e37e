"""Every x86 level the install builds (build_spec.variants: AVX2, AVX-512 with VNNI and BF16,
AMX), checked on this machine wherever this CPU can run it: an AVX-512 machine tests the AVX2
build its users on Zen 2/3 get, not only its own best.

- Each variant's module loads beside the others, reports its own instruction set, and gives
  the same bits as the variant this machine serves for the matmuls whose sums are exact
  integers or taken in one order on every ISA (gguf_linear in the file's layout and
  interleaved, quant_linear, float32 dense_linear); attention, whose reduction trees follow
  the vector width, agrees to float rounding.
- The kernel test files run again, whole, in a process that serves another variant
  ($KVSERVE_CPU_VARIANT), so every kernel of that build is checked against its torch and
  portable references as the served one is.

A variant this CPU cannot run is skipped by name, with the flags it lacks.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvserve import kernels
from kvserve.kernels import build_spec
from tests.test_gguf_kernels import TYPES, random_blocks, repack, type_id

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = build_spec.variants()


def _module(v: build_spec.Variant) -> ModuleType:
    """Variant v's prebuilt module, or a skip naming what this CPU lacks for it."""
    if v not in build_spec.runnable():
        pytest.skip(f"the {v.name} build does not run on this CPU: it lacks "
                    f"{', '.join(sorted(v.needs - build_spec.cpu_flags()))}")
    path = kernels.prebuilt_path(v)
    assert path is not None, f"no {v.extension}: rerun scripts/setup.sh"
    assert build_spec.read_build_info(path) == build_spec.build_info(v, torch.__version__), \
        f"{path.name} is not built from these sources: rerun scripts/setup.sh"
    return importlib.import_module(v.extension)


@pytest.fixture(scope="module")
def served() -> ModuleType:
    module = kernels.ops()
    assert module is not None, "no C++ kernels: rerun scripts/setup.sh"
    return module


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_each_variant_loads_beside_the_others_as_itself(v):
    """-fvisibility=hidden and module-local classes: a second variant in the process runs
    its own code (were its calls bound to the first's symbols, every comparison below would
    pass for nothing)."""
    module = _module(v)
    assert module.isa() == ("AVX2" if v.name == "avx2" else "AVX-512")
    assert module.gguf_paths()[0] == ("AVX2" if v.name == "avx2" else "VNNI")
    assert module.gguf_paths()[-1] == "portable"


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_variants_give_the_served_variants_bits_for_gguf_matrices(v, served):
    """Every GGUF type in the file's layout, and Q4_K/Q6_K interleaved, at row counts that
    take each kernel's row groups and their remainders, every path each build offers."""
    module = _module(v)
    none = [torch.empty(0, dtype=torch.long)]
    g = torch.Generator().manual_seed(1)
    for i, kind in enumerate(TYPES):
        n, k = 24, 512
        raw = torch.from_numpy(random_blocks(kind, n, k, seed=i))
        tid = type_id(kind)
        forms = [(raw, tid)]
        x8 = served.gguf_repacked_type(tid)
        if x8:
            packed = repack(served, raw, tid, k)
            assert torch.equal(repack(module, raw, tid, k), packed), kind
            forms.append((packed, x8))
        x = torch.randn(37, k, generator=g)
        for part, t in forms:
            for m in (1, 4, 5, 9, 37):
                want = served.gguf_linear(x[:m], [part], [t], none)
                for path in module.gguf_paths():
                    got = module.gguf_linear(x[:m], [part], [t], none, path=path)
                    assert torch.equal(got, want), (kind, t, m, path)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_variants_give_the_served_variants_bits_for_quant_and_dense(v, served):
    module = _module(v)
    g = torch.Generator().manual_seed(2)
    n, k = 64, 256
    x = torch.randn(9, k, generator=g)
    for bits in (4, 8):
        q = torch.randint(0, 2**bits, (n, k), generator=g).to(torch.uint8)
        d = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        assert torch.equal(module.quant_linear(x, module.quant_pack(q, d, m, bits)),
                           served.quant_linear(x, served.quant_pack(q, d, m, bits))), bits
    w = torch.randn(n, k, generator=g)
    assert torch.equal(module.dense_linear(x, module.dense_pack(w)),
                       served.dense_linear(x, served.dense_pack(w)))


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_variants_attention_agrees_to_rounding(v, served):
    """float32 paged attention over a scattered block table: AVX2 sums in 8 lanes, AVX-512
    in 16, so the bits may differ; the values may not."""
    module = _module(v)
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block, blocks = 8, 2, 64, 16, 32
    cache = torch.randn(2, kv_heads, blocks * block, head_dim, generator=g)
    table = torch.randperm(blocks, generator=g)[None, :8]
    q = torch.randn(5, heads, head_dim, generator=g)
    seqs = torch.tensor([[0, 5, 100]])  # rows 0..5 of a sequence, the last at position 100
    out = [mod.paged_attention(q, cache, seqs, table, block, head_dim**-0.5)
           for mod in (module, served)]
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)


KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_gguf_kernels.py", "tests/test_kv16.py"]


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_the_kernel_tests_pass_on_every_variant_this_cpu_runs(v, served):
    """The kernel test files, whole, in a process serving variant v (the served one is
    tested by this run itself)."""
    _module(v)
    if v == kernels.variant():
        pytest.skip(f"the {v.name} build is the one this run serves: tested by the files "
                    "themselves")
    env = {**os.environ, build_spec.VARIANT_ENV: v.name}
    env.pop("KVSERVE_NO_CPP", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-x", *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = re.search(r"(\d+) passed", run.stdout)
    print(f"{v.name}: {summary.group(0) if summary else '?'} ({run.stdout.splitlines()[-1]})")
    assert summary and int(summary.group(1)) > 100, tail

