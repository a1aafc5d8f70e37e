"""A model's weights in the form its kernels read them, kept on disk per fingerprint, so that a
start with nothing changed maps them back instead of dequantizing and packing them again.

An entry is two files under `<cache>/weights/` (kvserve.disk_cache: `KVSERVE_CACHE_DIR`,
off with `KVSERVE_NO_WEIGHT_CACHE=1`):

- `<model>-<slot>-<key>.bin`: the tensors' bytes one after another, each at an offset
  aligned to 64 bytes (as torch's allocator aligns its blocks). It is mapped back privately
  (`UntypedStorage.from_file(shared=False)`, what `torch.load(mmap=True)` does) and every
  tensor is a view of that mapping: the parameters and packed weights are the page cache's
  pages, with no copy and no unpickling (torch.load's weights-only unpickler is a visible
  part of a start even for the default model's 424 tensors), and processes serving the same
  entry share them;
- `<model>-<slot>-<key>.json`: the manifest, written after the tensors (its presence commits
  the entry): the fingerprint, the data file's size, each tensor's dtype, shape, strides,
  offset and CRC-32, and the model state that is not tensors (its config, the resolved
  quantization, which tensor is which parameter, each linear layer's packed form).

`key` digests the whole fingerprint: the model file (resolved path, size, mtime, first MiB),
the dtype, the device, the quantization asked for, the tensor-parallel rank and size, the
kernels' build (kernels.build_id: sources, flags, variant), torch's version, this entry format and
the source of the code whose output an entry holds (`_CODE`), so any change is another key, and
a start never reads an entry made by other code. `slot` digests the parts a user chooses (model
path, dtype, device, quantization, rank): writing an entry removes the slot's older ones, which
bounds the cache to one entry per way a model is served. A size budget bounds the rest
(kvserve.models.cache_budget: `KVSERVE_WEIGHT_CACHE_BUDGET`, least recently used entries go
first; an entry larger than its model's budget is not written), and `kvserve cache list` and
`kvserve cache clear [--stale]` show and remove entries.

Reading checks everything it can (manifest header = fingerprint, data file size, every tensor's
dtype, shape, strides and checksum, every parameter of the module present, in its dtype); any
doubt is a warning and a rebuild, never a silent use. A restored model holds the same tensors
as one built from the checkpoint, bit for bit (tests/test_weight_cache.py), so the tokens it
generates are the same. Only CPU models are cached (the mapped tensors are CPU memory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from kvserve import kernels
from kvserve.attention.backend import AttentionBackend
from kvserve.config import ModelConfig, RopeScaling
from kvserve.disk_cache import (
    atomic_write,
    cache_root,
    entry_name,
    model_fingerprint,
    slot_prefix,
    sources_digest,
)
from kvserve.distributed.parallel import SINGLE, TensorParallel
from kvserve.layers.linear import LinearBase
from kvserve.layers.quant import DenseWeight, QuantGroups, QuantizedWeight
from kvserve.models.cache_budget import (
    ENV_BUDGET,
    ENV_MODEL_BUDGET,
    Budget,
    StoredEntry,
    make_room,
    model_bytes,
    size_text,
    touch,
)
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import DeferredReader, LoadedModel, build_model, for_context, load_model
from kvserve.models.paths import INTERLEAVED_TYPES

log = logging.getLogger(__name__)

FORMAT = 1  # this module's layout of an entry; the code digest covers what the layers hold
ALIGN = 64  # each tensor's offset in the data file
_PKG = Path(__file__).resolve().parents[1]
# The code whose output an entry holds (config, parameters, packed forms): editing any of it
# retires the entries it made.
_CODE = [_PKG / p for p in (
    "config.py", "distributed/parallel.py", "layers/linear.py", "layers/quant.py",
    "layers/norm.py", "layers/mlp.py", "models/gguf_quants.py", "models/llama.py",
    "models/moe.py", "models/loader.py",
    "models/weight_cache.py", "models/gguf_file.py", "models/hf_dir.py", "models/arch.py")]
# The load-time state of a linear layer besides its parameters (LinearBase.load and pack_).
_LINEAR_STATE = ("packed", "row_absmax", "gguf_types", "gguf_groups")
# Objects held in that state, rebuilt from their attributes.
_OBJECTS: dict[str, type] = {c.__name__: c for c in (DenseWeight, QuantizedWeight, QuantGroups)}


class WeightCacheError(Exception):
    """An entry that cannot be used (damaged, or not what its name promises)."""


class _Uncacheable(Exception):
    """A model whose state this format cannot hold (nothing is written)."""


@dataclass(frozen=True)
class CacheEntry:
    """Where one model's packed weights live (or will), and what they must have been made
    from (`header`: the fingerprint)."""

    data: Path
    manifest: Path
    header: dict[str, Any]
    slot: str


def code_versions(kernels_build: str | None = None) -> dict[str, Any]:
    """The header fields that tie an entry to the code that made it, as this code writes
    them; `kernels_build` defaults to the kernels' build as known without loading them (a
    listing: kvserve.kernels.expected_build_id)."""
    return {"format": FORMAT, "code": sources_digest(_CODE), "torch": torch.__version__,
            "kernels": kernels.expected_build_id() if kernels_build is None else kernels_build}


def find_entry(path: Path, dtype: torch.dtype, device: torch.device, quantization: str,
               tp: TensorParallel = SINGLE) -> CacheEntry | None:
    """The entry for serving `path` so, present or not; None when the cache is off, the device
    is not the CPU, or the model cannot be fingerprinted."""
    root = cache_root()
    if root is None or device.type != "cpu":
        return None
    try:
        model = model_fingerprint(path)
    except OSError as e:
        log.debug("weight cache: cannot fingerprint %s: %s", path, e)
        return None
    chosen = {"path": model["path"], "dtype": str(dtype), "device": device.type,
              "quantization": quantization, "tp": [tp.rank, tp.size]}
    header = {**chosen, "model": model, **code_versions(kernels.loaded_build_id())}
    name = entry_name(path, chosen, header)
    base = root / "weights"
    return CacheEntry(base / f"{name}.bin", base / f"{name}.json", header, slot_prefix(name))


def load_packed(path: Path, dtype: torch.dtype, device: torch.device,
                backend_factory: Callable[[ModelConfig], AttentionBackend],
                pack: Callable[[LoadedModel], str], quantization: str,
                tp: TensorParallel = SINGLE, max_model_len: int | None = None
                ) -> tuple[LoadedModel, str]:
    """The model with its weights packed, and the quantization applied: from the cache entry
    for these arguments when there is a good one, else loaded from the checkpoint and packed by
    `pack` (which returns the quantization it applied), then saved for the next start. A
    restored model's GGUF reader is a DeferredReader (the tokenizer has a cache of its own)."""
    entry = find_entry(path, dtype, device, quantization, tp)
    budget = Budget.from_env()  # a bad setting fails the start, cache on or off
    if entry is not None and entry.manifest.is_file():
        t0 = time.perf_counter()
        try:
            loaded, applied = restore(entry, path, dtype, backend_factory, tp, max_model_len)
        except Exception as e:  # damaged or foreign: rebuilt below, and said so
            log.warning("weight cache: %s is unusable (%s); rebuilding it", entry.data.name, e)
        else:
            touch(entry.manifest)
            try:
                _make_room(entry, entry.data.stat().st_size + entry.manifest.stat().st_size,
                           budget, sweep=False)
            except OSError as e:  # a read-only cache: it stays as it is
                log.debug("weight cache: cannot keep it within its budget: %s", e)
            log.info("weights of %s mapped from the weight cache in %.2fs (%s)", path.name,
                     time.perf_counter() - t0, entry.data)
            return loaded, applied
    if entry is not None:
        log.info("preparing %s for this machine (weights its kernels read in another form "
                 "than the file's are packed, and kept in %s unless served from the file's "
                 "pages)", path.name, entry.data.parent)
    loaded = load_model(path, dtype, device, backend_factory, tp, max_model_len)
    applied = pack(loaded)
    if entry is not None and loaded.model.reads_gguf_in_place():
        # Its matrices are the file's own pages, or interleaved from them at load (at about
        # the speed of a copy): an entry would only copy them.
        log.info("weight cache: %s is served from the file's memory map (%s interleaved at "
                 "load), nothing to cache", path.name, ", ".join(INTERLEAVED_TYPES))
    elif entry is not None:
        save(entry, loaded, applied, budget)
    return loaded, applied


