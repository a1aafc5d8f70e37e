"""The media a prefix-cache tier keeps blocks on, behind one contract (KVTier): host memory
(HostTier, pinned where a GPU copies into it) and files on disk (DiskTier, one per block, checked
when read back). The store that moves blocks between them and the pool is kv_cache.tiers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kvserve import faults
from kvserve.kv_cache.events import MEDIUM_DISK, MEDIUM_HOST, KVEventLog
from kvserve.kv_cache.hashing import BlockKey

log = logging.getLogger(__name__)


class KVTier(ABC):
    """A store of block payloads by key, bounded, least recently used evicted first.

    With `events` set (the engine's KV-event log), a tier logs each entry it gains as stored
    and each it loses as removed, under its `medium` (kv_cache.events)."""

    name: str
    medium: str = ""
    events: KVEventLog | None = None

    def held_keys(self) -> list[BlockKey]:
        """Every key held, to announce them again after the pool's reset (a tier that does
        not list them announces nothing)."""
        return []

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether a verified copy of `key` is (believed to be) here."""

    @abstractmethod
    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The payload, or None if absent or unusable (a bad entry is dropped, never served).
        A hit makes the entry most recently used."""

    @abstractmethod
    def put(self, key: BlockKey, payload: torch.Tensor) -> None:
        """Store a copy; may evict the least recently used entries."""

    @abstractmethod
    def __len__(self) -> int: ...


class Pending(Protocol):
    """A copy that may still be in flight (a recorded CUDA event): `synchronize()` returns
    once it has landed."""

    def synchronize(self) -> None: ...


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> Pending | None:
    """dst.copy_(src), asynchronous where src is on a GPU (dst is then pinned host memory):
    returns the event recorded on src's stream after the copy, which a host read of dst must
    wait on; None where the copy is already done (CPU to CPU is synchronous)."""
    dst.copy_(src, non_blocking=True)
    if src.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(src.device))
    return event


class HostTier(KVTier):
    """A fixed pool of block payloads in host memory (pinned when the fast pool is a GPU, so
    copies can overlap compute).

    Invariant: every read of a slot on the host (`get`, `items`, the spill of an evicted
    entry) first waits for the copy that filled it (`_landed`). A device-to-pinned copy is
    asynchronous; without the wait a block saved and read back in one pass (or spilled to
    disk) would be whatever the slot held before, and no key check could tell. A slot has at
    most one copy in flight."""

    name = "host"
    medium = MEDIUM_HOST

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False, spill: KVTier | None = None,
                 copy: Callable[[torch.Tensor, torch.Tensor], Pending | None] = device_copy
                 ) -> None:
        self.capacity = num_blocks
        self.data = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self._index: OrderedDict[int, tuple[int, BlockKey]] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending: dict[int, Pending] = {}  # slot -> its copy in flight
        self._copy = copy
        self.spill = spill  # where evicted entries go (write-back), e.g. the disk tier

    def __len__(self) -> int:
        return len(self._index)

    def _landed(self, slot: int) -> torch.Tensor:
        """The slot's payload, once the copy that filled it has landed."""
        pending = self._pending.pop(slot, None)
        if pending is not None:
            pending.synchronize()
        return self.data[slot]

    def contains(self, key: BlockKey) -> bool:
        entry = self._index.get(key.block_hash)
        return entry is not None and entry[1] == key

    def get(self, key: BlockKey) -> torch.Tensor | None:
        if not self.contains(key):
            return None
        self._index.move_to_end(key.block_hash)
        return self._landed(self._index[key.block_hash][0])

    def put(self, key: BlockKey, payload: torch.Tensor) -> None:
        if self.capacity == 0:
            if self.spill is not None:
                self.spill.put(key, payload)
            return
        entry = self._index.get(key.block_hash)
        if entry is not None:
            slot = entry[0]
            self._index.move_to_end(key.block_hash)
        else:
            if not self._free:
                _, (old_slot, old_key) = self._index.popitem(last=False)
                if self.events is not None:
                    self.events.removed(old_key.block_hash, self.medium)
                if self.spill is not None:
                    self.spill.put(old_key, self._landed(old_slot))
                self._free.append(old_slot)
            slot = self._free.pop()
        pending = self._copy(self._landed(slot), payload)  # one copy in flight per slot
        if pending is not None:
            self._pending[slot] = pending
        replaced = entry is not None and entry[1] != key
        self._index[key.block_hash] = (slot, key)
        if self.events is not None and (entry is None or replaced):
            if replaced:
                self.events.removed(key.block_hash, self.medium)
            self.events.stored(key, self.medium)

    def held_keys(self) -> list[BlockKey]:
        return [key for _, key in self._index.values()]

    def items(self):
        """(key, payload) for every entry, least recently used first."""
        for slot, key in list(self._index.values()):
            yield key, self._landed(slot)


_MAGIC = b"KVBLK1\n"


# Block files are opened without following a link at their name, and created fresh: a link
# planted in the cache directory can neither be read as a block nor written through.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _open(path: Path):
    return os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb")


def _create(path: Path):
    path.unlink(missing_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644),
                     "wb")


@dataclass
class _DiskEntry:
    path: Path
    size: int
    key: BlockKey


@dataclass
class DiskStats:
    corrupt_dropped: int = 0
    write_errors: int = 0
    evicted: int = 0


