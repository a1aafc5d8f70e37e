"""KV groups (kv_cache.layout): which layers share a block table, and what a request holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.kv_cache.layout import KVLayout


def cfg(windows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(num_layers=len(windows), window=lambda i: windows[i])


def test_gemma3_pattern_makes_six_groups_of_three():
    windows = ([512] * 5 + [0]) * 3  # Gemma 3 270M: every 6th layer global
    layout = KVLayout.for_model(cfg(windows))
    assert layout.group_windows == (0, 512, 512, 512, 512, 512)
    assert layout.group_size == 3
    assert [layout.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [layout.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    # every (group, slot) pair is one layer's
    assert len(set(zip(layout.layer_group, layout.layer_slot, strict=True))) == 18
    assert layout.describe() == ("6 block tables of 3 layers each: 1 whole-context, "
                                 "5 with a 512-token window")


@pytest.mark.parametrize("windows,groups,size", [
    ([0, 0, 0], (0,), 3),  # no window: one table
    ([8, 8], (8,), 2),  # Mistral: one table, its blocks freed behind the window
    ([8, 8, 8, 0, 0], (0, 0, 8, 8, 8), 1),  # 3 and 2 layers: groups of one
    ([8, 0, 8, 0], (0, 8), 2),
    ([8, 16, 0, 8, 16, 0], (0, 8, 16), 2),  # two windows
])
def test_groups(windows, groups, size):
    layout = KVLayout.for_model(cfg(windows))
    assert (layout.group_windows, layout.group_size) == (groups, size)
    for i, w in enumerate(windows):
        assert layout.group_windows[layout.layer_group[i]] == w


def test_hybrid_off_keeps_one_table_without_windows():
    layout = KVLayout.for_model(cfg([8, 0, 8, 0]), free_windows=False)
    assert layout == KVLayout.single(4)
    assert layout.group_windows == (0,) and layout.group_size == 4


def test_blocks_for_counts_windows_and_the_step():
    layout = KVLayout.for_model(cfg([0, 64, 64, 64]))  # 1 global, 3 local: groups of 1
    # 1000 tokens, blocks of 16, steps of 32: 63 blocks globally; a local layer keeps
    # 63 + 32 tokens of keys (at most 7 blocks across their ends)
    assert layout.blocks_for(1000, 16, 32) == 63 + 3 * 7
    assert layout.blocks_for(40, 16, 32) == 4 * 3  # shorter than the window: all of it