# ---------------------------------------------------------------------------------- save


class _Tensors:
    """The tensors of an entry by id, each stored once however many places hold it."""

    def __init__(self) -> None:
        self.by_id: dict[str, torch.Tensor] = {}
        self._ids: dict[int, str] = {}

    def put(self, t: torch.Tensor) -> str:
        if id(t) not in self._ids:
            self._ids[id(t)] = tid = f"t{len(self.by_id)}"
            self.by_id[tid] = t.detach()
        return self._ids[id(t)]


def _object_spec(obj: Any, tensors: _Tensors) -> dict[str, Any] | None:
    """A packed form (or GGUF groups) as its class and attributes: tensors by id, the kernels'
    module as a flag, plain values as they are."""
    if obj is None:
        return None
    name = type(obj).__name__
    if _OBJECTS.get(name) is not type(obj):
        raise _Uncacheable(f"a {name} in a linear layer")
    fields: dict[str, Any] = {}
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            fields[k] = {"t": tensors.put(v)}
        elif isinstance(v, ModuleType):
            if v is not kernels.ops():
                raise _Uncacheable(f"{name}.{k} is the module {v.__name__}")
            fields[k] = {"kernels": True}
        elif v is None or isinstance(v, bool | int | float | str):
            fields[k] = {"v": v}
        else:
            raise _Uncacheable(f"{name}.{k} is a {type(v).__name__}")
    return {"class": name, "fields": fields}


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as uint8, without a copy."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
    """Each tensor's spec for the manifest at the next aligned offset, and the data file's
    size. The crc is left at its widest value (written by _write_tensors), so a manifest
    measured before the write is no smaller than the one written."""
    specs: dict[str, Any] = {}
    offset = 0
    for tid, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise _Uncacheable(f"a {'non-contiguous' if t.device.type == 'cpu' else t.device.type}"
                               f" tensor of shape {tuple(t.shape)}")
        offset += -offset % ALIGN
        nbytes = t.numel() * t.element_size()
        specs[tid] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "stride": list(t.stride()), "offset": offset, "bytes": nbytes,
                      "crc": 0xFFFFFFFF}
        offset += nbytes
    return specs, offset


