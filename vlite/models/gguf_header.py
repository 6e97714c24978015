"""A GGUF file's header, read without building the vocabulary.

``gguf.GGUFReader`` makes a numpy view of every value of every metadata array: a
262,144-token vocabulary (Gemma 3) is three arrays of that length, about 800,000 views,
6 s and 300 MiB at its peak, and vlite needs none of them (the config takes scalars and
short arrays; the tokenizer reads its own). :func:`read_header` walks the same bytes,
decodes scalars and arrays of at most ``max_array_len`` items, steps over longer ones
(a fixed-size type in one jump, strings by their lengths), and returns the tensors as
``gguf.ReaderTensor`` views of the file's map, as ``GGUFReader`` shapes them.

Layout (version 2 and 3, little-endian): magic ``GGUF``, ``u32`` version, ``u64`` tensor
count, ``u64`` key/value count; each key/value: string key, ``u32`` value type, value;
each tensor: string name, ``u32`` number of dimensions, ``u64`` per dimension (innermost
first), ``u32`` GGML type, ``u64`` offset from the data section; then padding to
``general.alignment`` (default 32) and the data section. A string is a ``u64`` length and
that many UTF-8 bytes; an array is a ``u32`` item type, a ``u64`` count and the items.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

#: GGUF value type -> struct format of one scalar of that type.
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
    gguf.GGUFValueType.BOOL: "<?",
}

#: GGML types stored as plain numbers: their numpy item type (the others are bytes).
_PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GGUFHeaderError(ValueError):
    """The bytes are not a GGUF header this reader understands (the message says where)."""


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` found.

    Attributes:
        metadata: key -> value (``str``, ``int``, ``float``, ``bool`` or a flat ``list``
            of those) for every scalar and every array of at most ``max_array_len``
            items, plus ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count``.
        skipped_arrays: key -> item count of the arrays too long to keep.
        tensors: one ``gguf.ReaderTensor`` per tensor in file order (``field`` is None);
            ``data`` is a read-only view of the map: the element type for F32/F16/...,
            ``uint8`` rows of blocks (``[..., row_bytes]``) for quantized types.
        mapping: the file's ``mmap.mmap`` (for ``madvise``).
        address: where the map's first byte is in this process's memory.
    """

    metadata: dict[str, Any]
    skipped_arrays: dict[str, int]
    tensors: tuple[gguf.ReaderTensor, ...]
    mapping: Any
    address: int


class _Cursor:
    """Reads little-endian values from ``buffer`` at a moving offset."""

    def __init__(self, buffer: Any, offset: int = 0) -> None:
        self.buffer = buffer
        self.offset = offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise GGUFHeaderError(f"a {length}-byte string at {self.offset} runs past the end")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_strings(self, count: int) -> None:
        offset, buffer = self.offset, self.buffer
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offset += 8 + unpack(buffer, offset)[0]
        if offset > len(buffer):
            raise GGUFHeaderError(f"an array of {count} strings runs past the end of the file")
        self.offset = offset

    def value(self, value_type: int, max_array_len: int) -> tuple[Any, int | None]:
        """``(value, None)``, or ``(None, count)`` for an array too long to keep."""
        kind = _value_type(value_type, self.offset)
        if kind == gguf.GGUFValueType.STRING:
            return self.string(), None
        if kind != gguf.GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[kind]), None
        item_type = _value_type(self.scalar("<I"), self.offset)
        count = self.scalar("<Q")
        if count > max_array_len:
            self.skip_array(item_type, count)
            return None, count
        items: list[Any] = []
        for _ in range(count):
            item, _ = self.value(item_type, max_array_len)
            items.extend(item if isinstance(item, list) else [item])  # flat, as GGUFReader's
        return items, None

    def skip_array(self, item_type: gguf.GGUFValueType, count: int) -> None:
        if item_type == gguf.GGUFValueType.STRING:
            self.skip_strings(count)
        elif item_type == gguf.GGUFValueType.ARRAY:
            for _ in range(count):
                self.skip_array(_value_type(self.scalar("<I"), self.offset), self.scalar("<Q"))
        else:
            self.offset += struct.calcsize(_SCALAR_FORMATS[item_type]) * count


def _value_type(raw: int, offset: int) -> gguf.GGUFValueType:
    try:
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise GGUFHeaderError(f"unknown value type {raw} before offset {offset}") from None


def read_header(path: str | Path, max_array_len: int = 1024) -> GGUFHeader:
    """Parse ``path``'s header and map its tensors (nothing is read until touched).

    Raises:
        GGUFHeaderError: not a GGUF file, an unsupported version or a big-endian file,
            a truncated header, an unknown type, or a tensor past the end of the file.
    """
    memmap = np.memmap(path, mode="c")  # copy-on-write: writable views, the file untouched
    buffer = memmap.view(np.ndarray)
    if bytes(buffer[:4]) != _MAGIC:
        raise GGUFHeaderError(f"no GGUF magic (the file starts with {bytes(buffer[:4])!r})")
    cursor = _Cursor(buffer, 4)
    try:
        return _read(cursor, buffer, getattr(memmap, "_mmap", None), max_array_len)
    except struct.error as error:
        raise GGUFHeaderError(f"the header is truncated near offset {cursor.offset}") from error


def _read(cursor: _Cursor, buffer: np.ndarray, mapping: Any, max_array_len: int) -> GGUFHeader:
    version = cursor.scalar("<I")
    if version not in _SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFHeaderError(f"version {version} is not one of {_SUPPORTED_VERSIONS}{hint}")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    skipped: dict[str, int] = {}
    for _ in range(kv_count):
        key = cursor.string()
        value, skipped_count = cursor.value(cursor.scalar("<I"), max_array_len)
        if skipped_count is not None:
            skipped[key] = skipped_count
        else:
            metadata[key] = value
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = tuple(_tensor(buffer, data_start, *info) for info in infos)
    return GGUFHeader(metadata, skipped, tensors, mapping, int(buffer.ctypes.data))


def _tensor_info(cursor: _Cursor) -> tuple[str, np.ndarray, gguf.GGMLQuantizationType, int]:
    name = cursor.string()
    dims = np.array([cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))], dtype=np.uint64)
    raw_type = cursor.scalar("<I")
    try:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise GGUFHeaderError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
    return name, dims, ggml_type, cursor.scalar("<Q")


def _tensor(
    buffer: np.ndarray,
    data_start: int,
    name: str,
    dims: np.ndarray,
    ggml_type: gguf.GGMLQuantizationType,
    relative_offset: int,
) -> gguf.ReaderTensor:
    n_elements = int(np.prod(dims, dtype=np.uint64)) if len(dims) else 1
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_bytes = n_elements * type_size // block_size
    offset = data_start + relative_offset
    if offset + n_bytes > len(buffer):
        raise GGUFHeaderError(f"tensor {name!r} ({n_bytes} bytes at {offset}) runs past the end")
    shape = tuple(int(n) for n in reversed(dims.tolist()))
    item_type = _PLAIN_TYPES.get(ggml_type)
    if item_type is None:
        try:
            shape = gguf.quant_shape_to_byte_shape(shape, ggml_type)
        except ValueError as error:
            raise GGUFHeaderError(f"tensor {name!r}: {error}") from None
        item_type = np.uint8
    data = buffer[offset : offset + n_bytes].view(item_type).reshape(shape)
    return gguf.ReaderTensor(name, ggml_type, dims, n_elements, n_bytes, offset, data, None)
