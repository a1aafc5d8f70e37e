"""The weight cache as a whole (kvserve.models.weight_cache): what its directory holds, whether
each entry is still of use, its size budget and least-recently-used eviction.

An entry's files (`<stem>-<slot>-<key>.bin` and `.json`) are named by digests, so nothing goes
stale by being read wrongly; it goes stale by never being read again (another kvserve version,
a model file moved, rewritten or deleted), and the cache grew without end before: a 1.1 GB
GGUF made a 3.07 GB entry, and one model served from three installs kept three. Two settings
bound it, both read by `Budget.from_env`:

- `KVSERVE_WEIGHT_CACHE_BUDGET`: all entries together (default 4GiB; 0 writes none);
- `KVSERVE_WEIGHT_CACHE_MODEL_BUDGET`: the entries of one model file, a size or a multiple
  of the file's size (default `4x`, at least 256 MiB): the cache stays within a few times
  the model it saves a start of. `--quantization auto` packs a Q4_K_M GGUF into about 3x its
  file in float32 (the real Qwen2.5-Coder-1.5B: a 3.2 GiB entry for a 1.07 GB file, most of
  it the float32 embedding); under `1x` such a model was never cached and every start
  dequantized and packed it again (about ten times a cached start). The floor is for small
  quantized models: the default model's 98 MB Q4_1 GGUF packs to a 202 MiB entry in float32 (148 MiB
  in bf16; int8 252 MiB, unquantized 383-621 MiB). A GGUF served in place
  (`--quantization gguf`) writes no entry at all.

Writing an entry (`make_room`) first removes what no process can use again (entries of the
same slot made by other code, entries whose model file is gone or changed, data files left
by a crashed write), then the least recently used entries, of that model first, until the new
one fits; an entry larger than its model's budget is not written. A hit touches the
manifest's mtime (`touch`), which is the entry's last use, and evicts the same way (without
the sweep, which reads every model file's head), so a lowered budget holds after the next
start.

Removing an entry a running process has mapped is safe (Linux keeps the mapping); its disk
space is freed when that process exits.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.disk_cache import model_fingerprint
from kvserve.settings import parse_size

log = logging.getLogger(__name__)

ENV_BUDGET = "KVSERVE_WEIGHT_CACHE_BUDGET"
ENV_MODEL_BUDGET = "KVSERVE_WEIGHT_CACHE_MODEL_BUDGET"
DEFAULT_BUDGET = "4GiB"
DEFAULT_MODEL_BUDGET = "4x"
MODEL_FLOOR = 256 << 20  # a relative per-model budget is at least this
# A data file without its manifest, or a temporary file, younger than this may be a write in
# progress in another process (the manifest follows its data within a second); older, it is
# left by a crash.
ORPHAN_AGE_S = 3600.0
CURRENT = "current"
WRITING = "being written"
_FACTOR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """Bytes the weight cache may hold: `total` in all, and per model file either `per_model`
    bytes or `factor` times the file's size (at least MODEL_FLOOR)."""

    total: int
    per_model: int | None = None
    factor: float = 1.0

    @classmethod
    def from_env(cls) -> Budget:
        """The budget the environment sets (module docstring); a value that does not parse is
        a ValueError naming its variable."""
        total_text = os.environ.get(ENV_BUDGET) or DEFAULT_BUDGET
        model_text = os.environ.get(ENV_MODEL_BUDGET) or DEFAULT_MODEL_BUDGET
        try:
            total = parse_size(total_text)
        except ValueError as e:
            raise ValueError(f"{ENV_BUDGET}: {e}") from None
        m = _FACTOR_RE.match(model_text)
        if m:
            return cls(total, None, float(m.group(1)))
        try:
            return cls(total, parse_size(model_text))
        except ValueError:
            raise ValueError(f"{ENV_MODEL_BUDGET}: cannot parse {model_text!r}; use a size such "
                             f"as 2GiB or a multiple of the model file's size such as 1.5x"
                             ) from None

    def for_model(self, model_bytes: int) -> int:
        """The most bytes the entries of a model file of `model_bytes` may hold together."""
        if self.per_model is not None:
            return min(self.per_model, self.total)
        return min(max(int(self.factor * model_bytes), MODEL_FLOOR), self.total)

    def describe(self) -> str:
        per_model = (size_text(self.per_model) if self.per_model is not None else
                     f"{self.factor:g}x the model file, at least {size_text(MODEL_FLOOR)}")
        return f"{size_text(self.total)} in all, per model {per_model}"


def model_bytes(fingerprint: dict[str, Any]) -> int:
    """A model's size by its fingerprint (disk_cache.model_fingerprint; a directory's files
    together)."""
    if "files" in fingerprint:
        return sum(int(f["size"]) for f in fingerprint["files"].values())
    return int(fingerprint["size"])


