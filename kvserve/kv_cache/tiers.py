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
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvserve.kv_cache.hashing import BlockKey
from kvserve.kv_cache.tier_media import DiskTier, HostTier, KVTier

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write-back", "write-through")


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
