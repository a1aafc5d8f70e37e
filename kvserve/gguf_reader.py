"""gguf's reader over a plain array view of the file's memory map.

`gguf.GGUFReader` slices its `np.memmap` once per value while it parses the metadata, and a
memmap slice runs Python-level `__getitem__`/`__array_finalize__` hooks: for a 262k-token
vocabulary (Gemma 3) that took ~34 s of a ~45 s model load on a 2-core machine. The same
slices of an `np.ndarray` view of the same mapping skip those hooks; the fields and tensors
are the same views of the same memory (nothing is copied, tensor data stays memory-mapped).

Arrays go further: their elements' views are made when read (`_ArrayParts`), not while the
header is parsed. A start that takes its tokenizer from the start-up cache never reads the
vocabulary, and a 151,936-token vocabulary with as many merges cost 0.42 s of every start
(a real Qwen2.5 1.5B's header) as one view per part.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt


class GGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose `_get` slices a plain ndarray view of `self.data`, and whose
    arrays of scalars and strings are cut up in one loop each, not one recursive call per
    element, which parses a vocabulary's metadata several times faster. The fields come out
    the same: the same parts, as views of the same bytes, with
    the same indices and types (tests/test_gguf.py compares them with gguf's own reader)."""

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

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, Sequence[npt.NDArray[Any]], list[int], list[Any]]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        types = [gguf.GGUFValueType.ARRAY] + ([itype] if count else [])
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            flat = self._get(offs, nptype, count)
            parts = _ArrayParts([raw_itype, alen], count, lambda i: flat[i:i + 1],
                                flat.tolist)
            return 12 + flat.nbytes, parts, list(range(2, 2 + count)), types
        if itype != gguf.GGUFValueType.STRING:  # arrays of arrays: gguf's own way
            return super()._get_field_parts(orig_offs, raw_type)
        assert self._plain is not None  # set by the _get calls above
        plain, u64 = self._plain, np.dtype(np.uint64).newbyteorder(self.byte_order)
        u8 = np.dtype(np.uint8).newbyteorder(self.byte_order)
        # Where each string starts (its length's offset), found by reading the lengths alone:
        # with a memoryview, not numpy, whose per-element cost dominates a 151,936-string array.
        unpack = struct.Struct(u64.str[0] + "Q").unpack_from  # "<u8": "<Q"
        raw = memoryview(plain)
        starts = [0] * (count + 1)
        for i in range(count):
            starts[i] = offs
            offs += 8 + unpack(raw, offs)[0]
        starts[count] = offs

        def part(j: int) -> npt.NDArray[Any]:  # string j // 2's length, then its bytes
            at = starts[j // 2]
            if j % 2 == 0:
                return plain[at:at + 8].view(u64)
            return plain[at + 8:starts[j // 2 + 1]].view(u8)

        def values() -> list[str]:  # as bytes(part(2 i + 1)).decode(...) gives each
            return [str(raw[starts[i] + 8:starts[i + 1]], "utf-8", "replace")
                    for i in range(count)]

        parts = _ArrayParts([raw_itype, alen], 2 * count, part, values)
        return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types

    def _build_fields(self, offs: int, count: int) -> int:
        """gguf's own, but for an array's parts, which stay _ArrayParts (gguf's appends them
        to the key's parts, one by one)."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            size, field_parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
            parts = field_parts.after(head) if isinstance(field_parts, _ArrayParts) else \
                head + list(field_parts)
            self._push_field(gguf.ReaderField(
                orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts,  # type: ignore[arg-type]
                [i + len(head) for i in idxs], types), skip_sum=True)
            offs += size
        return offs


class _ArrayParts(Sequence):
    """A GGUF array field's parts as gguf's reader lists them (the key's, the array's type and
    length, then per element its views: a scalar's one, a string's length and bytes), each
    view made when it is read: a sequence, not a list, of the same arrays. `values()` gives
    the elements as Python values in one pass (strings decoded as UTF-8, bad bytes
    replaced), without a view per element: Gemma 3's 262k tokens, scores and types took
    ~1 s of building its tokenizer one view at a time."""

    def __init__(self, head: list[npt.NDArray[Any]], n: int,
                 make: Callable[[int], npt.NDArray[Any]],
                 values: Callable[[], list[Any]]) -> None:
        self._head, self._n, self._make, self.values = head, n, make, values

    def after(self, head: list[npt.NDArray[Any]]) -> _ArrayParts:
        return _ArrayParts(head + self._head, self._n, self._make, self.values)

    def __len__(self) -> int:
        return len(self._head) + self._n

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        h = len(self._head)
        return self._head[index] if index < h else self._make(index - h)

    def __iter__(self) -> Iterator[npt.NDArray[Any]]:
        yield from self._head
        for i in range(self._n):
            yield self._make(i)


def array_values(field: gguf.ReaderField) -> list[Any] | None:
    """The elements of an array field of this module's reader, in one pass (see
    _ArrayParts.values); None for another reader's field or a nested array."""
    parts = field.parts
    return parts.values() if isinstance(parts, _ArrayParts) else None


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """The file's reader, shared within the process while the file is unchanged: the config,
    the weights and the tokenizer of one model each read the same metadata."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return _open(resolved, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)
