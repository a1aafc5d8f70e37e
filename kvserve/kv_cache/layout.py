"""Which layers share a block table: KV cache groups for models with sliding-window layers.

A model whose layers all attend the same way (the whole context, or one window) has one
group: a block holds one token slot range for every layer, and a request's block table
covers all of them. A model that mixes global and sliding-window layers (Gemma 3: five
local layers of a 512-token window to one global) would waste most of its cache that way,
since the local layers never read a key older than their window. Its layers are split into
groups of equal size, each group of one kind (the whole context, or one window), and each
group gets its own block table: the blocks of a sliding-window group that fall entirely
before its window are handed back while the request runs, so a long request's KV grows with
the global layers only (the hybrid allocator of vLLM's v1 KV cache manager works this way).

All groups draw on one pool: a block is one page of `group_size` layers' K/V, and layer
`l` stores its K/V in cache tensor `layer_slot[l]` at the slots of group `layer_group[l]`'s
table. With one group, `group_size` is the number of layers and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvserve.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    group_windows: tuple[int, ...]  # per group, its layers' window (0: the whole context)
    layer_group: tuple[int, ...]  # per layer, its group
    layer_slot: tuple[int, ...]  # per layer, its cache tensor (position within its group)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def group_size(self) -> int:
        """Layers per group, i.e. cache tensors allocated."""
        return len(self.layer_group) // self.num_groups

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @staticmethod
    def single(num_layers: int) -> KVLayout:
        """Every layer in one group: one block table, blocks never freed early."""
        return KVLayout((0,), (0,) * num_layers, tuple(range(num_layers)))

    @staticmethod
    def for_model(cfg: ModelConfig, free_windows: bool = True) -> KVLayout:
        """The groups of `cfg`'s layers. Without `free_windows` (or with one kind of layer
        only and no window) every layer shares one table, as before.

        Groups of whole-context layers come first, so that group 0's table always covers
        every token of a request when the model has any such layer."""
        windows = [cfg.window(i) for i in range(cfg.num_layers)]
        kinds = sorted(set(windows))  # 0 (the whole context) first
        if not free_windows or kinds == [0]:
            return KVLayout.single(cfg.num_layers)
        size = 0
        for w in kinds:
            size = gcd(size, windows.count(w))
        group_windows: list[int] = []
        layer_group = [0] * cfg.num_layers
        layer_slot = [0] * cfg.num_layers
        for w in kinds:
            layers = [i for i, x in enumerate(windows) if x == w]
            for j in range(0, len(layers), size):
                for slot, layer in enumerate(layers[j:j + size]):
                    layer_group[layer] = len(group_windows)
                    layer_slot[layer] = slot
                group_windows.append(w)
        return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot))

    def describe(self) -> str:
        """e.g. '6 groups of 3 layers: 1 whole-context, 5 with a 512-token window'."""
        if not self.hybrid:
            w = self.group_windows[0]
            return "one block table" + (f" (sliding window {w} tokens)" if w else "")
        full = self.group_windows.count(0)
        parts = [f"{full} whole-context"] if full else []
        for w in sorted(set(self.group_windows) - {0}):
            parts.append(f"{self.group_windows.count(w)} with a {w}-token window")
        return (f"{self.num_groups} block tables of {self.group_size} layers each: "
                + ", ".join(parts))

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once, computed in steps of
        at most `chunk` tokens: a sliding-window group keeps its window plus the step's
        tokens (and partial blocks at both ends)."""
        whole = -(-num_tokens // block_size)
        total = 0
        for w in self.group_windows:
            total += min(whole, -(-(w - 1 + chunk) // block_size) + 1) if w else whole
        return total
