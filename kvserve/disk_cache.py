"""kvserve's start-up cache on disk: where it lives, whether it is on, and what every entry
needs, a fingerprint of its inputs and an atomic write.

Everything kept there is derived data (a model's packed weights, its config and tokenizer, which
build of the C++ kernels matches their sources), so deleting the directory only costs one
slower start. Its users: `kvserve.models.weight_cache`, `Tokenizer.from_gguf`,
`kvserve.kernels.ops`.

- `KVSERVE_CACHE_DIR`: the directory (default `$XDG_CACHE_HOME/kvserve`, else
  `~/.cache/kvserve`).
- `KVSERVE_NO_WEIGHT_CACHE=1`: the cache is off; nothing is read from or written to it.
- `KVSERVE_WEIGHT_CACHE_BUDGET`, `KVSERVE_WEIGHT_CACHE_MODEL_BUDGET`: the weights' size
  budget (kvserve.models.cache_budget; `kvserve cache list|clear`).

Invariants: an entry is named by a digest of everything its content depends on, so a changed
input is a different name, never a stale hit; an entry appears whole or not at all (written to a
temporary file in the same directory, then renamed over); and a reader checks what it reads
(sizes, versions, checksums) and treats any doubt as a miss, rebuilding with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

ENV_DIR = "KVSERVE_CACHE_DIR"
ENV_OFF = "KVSERVE_NO_WEIGHT_CACHE"
# Bytes of a model file hashed into its fingerprint beside its size and mtime: a GGUF's header
# and metadata start there, so a file rewritten in place with the same size and mtime still
# misses if its header changed.
HEAD_BYTES = 1 << 20


def cache_root() -> Path | None:
    """The cache directory (not created here), or None when the cache is off."""
    return None if cache_off() else cache_dir()


def cache_dir() -> Path:
    """The cache directory, on or off (what `kvserve cache` lists and clears)."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvserve"


def cache_off() -> bool:
    """True when KVSERVE_NO_WEIGHT_CACHE turns the cache off."""
    return os.environ.get(ENV_OFF, "") not in ("", "0")


def digest(obj: Any, size: int = 16) -> str:
    """A hex digest of a JSON-able value (keys sorted, so equal values hash equal)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=size).hexdigest()


def sources_digest(paths: list[Path]) -> str:
    """A digest of the files' contents: code whose output an entry holds, so that editing it
    retires the entries it made (no version number to forget to bump)."""
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _file_identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.blake2b(f.read(HEAD_BYTES), digest_size=16).hexdigest()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": head}


def model_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies a model's bytes without reading them all: its resolved path, and the
    size, mtime (ns) and first MiB's digest of the file, or of every file directly in a model
    directory."""
    path = path.resolve()
    if path.is_dir():
        files = {p.name: _file_identity(p) for p in sorted(path.iterdir()) if p.is_file()}
        return {"path": str(path), "files": files}
    return {"path": str(path), **_file_identity(path)}


def entry_name(model: Path, slot: Any, header: Any) -> str:
    """`<model's stem>-<slot digest>-<header digest>`: an entry's name (before its suffix).
    The slot is what was asked for (a model's path and settings), the header everything the
    entry depends on: a changed input is another entry of the same slot, and writing one
    removes the slot's others (write_entry, the weight cache's budget)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", model.stem)[:80]
    return f"{stem}-{digest(slot, 6)}-{digest(header, 10)}"


def slot_prefix(name: str) -> str:
    """The part of an entry_name its slot's entries share."""
    return name.rsplit("-", 1)[0] + "-"


def read_entry(path: Path, what: str) -> bytes | None:
    """An entry's bytes; None where there is none, or where it cannot be read (then a warning
    naming `what` cache it is: the caller rebuilds the entry, as after any failed check)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("%s cache: cannot read %s (%s)", what, path, e)
        return None


def write_entry(path: Path, data: bytes, what: str) -> None:
    """Write an entry named `<slot>-<digest>.json` (atomic_write) and remove its slot's other
    entries: one per slot stays. A failed write is a warning naming `what` cache it is (the
    next start rebuilds the entry)."""
    try:
        atomic_write(path, lambda f: f.write(data))
    except OSError as e:
        log.warning("%s cache: could not write %s (%s)", what, path, e)
        return
    for old in path.parent.glob(f"{slot_prefix(path.name)}*.json"):
        if old != path:
            old.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through `write(file)` so that readers see the old file, the new one whole,
    or none: a temporary file in the same directory, renamed over `path` once complete (two
    processes writing the same entry each rename a complete file). Nothing is fsynced: a
    crash can leave a truncated entry, which its reader's checks turn into a miss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
