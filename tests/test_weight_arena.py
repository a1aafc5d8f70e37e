"""kvserve.weight_arena: the huge-page arenas interleaved weights live in, and the reservation
the CLI faults in before it imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import kernels, weight_arena
from kvserve.models.paths import INTERLEAVED_TYPES, interleaved_bytes
from tests.test_gguf_kernels import random_blocks, type_id

pytestmark = pytest.mark.skipif(not weight_arena.LINUX, reason="the arenas are Linux's (smaps)")
MIB = 1 << 20


def _mapping(address: int) -> dict:
    """This process's mapping that holds `address` (/proc/self/smaps): start, Rss, VmFlags."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            found = {"start": lo, "end": hi} if lo <= address < hi else None
        elif found is not None and head == "Rss:":
            found["rss"] = int(line.split()[1]) * 1024
        elif found is not None and head == "VmFlags:":
            found["flags"] = line.split()[1:]
            return found
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped(address: int) -> bool:
    return any(lo <= address < hi for lo, hi in (
        (int(v, 16) for v in line.split()[0].split("-"))
        for line in Path("/proc/self/maps").read_text().splitlines()))


@pytest.fixture(autouse=True)
def _no_reservation():
    weight_arena.settle()
    yield
    weight_arena.settle()


def test_interleaved_parts_are_on_huge_page_arenas():
    """Repacked parts are carved out of arenas mapped at a 2 MiB boundary and advised
    MADV_HUGEPAGE ("hg" in smaps), which a decode step streams faster, small parts too; they
    compute what the file's layout computes, and an arena is unmapped with its last part."""
    k = kernels.ops()
    q4k, x8 = type_id("Q4_K"), k.gguf_repacked_type(type_id("Q4_K"))
    none = torch.empty(0, dtype=torch.long)
    # more than an arena's 64 MiB: an arena of its own, holding nothing else
    cols, rows = 4096, 29184
    raw = torch.from_numpy(random_blocks("Q4_K", rows, cols, seed=18))
    big = k.gguf_repack(raw, q4k, cols, none, weight_arena.take(rows // 8, 8 * raw.shape[1]))
    m = _mapping(big.data_ptr())
    assert m["start"] == big.data_ptr() and m["start"] % (2 * MIB) == 0 and "hg" in m["flags"]
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(19))
    assert torch.equal(k.gguf_linear(x, [big], [x8], [none]),
                       k.gguf_linear(x, [raw], [q4k], [none]))
    start = m["start"]
    del big
    assert not _mapped(start)
    small = [k.gguf_repack(raw[64 * i:64 * i + 64], q4k, cols, none,
                           weight_arena.take(8, 8 * raw.shape[1])) for i in range(3)]
    for part in small:
        m = _mapping(part.data_ptr())
        assert m["start"] % (2 * MIB) == 0 and "hg" in m["flags"] and part.data_ptr() % 64 == 0
    assert len({_mapping(p.data_ptr())["start"] for p in small}) == 1  # one arena
    assert torch.equal(k.gguf_linear(x, small, [x8] * 3, [none] * 3),
                       k.gguf_linear(x, [raw[:192]], [q4k], [none]))


def test_a_reservation_is_faulted_in_then_what_is_left_handed_back():
    """reserve's thread maps the estimate and makes it resident without writing it (a part
    written meanwhile keeps its bytes); the load's tensors come from it; settle hands back
    the rest, and later tensors go to arenas of their own."""
    size = 48 * MIB
    weight_arena.reserve(lambda: size)
    first = weight_arena.take(1, 3 * MIB)  # maybe before the thread has mapped anything
    first.fill_(7)
    prefault = weight_arena._prefault
    assert prefault is not None
    prefault.join(timeout=60)  # let it fault the whole reservation in
    arena = prefault.arena
    assert arena is not None and arena.size == size and prefault.done == size
    assert _mapping(arena.address)["rss"] == size  # resident, though nothing wrote it
    parts = [weight_arena.take(4, MIB) for _ in range(3)]
    for i, p in enumerate(parts):
        assert arena.address <= p.data_ptr() < arena.address + size
        p.fill_(i + 1)
    assert weight_arena.settle() == size - arena.used
    assert _mapping(arena.address)["rss"] <= arena.used + 4096
    assert all(bool((p == i + 1).all()) for i, p in enumerate(parts))
    assert bool((first == 7).all())
    after = weight_arena.take(1, MIB)
    assert not arena.address <= after.data_ptr() < arena.address + size
    assert weight_arena.settle() == 0  # nothing reserved now


def test_a_failed_estimate_reserves_nothing():
    def broken() -> int:
        raise ValueError("not a GGUF")

    weight_arena.reserve(broken)
    assert weight_arena.settle() == 0
    assert weight_arena.take(1, 64).shape == (1, 64)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory) -> Path:
    """A tiny llama as a Q4_K_M-like file: Q6_K ffn_down, attn_v and output, Q4_K the rest."""
    from tests.conftest import build_tiny_model
    from tests.test_gguf import write_gguf

    hf_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-arena"), "llama", hidden_size=256,
                              intermediate_size=256)
    path = tmp_path_factory.mktemp("arena") / "tiny-arena.gguf"
    write_gguf(hf_dir, path, random_k_quants=True)
    return path


def test_the_estimate_is_what_the_load_interleaves(k_quant_gguf, monkeypatch):
    """interleaved_bytes (read before torch, without the kernels) counts exactly the bytes
    `auto` interleaves at load, and its types are the ones the kernels interleave."""
    from kvserve.layers import quant
    from kvserve.layers.quant import GGUFWeight, interleaved_at_load
    from kvserve.models.loader import load_model
    from tests.test_gguf import _backend

    assert {name for name in ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL", "MXFP4")
            if interleaved_at_load(name)} == set(INTERLEAVED_TYPES)
    monkeypatch.setattr(quant, "gguf_auto_types", lambda: quant.GGUF_AUTO_TYPES)
    model = load_model(k_quant_gguf, torch.float32, torch.device("cpu"), _backend).model
    model.pack_("auto")
    weights = [m.packed for m in model.modules()
               if isinstance(getattr(m, "packed", None), GGUFWeight)]
    taken = sum(t.numel() for w in weights
                for t, x8 in zip(w.data, w.interleaved, strict=True) if x8)
    assert taken > 0 and interleaved_bytes(k_quant_gguf) == taken


def test_the_cli_parses_and_reserves_before_torch(k_quant_gguf):
    """`kvserve serve/generate` read their arguments and start the reservation with torch not
    yet imported, so the import and the page faults overlap."""
    code = ("import sys\n"
            "from kvserve.entrypoints import cli\n"
            "from kvserve.entrypoints.cli.common import prefault_weights\n"
            "from kvserve import weight_arena\n"
            "args = cli.build_parser().parse_args(['generate', 'hi', '--model', sys.argv[1]])\n"
            "prefault_weights(args)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "weight_arena._prefault.join()\n"
            "print(weight_arena._prefault.arena.size)\n")
    out = subprocess.run([sys.executable, "-c", code, str(k_quant_gguf)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == -(-interleaved_bytes(k_quant_gguf) // (2 * MIB)) * 2 * MIB