def _write_tensors(f: IO[bytes], tensors: dict[str, torch.Tensor], specs: dict[str, Any]
                   ) -> None:
    """Write each tensor's bytes where `specs` (_layout) puts it, and fill in its crc."""
    offset = 0
    for tid, t in tensors.items():
        spec = specs[tid]
        f.write(b"\0" * (spec["offset"] - offset))
        data = _bytes(t)
        f.write(memoryview(data))
        spec["crc"] = zlib.crc32(data)
        offset = spec["offset"] + data.nbytes


def model_state(model: LlamaForCausalLM) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A loaded and packed model's state as (JSON-able spec, tensors by id): every parameter
    (a tied one as an alias of the first name holding it) and each linear layer's load-time
    state (`_LINEAR_STATE`). Raises _Uncacheable for state the format cannot hold."""
    tensors = _Tensors()
    params: dict[str, Any] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            params[name] = {"alias": first[id(p)]}
        else:
            first[id(p)] = name
            params[name] = {"t": tensors.put(p), "requires_grad": p.requires_grad}
    buffers = set(model.state_dict()) - set(params)
    if buffers:  # persistent buffers would be load-time state too
        raise _Uncacheable(f"persistent buffers {sorted(buffers)[:3]}")
    linears: dict[str, Any] = {}
    for name, m in model.named_modules():
        if not isinstance(m, LinearBase):
            continue
        linears[name] = {
            "packed": _object_spec(m.packed, tensors),
            "row_absmax": None if m.row_absmax is None else tensors.put(m.row_absmax),
            "gguf_types": {str(i): t for i, t in m.gguf_types.items()},
            "gguf_groups": {str(i): _object_spec(g, tensors) for i, g in m.gguf_groups.items()},
        }
    if model._fused is not None:
        raise _Uncacheable("fused weights already built")
    return {"params": params, "linears": linears}, tensors.by_id


def _config_json(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _config_from_json(d: dict[str, Any]) -> ModelConfig:
    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    rope = RopeScaling(**{k: tuples(v) for k, v in d["rope_scaling"].items()})
    return ModelConfig(**{k: tuples(v) for k, v in d.items() if k != "rope_scaling"},
                       rope_scaling=rope)


def _make_room(entry: CacheEntry, need: int, budget: Budget, sweep: bool
               ) -> list[StoredEntry] | None:
    """cache_budget.make_room for `entry` taking `need` bytes, saying what it removed."""
    model = entry.header["model"]
    removed = make_room(entry.data.parent, entry.data.stem, need, model["path"],
                        model_bytes(model), budget, sweep)
    if removed:
        log.info("weight cache: removed %d entries (%s) to make room (%s): %s", len(removed),
                 size_text(sum(e.bytes for e in removed)), budget.describe(),
                 ", ".join(e.stem for e in removed))
    return removed


def save(entry: CacheEntry, loaded: LoadedModel, quantization: str,
         budget: Budget | None = None) -> None:
    """Write `entry` for a loaded and packed model (tensors, then the manifest), first making
    room within `budget` (default: the environment's; cache_budget.make_room removes the
    slot's older entries, then the least recently used). Never raises: a model the format
    cannot hold, one over its budget, or a cache that cannot be written, is logged and left
    uncached."""
    t0 = time.perf_counter()
    try:
        budget = budget or Budget.from_env()
        cfg = loaded.checkpoint_config
        if cfg is None or _config_from_json(json.loads(json.dumps(_config_json(cfg)))) != cfg:
            raise _Uncacheable("its config does not survive JSON")
        state, tensors = model_state(loaded.model)
        specs, data_bytes = _layout(tensors)
        manifest = {"header": entry.header, "data_bytes": data_bytes,
                    "config": _config_json(cfg), "weight_format": loaded.weight_format,
                    "quantization": quantization, "state": state, "tensors": specs}
        need = data_bytes + len(json.dumps(manifest))
        if _make_room(entry, need, budget, sweep=True) is None:
            limit = budget.for_model(model_bytes(entry.header["model"]))
            raise _Uncacheable(
                f"its entry would take {size_text(need)}, over the model's budget of "
                f"{size_text(limit)} ({budget.describe()}; {ENV_BUDGET}, {ENV_MODEL_BUDGET})")
        atomic_write(entry.data, lambda f: _write_tensors(f, tensors, specs))
        text = json.dumps(manifest).encode()
        atomic_write(entry.manifest, lambda f: f.write(text))
    except _Uncacheable as e:
        log.info("weight cache: %s not cached (%s)", loaded.path.name, e)
        return
    except Exception as e:  # a full or read-only disk, or a bug here: serve, uncached
        log.warning("weight cache: could not write %s (%s)", entry.data, e)
        return
    log.info("weight cache: saved %s (%.0f MB) in %.2fs", entry.data.name,
             entry.data.stat().st_size / 1e6, time.perf_counter() - t0)


# ------------------------------------------------------------------------------- restore


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise WeightCacheError(what)


def _restore_object(spec: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> Any:
    if spec is None:
        return None
    cls = _OBJECTS.get(spec["class"])
    _check(cls is not None, f"unknown class {spec['class']!r}")
    obj = cls.__new__(cls)
    for k, f in spec["fields"].items():
        if "t" in f:
            value = tensors[f["t"]]
        elif "kernels" in f:
            value = kernels.ops()
            _check(value is not None, "the entry needs the C++ kernels")
        else:
            value = f["v"]
        setattr(obj, k, value)
    return obj


def restore(entry: CacheEntry, path: Path, dtype: torch.dtype,
            backend_factory: Callable[[ModelConfig], AttentionBackend],
            tp: TensorParallel = SINGLE, max_model_len: int | None = None
            ) -> tuple[LoadedModel, str]:
    """The model an entry holds, its tensors mapped from the data file, and the quantization
    that was applied. Raises (WeightCacheError, or whatever reading a damaged file raises)
    unless every check passes."""
    manifest = json.loads(entry.manifest.read_text())
    _check(manifest.get("header") == entry.header, "its fingerprint does not match")
    size = entry.data.stat().st_size
    _check(size == manifest["data_bytes"], f"{size} bytes, {manifest['data_bytes']} written")
    # MAP_PRIVATE: writes to a tensor (none are made) would stay in this process
    storage = torch.UntypedStorage.from_file(str(entry.data), shared=False, nbytes=size)
    blob = torch.empty(0, dtype=torch.uint8).set_(storage)
    tensors: dict[str, torch.Tensor] = {}
    for tid, spec in manifest["tensors"].items():
        dtype_ = getattr(torch, spec["dtype"])
        offset, nbytes = spec["offset"], spec["bytes"]
        _check(isinstance(dtype_, torch.dtype) and offset % ALIGN == 0
               and offset + nbytes <= size, f"tensor {tid} is out of place")
        t = blob[offset:offset + nbytes].view(dtype_).as_strided(spec["shape"], spec["stride"])
        _check(t.numel() * t.element_size() == nbytes, f"tensor {tid} is not as written")
        _check(zlib.crc32(_bytes(t)) == spec["crc"], f"tensor {tid} fails its checksum")
        tensors[tid] = t

    read = _config_from_json(manifest["config"])
    cfg = for_context(read, max_model_len)
    model = build_model(cfg, dtype, backend_factory, tp)
    state = manifest["state"]
    expected = dict(model.named_parameters(remove_duplicate=False))
    _check(set(expected) == set(state["params"]), "its parameters are not the module's")
    linears = dict(model.named_modules())
    restored: dict[str, nn.Parameter] = {}
    for name, spec in state["params"].items():
        if "alias" in spec:
            p = restored[spec["alias"]]
        else:
            t = tensors[spec["t"]]
            _check(t.dtype == expected[name].dtype, f"{name} is {t.dtype}")
            p = nn.Parameter(t, requires_grad=spec["requires_grad"])
        restored[name] = p
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)
    for name, spec in state["linears"].items():
        m = linears.get(name)
        _check(isinstance(m, LinearBase), f"{name} is not a linear layer here")
        m.packed = _restore_object(spec["packed"], tensors)
        m.row_absmax = None if spec["row_absmax"] is None else tensors[spec["row_absmax"]]
        m.gguf_types = {int(i): t for i, t in spec["gguf_types"].items()}
        m.gguf_groups = {int(i): _restore_object(g, tensors)
                         for i, g in spec["gguf_groups"].items()}
    for name, m in linears.items():
        _check(not isinstance(m, LinearBase) or name in state["linears"],
               f"no state for {name}")
        if isinstance(m, LinearBase) and m.packed is None:
            _check(m.weight.shape == (m.out_features, m.in_features), f"{name} lacks its weight")
    model.eval()
    reader = DeferredReader(path) if path.suffix == ".gguf" else None
    return (LoadedModel(model, cfg, path, reader, manifest["weight_format"], read),
            manifest["quantization"])
