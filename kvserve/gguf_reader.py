"""gguf's reader over a plain array view of the file's memory map.

`gguf.GGUFReader` slices its `np.memmap` once per value while it parses the metadata, and a
memmap slice runs Python-level `__getitem__`/`__array_finalize__` hooks: for a 262k-token
vocabulary (Gemma 3) that took ~34 s of a ~45 s model load on a 2-core machine. The same
slices of an `np.ndarray` view of the same mapping skip those hooks; the fields and tensors
are the same views of the same memory (nothing is copied, tensor data stays memory-mapped).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt


class GGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose `_get` slices a plain ndarray view of `self.data`."""

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        arr = self._plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                               else override_order))


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """The file's reader, shared within the process while the file is unchanged: the config,
    the weights and the tokenizer of one model each read the same metadata."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return _open(resolved, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)
