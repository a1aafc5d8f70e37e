"""Lower tiers of the prefix cache: host memory, then disk.

The fast pool (the runner's KV tensors: GPU memory, or RAM on a CPU-only machine) holds the
blocks attention reads. A full, hashed block that must leave it is copied to the host tier
instead of being lost; a block leaving the host tier goes to disk. A prefix hit in a lower
tier copies the block back into a fresh fast-pool block instead of recomputing it.

A block's payload is its K/V for every layer: [num_layers, 2, Hkv, block_size, W] in the
cache dtype (W = head dim, or head dim + scale bytes for int8). Tiers only move bytes, so they
work for any cache dtype.

Write policy: "write-back" copies a block down only when it is evicted from the tier above
(cheap, but a crash loses what was never evicted); "write-through" copies every block down
as soon as it is computed. Either way, a clean shutdown flushes what the upper tiers hold to
disk, so a restarted server finds it.
"""

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from kvserve import faults
from kvserve.kv_cache.hashing import BlockKey

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write-back", "write-through")


class KVTier(ABC):
    """A store of block payloads by key, bounded, least recently used evicted first."""

    name: str

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
                if self.spill is not None:
                    self.spill.put(old_key, self._landed(old_slot))
                self._free.append(old_slot)
            slot = self._free.pop()
        pending = self._copy(self._landed(slot), payload)  # one copy in flight per slot
        if pending is not None:
            self._pending[slot] = pending
        self._index[key.block_hash] = (slot, key)

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
        self._index[key.block_hash] = _DiskEntry(path, size, key)
        self._bytes += size

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

    def _drop_file(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s: %s", path, e)


@dataclass
class TierStats:
    """Block copies per tier since start (loads = hits served from that tier)."""

    loads: dict[str, int] = field(default_factory=dict)
    saves: dict[str, int] = field(default_factory=dict)


class TieredKVStore:
    """Moves block payloads between the fast pool (`kv_caches`, one tensor per layer shaped
    [2, Hkv, num_slots, W]) and the lower tiers, highest first."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, tiers: list[KVTier],
                 write_policy: str = "write-back") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv cache write policy must be one of {WRITE_POLICIES}, "
                             f"got {write_policy!r}")
        if not tiers:
            raise ValueError("a tiered KV store needs at least one tier")
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.tiers = tiers
        self.write_policy = write_policy
        self.stats = TierStats({t.name: 0 for t in tiers}, {t.name: 0 for t in tiers})

    @property
    def top(self) -> KVTier:
        return self.tiers[0]

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        device = self.kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        return (ids[:, None] * self.block_size
                + torch.arange(self.block_size, device=device)).flatten()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Payloads of fast-pool blocks: [n, num_layers, 2, Hkv, block_size, W]."""
        slots = self._slots(block_ids)
        n, bs = len(block_ids), self.block_size
        per_layer = []
        for kv in self.kv_caches:
            g = kv.index_select(2, slots)  # [2, Hkv, n * bs, W]
            per_layer.append(g.view(g.shape[0], g.shape[1], n, bs, g.shape[-1])
                             .permute(2, 0, 1, 3, 4))
        return torch.stack(per_layer, dim=1)

    def write_blocks(self, block_ids: list[int], payloads: torch.Tensor) -> None:
        """Copy payloads [n, num_layers, 2, Hkv, bs, W] into fast-pool blocks."""
        slots = self._slots(block_ids)
        payloads = payloads.to(self.kv_caches[0].device, non_blocking=True)
        n = len(block_ids)
        for layer, kv in enumerate(self.kv_caches):
            src = payloads[:, layer].permute(1, 2, 0, 3, 4)  # [2, Hkv, n, bs, W]
            kv.index_copy_(2, slots, src.reshape(kv.shape[0], kv.shape[1], n * self.block_size,
                                                 kv.shape[-1]))

    def save(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        """Copy fast-pool blocks down into the top tier (which may spill further down)."""
        if not block_ids:
            return
        payloads = self.read_blocks(block_ids)
        for key, payload in zip(keys, payloads, strict=True):
            self.top.put(key, payload)
            if self.write_policy == "write-through":
                for tier in self.tiers[1:]:
                    tier.put(key, payload)
        self.stats.saves[self.top.name] += len(block_ids)

    def execute(self, saves: list[tuple[int, BlockKey]], loads: list[tuple[int, BlockKey]]
                ) -> set[int]:
        """Carry out one step's copies (the scheduler decided them; see KVTransfers) and
        return the pool blocks whose load found no good copy. The loads are read first (a
        save may push their entries out of a full tier), a block saved in this same step
        straight from the pool block it leaves; then the saves; then the loads are written,
        since a load's target may be a block being saved."""
        leaving = {key: block_id for block_id, key in saves}
        from_pool = [(b, leaving[k]) for b, k in loads if k in leaving]
        targets, payloads, failed = [], [], set()
        if from_pool:
            targets += [b for b, _ in from_pool]
            payloads += list(self.read_blocks([src for _, src in from_pool]))
            self.stats.loads[self.top.name] += len(from_pool)
        for block_id, key in loads:
            if key in leaving:
                continue
            fetched = self.fetch(key)
            if fetched is None:
                failed.add(block_id)
            else:
                targets.append(block_id)
                payloads.append(fetched[0])
        if saves:
            self.save([b for b, _ in saves], [k for _, k in saves])
        if targets:
            self.write_blocks(targets, torch.stack(payloads))
        return failed

    def find(self, key: BlockKey) -> KVTier | None:
        for tier in self.tiers:
            if tier.contains(key):
                return tier
        return None

    def fetch(self, key: BlockKey) -> tuple[torch.Tensor, str] | None:
        """A copy of the block's payload from the highest tier that has a good one; a block
        found only on disk is also promoted into the host tier."""
        for i, tier in enumerate(self.tiers):
            if not tier.contains(key):
                continue
            payload = tier.get(key)
            if payload is None:
                continue  # corrupt: dropped by the tier; maybe a lower tier has it
            payload = payload.clone()
            if i > 0:
                self.top.put(key, payload)
            self.stats.loads[tier.name] += 1
            return payload, tier.name
        return None

    def flush(self, keyed_blocks: list[tuple[int, BlockKey]]) -> int:
        """Write everything worth keeping to the bottom tier (used at a clean shutdown):
        the given fast-pool blocks and every entry of the tiers above the bottom."""
        bottom = self.tiers[-1]
        written = 0
        if keyed_blocks:
            payloads = self.read_blocks([b for b, _ in keyed_blocks])
            for (_, key), payload in zip(keyed_blocks, payloads, strict=True):
                if not bottom.contains(key):
                    bottom.put(key, payload)
                    written += 1
        for tier in self.tiers[:-1]:
            if isinstance(tier, HostTier):
                for key, payload in tier.items():
                    if not bottom.contains(key):
                        bottom.put(key, payload)
                        written += 1
        return written


def cache_fingerprint(model_path: str | os.PathLike, model_config: object, dtype: torch.dtype,
                      kv_layout: tuple, block_size: int) -> str:
    """Names the disk cache of one model and configuration: the model's config, a sample of
    its weight files (size, first and last MiB), the compute dtype, the KV layout (shape and
    dtype per block) and the block size. Any change gives a different directory."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((model_config, str(dtype), kv_layout, block_size)).encode())
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for file in files:
        size = file.stat().st_size
        h.update(str(size).encode())
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def build_store(kv_caches: list[torch.Tensor], block_size: int, host_bytes: int,
                disk_dir: str | os.PathLike | None, disk_bytes: int, fingerprint: str,
                write_policy: str) -> TieredKVStore | None:
    """The tiers below the fast pool that the options ask for (None when neither)."""
    kv = kv_caches[0]
    block_shape = (len(kv_caches), kv.shape[0], kv.shape[1], block_size, kv.shape[3])
    block_bytes = int(np.prod(block_shape)) * kv.element_size()
    tiers: list[KVTier] = []
    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, fingerprint, block_shape, kv.dtype, disk_bytes)
    if host_bytes > 0:
        host_blocks = host_bytes // block_bytes
        if host_blocks < 1:
            raise ValueError(f"--host-kv-cache-memory {host_bytes} bytes holds no block "
                             f"({block_bytes} bytes each)")
        tiers.append(HostTier(host_blocks, block_shape, kv.dtype,
                              pin_memory=kv.device.type == "cuda", spill=disk))
        log.info("host KV tier: %d blocks (%d tokens), %.2f GiB", host_blocks,
                 host_blocks * block_size, host_blocks * block_bytes / 2**30)
    if disk is not None:
        tiers.append(disk)
        log.info("disk KV tier: %s, up to %.2f GiB (%d blocks), %s", disk.dir,
                 disk_bytes / 2**30, disk_bytes // block_bytes, write_policy)
    return TieredKVStore(kv_caches, block_size, tiers, write_policy) if tiers else None
