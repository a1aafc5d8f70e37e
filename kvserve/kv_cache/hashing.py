"""Identity of a full KV block: a hash chained over the prefix, plus what verifies it."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# Parent of a request's first block. Hashes are stable across processes and machines (no
# Python hash randomisation), which the disk tier relies on.
ROOT_HASH = 0


@dataclass(frozen=True)
class BlockKey:
    """What identifies a full block's contents: its chained hash, checked against the parent
    hash and the block's own tokens so that a hash collision can never serve wrong K/V."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """128-bit BLAKE2b of (parent hash, token ids, extra keys such as a cache salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00extra\x00" + extra)
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 start: int = 0, parent: int = ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks of `token_ids`, from block `start` on (`parent`
    is block start-1's hash, or the root): what the prefix cache keys a request's blocks by,
    and what a router keys a prompt by, so the two agree. A cache salt enters the first
    block's hash, and through the chain every later one: tenants share no hash."""
    out = []
    for i in range(start, len(token_ids) // block_size):
        extra = (cache_salt or "").encode() if i == 0 else b""
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out
