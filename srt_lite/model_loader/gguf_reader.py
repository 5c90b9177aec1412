"""A GGUF file, memory-mapped: its metadata and its tensors' bytes, read where they lie.

gguf's own GGUFReader builds a Python object for every element of every metadata array (a
tokenizer's vocabulary is one), which costs seconds on a large vocabulary; this reader parses
numeric arrays with numpy, leaves arrays of strings undecoded until they are read, and maps
the tensor data without reading it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from srt_lite.model_loader.gguf_types import GGUFType, UnsupportedTensorType, lookup

_MAGIC = b"GGUF"
# Metadata value types (GGUF's): scalar ones as struct formats and numpy dtypes.
_STRING, _ARRAY = 8, 9
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}


_U64 = struct.Struct("<Q")


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
    """The GGUF string at `pos` (a uint64 byte count, then UTF-8) and the position after it."""
    (n,) = _U64.unpack_from(buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


class GGUFError(ValueError):
    """A file that is not a GGUF file this reader can parse; the message names the problem."""


@dataclass
class GGUFTensor:
    name: str
    type: GGUFType
    shape: tuple[int, ...]  # torch order: [rows, cols] for a matrix (GGUF lists cols first)
    offset: int  # from the start of the file

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.rows * self.type.row_bytes(self.cols)


class StringArray(Sequence):
    """A metadata array of strings, decoded when first read. A vocabulary and its merges are
    such arrays (hundreds of thousands of strings, about a third of a second to decode), and
    a load reads neither: the tokenizer is built from the file once, when it is prepared."""

    def __init__(self, buf: memoryview, start: int, count: int):
        self._buf, self._start, self._count = buf, start, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"

    def __getitem__(self, i):
        return self._decoded()[i]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def _decoded(self) -> list[str]:
        if self._items is None:
            items, pos = [], self._start
            for _ in range(self._count):
                item, pos = _read_string(self._buf, pos)
                items.append(item)
            self._items = items
        return self._items


class GGUFFile:
    """Parses the header of `path`; `raw(name)` maps a tensor's bytes."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, OverflowError, UnicodeDecodeError) as e:
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({e})") from e

    # ---- header ---------------------------------------------------------------------------

    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        s, self._pos = _read_string(self._buf, self._pos)
        return s

    def _strings(self, count: int) -> StringArray:
        """Steps over `count` strings, keeping where they lie."""
        start, pos, unpack = self._pos, self._pos, _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack(self._buf, pos)[0]
        if pos > len(self._buf):
            raise IndexError("a string array runs past the end of the file")
        self._pos = pos
        return StringArray(self._buf, start, count)

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._read("<I"), self._read("<Q")
            if etype == _STRING:
                return self._strings(count)
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self._read(_SCALARS[vtype][0])

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        self._header_end = self._pos
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            try:
                t = GGUFTensor(name, lookup(type_id, name), tuple(int(d) for d in reversed(dims)), data_start + offset)
            except UnsupportedTensorType as e:
                raise GGUFError(f"{self.path}: {e}") from None
            if t.cols % t.type.unit:
                raise GGUFError(f"{self.path}: tensor {name} has {t.cols} columns, not whole {t.type.name} blocks")
            if t.offset + t.nbytes > len(self._map):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = t

    # ---- access ---------------------------------------------------------------------------

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def header_bytes(self) -> bytes:
        """The file's header: version, metadata and tensor list (no tensor data)."""
        return bytes(self._buf[: self._header_end])

    def drop_resident_pages(self) -> None:
        """Drops the pages read so far from this process's memory (the page cache keeps them;
        a later read maps them again): once a load has repacked the blocks it reads, those
        copies are the resident weights, and counting the file's pages beside them would
        double the process's memory."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def raw(self, name: str) -> torch.Tensor:
        """A tensor's bytes as uint8 [rows, row_bytes], a read-only view of the mapped file
        (a writer must copy it first)."""
        t = self.tensors[name]
        arr = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        import warnings

        with warnings.catch_warnings():  # torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr).view(t.rows, t.type.row_bytes(t.cols))