def size_text(n: int) -> str:
    """Bytes in binary units, as the budgets are written ('155.2 MiB')."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class StoredEntry:
    """One entry (or the remains of one) in the weights directory. `header` is the manifest's
    fingerprint (weight_cache.find_entry), None for a data file without a readable manifest
    or a temporary file."""

    stem: str
    files: tuple[Path, ...]
    bytes: int
    last_used: float  # the manifest's mtime (touched on every hit), else the newest file's
    header: dict[str, Any] | None

    @property
    def model_path(self) -> str | None:
        return None if self.header is None else self.header["model"]["path"]

    def slot(self) -> str:
        """`<stem>-<slot>-`: what entries for the same model path, dtype, device,
        quantization and rank share (weight_cache.CacheEntry.slot)."""
        return self.stem[:self.stem.rfind("-") + 1]

    def remove(self) -> None:
        # manifest first: its absence uncommits the entry before the data goes
        for f in sorted(self.files, key=lambda p: p.suffix != ".json"):
            f.unlink(missing_ok=True)


def scan(weights: Path) -> list[StoredEntry]:
    """Every entry in `weights` (the cache's weights/ directory), oldest use first."""
    groups: dict[str, list[Path]] = {}
    try:
        names = list(weights.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ValueError(f"{weights} is not a directory") from None
    for p in names:
        if p.name.endswith(".tmp") and p.name.startswith("."):  # disk_cache.atomic_write's
            groups.setdefault(p.name, []).append(p)
        elif p.suffix in (".bin", ".json"):
            groups.setdefault(p.stem, []).append(p)
    entries = [e for stem, files in groups.items() if (e := _entry(stem, files)) is not None]
    return sorted(entries, key=lambda e: e.last_used)


def _entry(stem: str, files: list[Path]) -> StoredEntry | None:
    size, newest = 0, 0.0
    present: list[Path] = []
    manifest_mtime: float | None = None
    header = None
    for f in files:
        try:
            st = f.stat()
        except FileNotFoundError:  # removed meanwhile by another process
            continue
        present.append(f)
        size += st.st_size
        newest = max(newest, st.st_mtime)
        if f.suffix == ".json":
            manifest_mtime = st.st_mtime
            header = _read_header(f)
    if not present:
        return None
    return StoredEntry(stem, tuple(present), size, manifest_mtime or newest, header)


def _read_header(manifest: Path) -> dict[str, Any] | None:
    """The manifest's fingerprint, or None for one that is damaged or not a weight cache
    manifest. Reads the whole manifest (its header comes first, but JSON has no cheap
    prefix read); they are small beside their data."""
    try:
        header = json.loads(manifest.read_text())["header"]
        if isinstance(header["model"]["path"], str):
            return header
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def status(entry: StoredEntry, versions: dict[str, Any], now: float | None = None) -> str:
    """Whether `entry` can serve a start: CURRENT, WRITING, or why not (the model file is gone
    or changed, it was made by other code or another kernels build, it is damaged).
    `versions`: the header fields that this code writes (weight_cache.code_versions)."""
    now = time.time() if now is None else now
    suffixes = {f.suffix for f in entry.files}
    if entry.header is None:
        if ".json" in suffixes:
            return "damaged"
        return WRITING if now - entry.last_used < ORPHAN_AGE_S else "incomplete"
    if ".bin" not in suffixes:
        return "damaged"  # a manifest without its data
    header = entry.header
    path = Path(header["model"]["path"])
    try:
        if model_fingerprint(path) != header["model"]:
            return "model changed"
    except FileNotFoundError:
        return "model gone"
    except OSError:  # not ours to read: another user's entry, not removed on a write
        return "model unreadable"
    for field, what in (("format", "entry format"), ("code", "code version"),
                        ("torch", "torch version"), ("kernels", "kernels build")):
        if header.get(field) != versions.get(field):
            if field == "kernels" and header.get(field) == "none":
                return "made without the C++ kernels"
            return f"other {what}"
    return CURRENT


def _unusable(entry: StoredEntry, slot: str, now: float) -> bool:
    """What writing an entry of `slot` removes besides the LRU order: the slot's other entries
    (made by other code, or from an older model file: this code writes the slot's new one),
    and anything no code can read again (model gone or changed, damaged, an old incomplete
    write)."""
    if entry.header is not None and entry.slot() == slot:
        return True
    return status(entry, {}, now) in ("model gone", "model changed", "damaged", "incomplete")


def make_room(weights: Path, stem: str, new_bytes: int, model_path: str, model_bytes: int,
              budget: Budget, sweep: bool = True) -> list[StoredEntry] | None:
    """Make entry `stem` (`<name>-<slot>-<key>`, about to be written, or just used) of
    `new_bytes` for the model file `model_path` fit: with `sweep`, first remove what no process
    can use again (module docstring), then the least recently used other entries, this
    model's first, until it fits in its model's budget and in the total. Returns the entries
    removed, or None (nothing removed) when the entry alone exceeds its model's budget: then
    it must not be written."""
    if new_bytes > budget.for_model(model_bytes):
        return None
    now = time.time()
    slot = stem[:stem.rfind("-") + 1]
    removed: list[StoredEntry] = []
    kept: list[StoredEntry] = []
    for e in scan(weights):
        if e.stem == stem:
            continue  # counted as new_bytes
        (removed if sweep and _unusable(e, slot, now) else kept).append(e)
    for e in removed:
        e.remove()
    removed += _evict(kept, lambda e: e.model_path == model_path,
                      budget.for_model(model_bytes) - new_bytes)
    kept = [e for e in kept if e not in removed]
    removed += _evict(kept, lambda e: True, budget.total - new_bytes)
    return removed


def _evict(entries: list[StoredEntry], among: Callable[[StoredEntry], bool], room: int
           ) -> list[StoredEntry]:
    """Remove the least recently used of `entries` that `among` selects until those selected
    hold at most `room` bytes. A write in progress is counted, never removed."""
    chosen = [e for e in entries if among(e)]
    held = sum(e.bytes for e in chosen)
    removed = []
    for e in chosen:  # oldest use first
        if held <= room:
            break
        if e.header is None and status(e, {}) == WRITING:
            continue
        e.remove()
        removed.append(e)
        held -= e.bytes
    return removed


def touch(manifest: Path) -> None:
    """Record a use of the entry whose manifest this is (its mtime: the LRU order)."""
    try:
        os.utime(manifest)
    except OSError as e:  # a read-only cache: the order goes by writes only
        log.debug("weight cache: cannot touch %s: %s", manifest, e)
