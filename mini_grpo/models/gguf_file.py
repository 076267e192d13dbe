"""A GGUF file's header, read by our own bounded parser: every count, length and offset is
checked against limits, one memory budget and the file's size before anything is allocated,
and overlapping tensors are refused, so a hostile file is one line (CheckpointError, exit 2),
never gigabytes (the `gguf` package's reader builds an object per array element). The tensor
bytes are not read here: gguf.py dequantizes them from the offsets this returns."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import CheckpointError

MAGIC = b"GGUF"
MAX_TENSORS = 1 << 16  # a 70B model has ~700
MAX_KV = 1 << 12  # metadata keys: a few dozen in practice
MAX_ARRAY = 1 << 22  # the largest vocabularies (token lists, merges) are ~260k
MAX_STRING = 4 << 20  # a chat template is a few kB; tokens and keys far less
# the memory all keys, strings and arrays take once read, charged before each is allocated: a
# string 64 bytes + its text, an array's number 40 (one byte in the file for u8); ~40 MB at most
MAX_HEADER_MEMORY = 64 << 20
MAX_DIMS = 4
# tensor types no weight of a model comes in: integers (llama.cpp's indices and masks) and
# F64, which the gguf package cannot dequantize; refused by name before any byte is read
NOT_WEIGHTS = ("I8", "I16", "I32", "I64", "F64")

# GGUFValueType: scalars as struct formats (little-endian), 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
       10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    qtype: int  # GGMLQuantizationType
    offset: int  # bytes from the file's start
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    meta: dict
    tensors: dict[str, TensorInfo]


class _Cursor:
    """Reads little-endian values from a buffer, every read checked against its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.left = MAX_HEADER_MEMORY

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: not a valid GGUF file ({what}, at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"{n} bytes asked past the end of the file")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def spend(self, n: int, what: str) -> None:
        self.left -= n
        if self.left < 0:
            self.fail(f"{what}: the keys, strings and arrays take over "
                      f"{MAX_HEADER_MEMORY >> 20} MiB of memory in all")

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q")
        if n > MAX_STRING:
            self.fail(f"{what}: a string of {n} bytes")
        self.spend(64 + n, what)
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what}: a string that is not UTF-8")

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == STRING:
            return self.string(key)
        if kind != ARRAY:
            self.fail(f"{key}: unknown value type {kind}")
        item, n = self.scalar("<I"), self.scalar("<Q")
        if n > MAX_ARRAY:
            self.fail(f"{key}: an array of {n} items (at most {MAX_ARRAY})")
        if item in _NP:  # numbers: one read, bounded by the file
            size = np.dtype(_NP[item]).itemsize
            self.spend(40 * n, key)
            values = np.frombuffer(self.take(n * size), dtype=_NP[item])
            return values.astype(bool).tolist() if item == 7 else values.tolist()
        if item != STRING:  # llama.cpp writes no nested arrays
            self.fail(f"{key}: an array of value type {item}")
        if n * 8 > len(self.buf) - self.pos:
            self.fail(f"{key}: {n} strings cannot fit in the file")
        return [self.string(key) for _ in range(n)]


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor directory of a GGUF file (versions 2 and 3, little-endian);
    CheckpointError naming the file and what is wrong. Tensor bytes are not read."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") \
            from None
    c = _Cursor(buf, path)
    if len(buf) < 24 or c.take(4) != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
    version = c.scalar("<I")
    if version & 0xFFFF == 0:
        raise CheckpointError(f"{path}: a big-endian GGUF file is not supported")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2, 3)")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        c.fail(f"{n_tensors} tensors and {n_kv} metadata keys (at most {MAX_TENSORS} and "
               f"{MAX_KV})")
    meta = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        if key in meta:
            c.fail(f"metadata key {key[:80]!r} twice")
        meta[key] = c.value(c.scalar("<I"), key[:80])
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(f"tensor {name[:80]}: {n_dims} dimensions")
        dims = [c.scalar("<Q") for _ in range(n_dims)]
        qtype, offset = c.scalar("<I"), c.scalar("<Q")
        infos.append((name, dims, qtype, offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1 or align & (align - 1) or align > 1 << 16:
        c.fail(f"general.alignment {align!r} is not a power of two")
    start = -(-c.pos // align) * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        try:
            kind = GGMLQuantizationType(qtype)
            block, size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            c.fail(f"tensor {name[:80]}: unknown type {qtype}")
        if kind.name in NOT_WEIGHTS:
            raise CheckpointError(f"{path}: tensor {name[:80]} is of type {kind.name}, not a "
                                  f"weight type (floating point or quantized)")
        if name in tensors:
            c.fail(f"tensor {name[:80]} twice")
        if any(d < 1 for d in dims) or dims[0] % block:
            c.fail(f"tensor {name[:80]}: shape {dims} does not fit type {kind.name}")
        nbytes = math.prod(dims) // block * size
        if offset % align or start + offset + nbytes > len(buf):
            c.fail(f"tensor {name[:80]}: its {nbytes} bytes at offset {offset} are not in "
                   f"the file")
        tensors[name] = TensorInfo(tuple(reversed(dims)), qtype, start + offset, nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, name) for name, t in tensors.items())
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if end > begin:
            c.fail(f"tensors {a[:80]} and {b[:80]} overlap")
    buf.close()
    return GGUFFile(path, meta, tensors)