class DiskTier(KVTier):
    """Block files under `root/<fingerprint>/`, one per block, named by hash.

    A file holds a JSON header (fingerprint, hash, parent hash, tokens, shape, dtype and a
    checksum of the payload) and the raw payload. Files are written to a temporary name and
    renamed, so a reader never sees half a block; an entry whose checksum, size or identity
    does not match is deleted and treated as a miss. The directory is scanned at start-up
    (headers only), and the total size is kept under `max_bytes` by evicting the least
    recently used files.
    """

    name = "disk"
    medium = MEDIUM_DISK

    def __init__(self, root: str | os.PathLike, fingerprint: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype, max_bytes: int) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.stats = DiskStats()
        self._index: OrderedDict[int, _DiskEntry] = OrderedDict()
        self._bytes = 0
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:032x}.kvb"

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob("*.kvb"):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, path, st.st_size))
            else:  # a link or anything else is not ours: never read or written through
                self._drop_file(path)
        for _, path, size in sorted(found):
            header = self._read_header(path)
            try:
                key = BlockKey(int(header["hash"], 16), int(header["parent"], 16),
                               tuple(int(t) for t in header["tokens"]))
            except (TypeError, KeyError, ValueError):  # no header, or not one of ours
                key = None
            if key is None or path.name != self._path(key.block_hash).name:
                self._drop_file(path)
                continue
            self._add_index(key, path, size)
        for tmp in self.dir.glob("*.tmp*"):  # left by a crash mid-write
            self._drop_file(tmp)
        self._evict_to(self.max_bytes)
        if self._index:
            log.info("disk KV tier %s: %d blocks, %.1f MiB", self.dir, len(self._index),
                     self._bytes / 2**20)

    def _add_index(self, key: BlockKey, path: Path, size: int) -> None:
        old = self._index.pop(key.block_hash, None)
        if old is not None:
            self._bytes -= old.size
            if self.events is not None:
                self.events.removed(key.block_hash, self.medium)
        self._index[key.block_hash] = _DiskEntry(path, size, key)
        self._bytes += size
        if self.events is not None:
            self.events.stored(key, self.medium)

    def held_keys(self) -> list[BlockKey]:
        return [entry.key for entry in self._index.values()]

    def _read_header(self, path: Path) -> dict | None:
        try:
            with _open(path) as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    return None
                (length,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            return None
        ok = (header.get("fingerprint") == self.fingerprint
              and tuple(header.get("shape", ())) == self.block_shape
              and header.get("dtype") == str(self.dtype))
        return header if ok else None

    def contains(self, key: BlockKey) -> bool:
        entry = self._index.get(key.block_hash)
        return entry is not None and entry.key == key

    def get(self, key: BlockKey) -> torch.Tensor | None:
        if not self.contains(key):
            return None
        entry = self._index[key.block_hash]
        payload = self._read(entry)
        if payload is None:
            log.warning("dropping corrupt disk KV block %s", entry.path.name)
            self.stats.corrupt_dropped += 1
            self._remove(key.block_hash)
            return None
        self._index.move_to_end(key.block_hash)
        return payload

    def _read(self, entry: _DiskEntry) -> torch.Tensor | None:
        try:
            with _open(entry.path) as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    return None
                (length,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(length))
                raw = f.read()
            if (injected := faults.active()) is not None:
                raw = injected.on_disk_read(raw)
        except (OSError, ValueError, struct.error):
            return None
        key = entry.key
        if (header.get("fingerprint") != self.fingerprint
                or int(header.get("hash", "0"), 16) != key.block_hash
                or int(header.get("parent", "0"), 16) != key.parent_hash
                or tuple(header.get("tokens", ())) != key.token_ids
                or header.get("checksum") != hashlib.blake2b(raw, digest_size=16).hexdigest()):
            return None
        expected = int(np.prod(self.block_shape)) * torch.empty((), dtype=self.dtype).itemsize
        if len(raw) != expected:
            return None
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(self.dtype).view(self.block_shape)

    def put(self, key: BlockKey, payload: torch.Tensor) -> None:
        if self.contains(key):
            self._index.move_to_end(key.block_hash)
            return
        raw = payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({
            "fingerprint": self.fingerprint, "hash": f"{key.block_hash:032x}",
            "parent": f"{key.parent_hash:032x}", "tokens": list(key.token_ids),
            "shape": list(self.block_shape), "dtype": str(self.dtype),
            "checksum": hashlib.blake2b(raw, digest_size=16).hexdigest(),
        }).encode()
        size = len(_MAGIC) + 4 + len(header) + len(raw)
        if size > self.max_bytes:
            return
        self._evict_to(self.max_bytes - size)
        path = self._path(key.block_hash)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with _create(tmp) as f:
                if (injected := faults.active()) is not None:
                    injected.on_disk_write()
                f.write(_MAGIC + struct.pack("<I", len(header)) + header + raw)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole block
        except OSError as e:  # disk full, permissions: the cache is an optimisation, go on
            self.stats.write_errors += 1
            log.warning("could not write disk KV block %s: %s", path.name, e)
            tmp.unlink(missing_ok=True)
            return
        self._add_index(key, path, size)

    def _evict_to(self, limit: int) -> None:
        while self._index and self._bytes > limit:
            block_hash = next(iter(self._index))
            self._remove(block_hash)
            self.stats.evicted += 1

    def _remove(self, block_hash: int) -> None:
        entry = self._index.pop(block_hash)
        self._bytes -= entry.size
        self._drop_file(entry.path)
        if self.events is not None:
            self.events.removed(block_hash, self.medium)

    def _drop_file(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s: %s", path, e)
