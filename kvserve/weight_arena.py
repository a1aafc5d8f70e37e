"""Memory for the weights a decode step reads from end to end: the parts interleaved at load
(`GGUFWeight`, paths.INTERLEAVED_TYPES 8 rows at a time), carved one after the other out of
anonymous arenas mapped at a 2 MiB boundary and advised MADV_HUGEPAGE. With 4 KiB pages a stream
crosses a page (a TLB walk, and the end of what the hardware prefetcher follows) every
4 KiB, and a part of its own smaller than 2 MiB (a 1.5B model's q/k/v and o) could never be
on a huge page: on a Zen 3 (2 threads) a plain sum read 21.8 GB/s from 4 KiB pages and
26.0 GB/s from huge ones. An arena is unmapped when the last tensor carved from it is freed.
Off Linux, torch's allocator.

Faulting those pages in is most of what interleaving costs at load: on the Zen 4 virtual
machine of benchmarks/RESULTS.md, 1 GiB of fresh huge pages took 0.2-3 s to fault in (the
host backs them as they are touched), against 0.04 s to fill once resident. `reserve`,
called by the CLI before it imports torch, starts a thread that asks the kernel to read the
model file ahead, maps the bytes the load will interleave, and faults them in
(MADV_POPULATE_WRITE: the pages are made resident and writable, their bytes never written,
so tensors the load already took are safe), while the import runs on the other core. The
load then takes its tensors from that reservation, and `settle`, once the load is done,
hands back what it did not take. This module imports torch only when a tensor is taken.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20  # a huge page, and the arenas' alignment
ARENA = 64 << 20  # an arena's size, unless one tensor needs more
POPULATE_CHUNK = 2 << 20  # per call: the import waits on the mm lock for at most this much
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module does not name it
LINUX = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


class _Arena:
    """`size` bytes of anonymous memory from a 2 MiB boundary, handed out front to back. It
    holds its map weakly: the tensors carved from it hold it (torch.frombuffer), so it is
    unmapped after the last of them, and `keep` holds it until then where the arena must
    outlive its tensors (a reservation before the load has taken any)."""

    def __init__(self, size: int) -> None:
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(m)  # only for the address
        base = ctypes.addressof(anchor)
        del anchor
        self.offset = -base % HUGE  # where the aligned bytes start in the map
        self.address = base + self.offset
        self.size = size
        self.used = 0
        self.keep: mmap.mmap | None = m
        self._map = weakref.ref(m)
        with contextlib.suppress(OSError):  # advice: a kernel without THP says no
            m.madvise(mmap.MADV_HUGEPAGE, self.offset, size)

    def tensor(self, rows: int, cols: int) -> torch.Tensor | None:
        """uint8 [rows, cols] of the bytes next free, at a cache line; None if they do not
        fit or the arena is gone (unmapped with its last tensor)."""
        import torch

        m = self._map()
        start = -(-self.used // 64) * 64
        if m is None or start + rows * cols > self.size:
            return None
        self.used = start + rows * cols
        t = torch.frombuffer(m, dtype=torch.uint8, count=rows * cols, offset=self.offset + start)
        return t.view(rows, cols)

    def release_unused(self) -> None:
        """Hand the kernel back the whole pages past what was taken."""
        m = self._map()
        start = -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE
        if m is not None and start < self.size:
            m.madvise(mmap.MADV_DONTNEED, self.offset + start, self.size - start)


class _Prefault(threading.Thread):
    """Reads the model file ahead, sizes the reservation (`estimate`), maps it as the arena
    later tensors are carved from, and faults its pages in front to back, a chunk a call
    (ctypes lets go of the GIL during each). Stops at the end, when asked, or at the first
    refusal (a kernel before 5.14)."""

    def __init__(self, estimate: Callable[[], int], model_file: str | None) -> None:
        super().__init__(name="kvserve-prefault", daemon=True)
        self.estimate = estimate
        self.model_file = model_file
        self.stop = threading.Event()
        self.arena: _Arena | None = None
        self.done = 0

    def run(self) -> None:
        global _current
        if self.model_file is not None and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # read the weights into the page cache
                fd = os.open(self.model_file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
        try:
            nbytes = self.estimate()
        except Exception as e:  # the load will say what is wrong with the file
            log.debug("weight arena: no reservation (%s)", e)
            return
        if nbytes <= 0 or self.stop.is_set():
            return
        with _lock:
            if self.stop.is_set():
                return
            self.arena = _current = _Arena(-(-nbytes // HUGE) * HUGE)
        arena = self.arena
        libc = ctypes.CDLL(None, use_errno=True)
        while self.done < arena.size and not self.stop.is_set():
            n = min(POPULATE_CHUNK, arena.size - self.done)
            if libc.madvise(ctypes.c_void_p(arena.address + self.done), ctypes.c_size_t(n),
                            MADV_POPULATE_WRITE) != 0:
                log.debug("weight arena: no MADV_POPULATE_WRITE here (errno %d)",
                          ctypes.get_errno())
                return
            self.done += n


_lock = threading.Lock()
_current: _Arena | None = None  # the arena tensors are carved from now
_prefault: _Prefault | None = None  # the reservation's thread, until settle()


def reserve(estimate: Callable[[], int], model_file: str | None = None) -> None:
    """Start a thread that reads `model_file` ahead, maps `estimate()` bytes for the tensors
    the next load will take, and faults them in. Only where it helps: Linux with huge pages;
    else nothing."""
    global _prefault
    if not LINUX:
        return
    settle()  # a reservation of an earlier load that never settled
    with _lock:
        _prefault = _Prefault(estimate, model_file)
        _prefault.start()


def take(rows: int, cols: int) -> torch.Tensor:
    """An uninitialized uint8 [rows, cols] tensor in an arena (the reservation first)."""
    global _current
    nbytes = rows * cols
    if not LINUX or nbytes == 0:
        import torch

        return torch.empty((rows, cols), dtype=torch.uint8)
    with _lock:
        t = _current.tensor(rows, cols) if _current is not None else None
        if t is None:
            _current = _Arena(max(ARENA, -(-nbytes // HUGE) * HUGE))
            t = _current.tensor(rows, cols)
            _current.keep = None  # held by its tensors from now on
            assert t is not None
        return t


def settle() -> int:
    """After a load: stop faulting the reservation in and hand back what the load did not
    take. Returns the bytes handed back (0 without a reservation)."""
    global _current, _prefault
    with _lock:
        prefault, _prefault = _prefault, None
        if prefault is None:
            return 0
        prefault.stop.set()
    prefault.join()  # outside the lock: the thread takes it to publish its arena
    arena = prefault.arena
    if arena is None:
        return 0
    with _lock:
        arena.release_unused()
        arena.keep = None  # held by the load's tensors from now on
        if _current is arena:  # what is left of it is handed back: later tensors go elsewhere
            _current = None
    unused = arena.size - arena.used
    log.debug("weight arena: %d MiB reserved, %d MiB faulted in ahead, %d MiB unused",
              arena.size >> 20, prefault.done >> 20, unused >> 20)
    return unused
