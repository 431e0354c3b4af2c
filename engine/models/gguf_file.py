"""A GGUF file's tensor index and the few metadata values the loader needs, read fast.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata field:
for the default model's tokenizer (49152 tokens, 48900 merges) that is ~500k
views, seconds per open, while loading the weights needs only the
tensor index and the architecture. This reader walks the header once with
``struct``, skips array values (strings by their lengths) but notes where each
lies, and maps the file read-only; each tensor's bytes are a slice of that map,
and an array (the tokenizer's tokens, merges, scores) is decoded only when asked
for (:meth:`GGUFIndex.array`: ~0.1 s for the default model's tokens and merges).

The format (little endian, version 2 and 3): ``GGUF``, u32 version, u64 tensor
count, u64 metadata count; each metadata entry a string key, a u32 value type and
the value (an array: u32 element type, u64 count, elements); each tensor a string
name, u32 dims, u64 dims (innermost first), u32 ggml type, u64 offset into the
data section, which starts at the next multiple of ``general.alignment`` (32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type id -> struct format of the fixed-size scalar types
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# ggml type id -> (name, weights per block, bytes per block), for the types we size
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


@dataclass(frozen=True)
class ArrayInfo:
    """Where one array metadata value lies: ``count`` elements of value type ``type_id``
    from byte ``offset`` of the file (decoded on request by :meth:`GGUFIndex.array`)."""

    type_id: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in GGUF order (innermost dimension first)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the file
    nbytes: int | None  # None for a type this reader does not size

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.type_id)
        if known is not None:
            return known[0]
        from gguf.constants import GGMLQuantizationType  # every ggml type's name

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"ggml type {self.type_id}"


class GGUFIndex:
    """The tensors and the string/number metadata of one GGUF file.

    ``metadata`` holds the scalar and string values; ``arrays`` where each array value
    lies, for :meth:`array` to decode when one is needed.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.metadata: dict[str, object] = {}
        self.arrays: dict[str, ArrayInfo] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse(self._mm.data)
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as exc:
            why = f"model: {self.path.name} is not a readable GGUF file ({exc})"
            raise ValueError(why) from exc

    def data(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes: a read-only uint8 view of the mapped file."""
        t = self.tensors[name]
        if t.nbytes is None:
            raise ValueError(f"model: {name} in {self.path.name} has {t.type_name}, not read here")
        return self._mm[t.offset : t.offset + t.nbytes]

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's resident memory (the file's
        pages stay in the page cache), after a copy of it was made: the whole pages
        inside its bytes; a later read maps them in again."""
        t = self.tensors[name]
        raw = getattr(self._mm, "_mmap", None)
        if t.nbytes is None or raw is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        first = (t.offset + page - 1) // page * page
        last = (t.offset + t.nbytes) // page * page
        if last > first:
            raw.madvise(mmap.MADV_DONTNEED, first, last - first)

    def array(self, key: str) -> list[Any]:
        """Array metadata value ``key``, decoded now: a list of str, int, float or bool
        (a list of lists for an array of arrays). Raises KeyError if there is none."""
        info = self.arrays[key]
        try:
            if info.type_id in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[info.type_id])
                values = np.frombuffer(self._mm, dtype, info.count, info.offset)
                return list(values.tolist())
            buf = self._mm.data
            out, pos = [], info.offset
            for _ in range(info.count):
                value, pos = _value(buf, pos, info.type_id, decode=True)
                out.append(value)
            return out
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, IndexError) as exc:
            raise ValueError(f"model: {key} in {self.path.name} is not readable ({exc})") from exc

    def _parse(self, buf: memoryview) -> None:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"model: {self.path.name} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"model: {self.path.name} is GGUF version {version} (2 or 3 read)")
        pos = 24
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            if vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, pos + 4)
                self.arrays[key] = ArrayInfo(etype, count, pos + 16)
            value, pos = _value(buf, pos + 4, vtype)
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, tuple(int(d) for d in dims), type_id, offset))
        align = int(self.metadata.get("general.alignment", 32))  # type: ignore[call-overload]
        start = (pos + align - 1) // align * align
        for name, dims, type_id, offset in infos:
            known = GGML_TYPES.get(type_id)
            nbytes = None
            if known is not None:
                count = int(np.prod(dims, dtype=np.int64)) if dims else 1
                nbytes = count // known[1] * known[2]
                if start + offset + nbytes > len(self._mm):
                    raise ValueError(f"model: {self.path.name} is truncated ({name})")
            self.tensors[name] = TensorInfo(name, dims, type_id, start + offset, nbytes)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode(), pos + 8 + n


def _value(buf: memoryview, pos: int, vtype: int, decode: bool = False) -> tuple[object, int]:
    """A metadata value at ``pos`` and the position after it; an array is skipped (None)
    unless ``decode``."""
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if decode:
            out = []
            for _ in range(count):
                value, pos = _value(buf, pos, etype, decode=True)
                out.append(value)
            return out, pos
        if etype in _SCALARS:
            return None, pos + count * struct.calcsize("<" + _SCALARS[etype])
        if etype == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            return None, pos
        for _ in range(count):  # arrays of arrays
            _, pos = _value(buf, pos, etype)
        return None, pos
    raise ValueError(f"unknown GGUF value type {vtype}")
