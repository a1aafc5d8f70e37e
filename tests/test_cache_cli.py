"""The weight cache's upkeep (kvserve.models.cache_budget): its size budget holds under loads
of many configurations and models, the least recently used entries go first, an entry over
its model's budget is not written, entries no code can use again are removed; and
`kvserve cache list` / `kvserve cache clear [--stale]` through the CLI's main(). Entries are
real saves of tiny models (tests/conftest.py), each test in a cache directory of its own."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from kvserve.entrypoints.cli import main
from kvserve.models.cache_budget import (
    MODEL_FLOOR,
    Budget,
    StoredEntry,
    scan,
)
from kvserve.models.weight_cache import find_entry
from kvserve.worker.model_runner import load_target

CPU = torch.device("cpu")
# (dtype, quantization) pairs: entries of different sizes for one model
CONFIGS = [(torch.float32, "none"), (torch.float32, "int8"), (torch.float32, "int4"),
           (torch.bfloat16, "none"), (torch.bfloat16, "int8")]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(root))
    for name in ("KVSERVE_NO_WEIGHT_CACHE", "KVSERVE_WEIGHT_CACHE_BUDGET",
                 "KVSERVE_WEIGHT_CACHE_MODEL_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    return root


@pytest.fixture
def models(tiny_llama_dir, tmp_path) -> list[Path]:
    """Three copies of one tiny model under paths of one length: entries of equal size."""
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"model{i}")
        shutil.copytree(tiny_llama_dir, paths[-1])
    return paths


def _load(path: Path, dtype: torch.dtype = torch.float32, quantization: str = "none") -> None:
    load_target(str(path), dtype, CPU, "auto", quantization)


def _entries(cache: Path) -> list[StoredEntry]:
    return scan(cache / "weights")


def _entry_bytes(path: Path, dtype: torch.dtype, quantization: str) -> int:
    entry = find_entry(path, dtype, CPU, quantization)
    assert entry is not None
    return entry.data.stat().st_size + entry.manifest.stat().st_size


def _configs_held(cache: Path) -> set[tuple[str, str]]:
    return {(e.header["dtype"], e.header["quantization"]) for e in _entries(cache)
            if e.header is not None}


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_budget_parses_and_bounds_each_model(monkeypatch):
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_BUDGET", raising=False)
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", raising=False)
    default = Budget.from_env()
    assert default == Budget(4 << 30, None, 4.0)
    assert default.for_model(10 << 20) == MODEL_FLOOR  # small models: the floor
    assert default.for_model(512 << 20) == 2 << 30  # a few times the model file
    assert default.for_model(2 << 30) == 4 << 30  # never over the total
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", "10GiB")
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", "2.5x")
    assert Budget.from_env().for_model(1 << 30) == int(2.5 * (1 << 30))
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", "300MB")
    assert Budget.from_env().for_model(1 << 30) == 300_000_000
    for name, bad in (("KVSERVE_WEIGHT_CACHE_BUDGET", "lots"),
                      ("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", "2y")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            Budget.from_env()
        monkeypatch.delenv(name)


def test_budget_holds_under_loads_of_many_configurations(tiny_llama_dir, cache_dir, caplog,
                                                         monkeypatch):
    caplog.set_level(logging.INFO, logger="kvserve")
    sizes = {}
    for dtype, q in CONFIGS:  # each entry's size, written under the default budget
        _load(tiny_llama_dir, dtype, q)
        sizes[str(dtype), q] = _entry_bytes(tiny_llama_dir, dtype, q)
    assert len(_entries(cache_dir)) == len(CONFIGS) and len(set(sizes.values())) > 2
    budget = sorted(sizes.values())[-1] + sorted(sizes.values())[-2]  # the two largest
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", str(budget))
    for dtype, q in CONFIGS * 2:  # misses and hits in turn
        _load(tiny_llama_dir, dtype, q)
        held = _entries(cache_dir)
        assert sum(e.bytes for e in held) <= budget
        assert (str(dtype), q) in _configs_held(cache_dir)  # the entry just used stays
    assert "to make room" in _messages(caplog)

    # the same bound per model (room for its largest entry: a manifest's size is estimated
    # before it is written, with the widest checksums)
    per_model = max(sizes.values()) + 4096
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", "1GiB")
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", str(per_model))
    for dtype, q in CONFIGS:
        _load(tiny_llama_dir, dtype, q)
        assert sum(e.bytes for e in _entries(cache_dir)) <= per_model
        assert (str(dtype), q) in _configs_held(cache_dir)


def test_least_recently_used_entries_go_first(models, cache_dir, monkeypatch):
    _load(models[0])
    size = _entry_bytes(models[0], torch.float32, "none")
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", str(2 * size + size // 2))  # two
    first = find_entry(models[0], torch.float32, CPU, "none")
    assert first is not None
    _load(models[1])
    past = time.time() - 100  # the order must not hinge on the clock's resolution
    for e in _entries(cache_dir):
        for f in e.files:
            os.utime(f, (past, past))
    _load(models[0])  # a hit: now model1's entry is the least recently used
    assert first.manifest.stat().st_mtime > past + 50
    _load(models[2])
    held = {e.model_path for e in _entries(cache_dir)}
    assert held == {str(models[0].resolve()), str(models[2].resolve())}
    _load(models[1])  # model0's entry was used before model2's
    assert {e.model_path for e in _entries(cache_dir)} == \
        {str(models[1].resolve()), str(models[2].resolve())}


def test_an_entry_over_its_budget_is_not_written(models, cache_dir, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="kvserve")
    _load(models[0])
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", "1KiB")
    _load(models[1])
    assert "not cached" in _messages(caplog) and "over the model's budget" in _messages(caplog)
    assert "KVSERVE_WEIGHT_CACHE_MODEL_BUDGET" in _messages(caplog)
    assert [e.model_path for e in _entries(cache_dir)] == [str(models[0].resolve())]
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET")
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", "0")  # 0: write none
    _load(models[2])
    assert [e.model_path for e in _entries(cache_dir)] == [str(models[0].resolve())]


def test_writing_removes_entries_of_missing_models(models, cache_dir):
    _load(models[0])
    _load(models[1])
    shutil.rmtree(models[0])
    _load(models[2])
    assert {e.model_path for e in _entries(cache_dir)} == \
        {str(models[1].resolve()), str(models[2].resolve())}


def _fake_old_version(cache: Path, model: Path) -> Path:
    """A copy of the model's entry as another kvserve version would have named and written
    it (same slot, another key and code digest); its manifest."""
    entry = find_entry(model, torch.float32, CPU, "none")
    assert entry is not None and entry.manifest.is_file()
    old = entry.data.with_name(entry.slot + "0" * 20)
    shutil.copy(entry.data, old.with_suffix(".bin"))
    manifest = json.loads(entry.manifest.read_text())
    manifest["header"]["code"] = "an older version"
    old.with_suffix(".json").write_text(json.dumps(manifest))
    return old.with_suffix(".json")


def test_list_shows_entries_total_budget_and_kernel_notes(models, cache_dir, capsys):
    _load(models[0])
    _load(models[1], torch.float32, "int8")
    old = _fake_old_version(cache_dir, models[0])
    orphan = cache_dir / "weights" / "crashed-000000000000-00000000000000000000.bin"
    orphan.write_bytes(b"\0" * 100)
    long_ago = time.time() - 7200
    os.utime(orphan, (long_ago, long_ago))
    marker = cache_dir / "kernels" / "kvserve_cpu_ops_test.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"key": "k", "module": "m", "so": "/nonexistent.so",
                                  "stat": [0, 0]}))
    shutil.rmtree(models[1])

    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"weight cache: {cache_dir / 'weights'}"
    assert lines[1].split() == ["last", "used", "size", "status", "model", "file", "(dtype,",
                                "quantization)"]
    # most recently used first; each row: date, time, size, unit, then status and entry
    rows = [ln.split(maxsplit=4) for ln in lines[2:6]]
    what = [" ".join(r[4].split()) for r in rows]
    m0, m1 = models[0].resolve(), models[1].resolve()
    assert what == [f"other code version {m0} (float32, none)",
                    f"model gone {m1} (float32, int8)",
                    f"current {m0} (float32, none)",
                    f"incomplete (no manifest) {orphan.name}"]
    assert rows[2][3] in ("KiB", "MiB") and rows[3][2:4] == ["100", "B"]
    assert "in 4 entries; budget 4.0 GiB in all, per model 4x the model file" in out
    assert "3 not current: `kvserve cache clear --stale` removes them" in out
    assert "kernel builds noted in" in out and "kvserve_cpu_ops_test: another build, " \
        "library /nonexistent.so (missing)" in out
    assert old.is_file()


def test_clear_stale_keeps_current_entries_and_clear_removes_all(models, cache_dir, capsys):
    _load(models[0])
    _load(models[1])
    _fake_old_version(cache_dir, models[0])
    fresh = cache_dir / "weights" / "writing-000000000000-00000000000000000000.bin"
    fresh.write_bytes(b"\0" * 10)  # a write in progress elsewhere: no manifest yet
    shutil.rmtree(models[1])
    assert main(["cache", "clear", "--stale"]) == 0
    assert "removed 2 of 4 entries" in capsys.readouterr().out
    held = _entries(cache_dir)
    assert sorted(e.stem for e in held) == sorted(
        [find_entry(models[0], torch.float32, CPU, "none").data.stem,  # type: ignore[union-attr]
         fresh.stem])
    marker = cache_dir / "kernels" / "note.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("{}")
    assert main(["cache", "clear"]) == 0
    assert "removed 2 of 2 entries" in capsys.readouterr().out
    assert not _entries(cache_dir) and marker.is_file()  # the kernels' notes stay


def test_cache_cli_rejects_bad_input_with_exit_code_2(cache_dir, capsys, monkeypatch):
    for argv in (["cache"], ["cache", "prune"], ["cache", "clear", "--all"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "usage:" in capsys.readouterr().err
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_BUDGET", "lots")
    assert main(["cache", "list"]) == 2
    err = capsys.readouterr().err
    assert "kvserve: error: KVSERVE_WEIGHT_CACHE_BUDGET: cannot parse size 'lots'" in err
    assert "Traceback" not in err
    monkeypatch.delenv("KVSERVE_WEIGHT_CACHE_BUDGET")
    cache_dir.mkdir()
    (cache_dir / "weights").write_text("not a directory")
    for argv in (["cache", "list"], ["cache", "clear"]):
        assert main(argv) == 2
        assert "is not a directory" in capsys.readouterr().err


def test_a_bad_budget_fails_the_start(tiny_llama_dir, cache_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_WEIGHT_CACHE_MODEL_BUDGET", "a lot")
    with pytest.raises(ValueError, match="KVSERVE_WEIGHT_CACHE_MODEL_BUDGET"):
        _load(tiny_llama_dir)
