"""A GGUF file's tensors, found without reading its metadata's values.

The `gguf` package's reader turns every metadata value into numpy objects, one per element: a
tokenizer of 151,936 tokens and as many merges took 8-10 s of a 1.5B's load. Serving needs only
where each tensor lies, so the metadata is stepped over (a string array's elements are walked
by their lengths, no more) and the tensors' data is a read-only memory map of the file."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Metadata value types by their number in the format, with the bytes of a fixed-size one.
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_UINT32 = 4


@dataclass(frozen=True)
class GgufTensor:
    name: str
    kind: str  # the block format's name: Q4_K, Q8_0, F32, ...
    shape: tuple[int, ...]  # rows first, as torch orders a weight matrix
    data: np.ndarray  # uint8 [rows, bytes a row] (a read-only map of the file)


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path):
        self.buffer, self.path, self.at = buffer, path, 0

    def take(self, layout: str):
        values = struct.unpack_from(layout, self.buffer, self.at)
        self.at += struct.calcsize(layout)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("<Q")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8")
        self.at += length
        return text

    def skip_value(self, kind: int):
        """Steps over a value of type `kind`; returns it where it is a uint32 (the alignment's type)."""
        if kind in _FIXED_SIZES:
            value = struct.unpack_from("<I", self.buffer, self.at)[0] if kind == _UINT32 else None
            self.at += _FIXED_SIZES[kind]
            return value
        if kind == _STRING:
            self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]
        elif kind == _ARRAY:
            element, count = self.take("<IQ")
            if element in _FIXED_SIZES:
                self.at += count * _FIXED_SIZES[element]
            else:
                for _ in range(count):
                    self.skip_value(element)
        else:
            raise ValueError(f"{self.path.name}: metadata value of unknown type {kind} at byte {self.at}: not a GGUF file we can read")
        return None


def gguf_tensors(path: str | Path) -> dict[str, GgufTensor]:
    """Each tensor of the GGUF file at `path`, by name, in the order the file lists them."""
    path = Path(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    magic, version = cursor.take("<4sI")
    if magic != _MAGIC or version not in (2, 3):
        raise ValueError(f"{path.name} is not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
    num_tensors, num_fields = cursor.take("<QQ")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key = cursor.string()
        value = cursor.skip_value(cursor.take("<I"))
        if key == "general.alignment":
            alignment = value
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = cursor.take(f"<{cursor.take('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        kind, offset = cursor.take("<IQ")
        infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(kind), offset))
    start = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in infos:
        per_block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = shape[-1] // per_block * block_bytes
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        at = start + offset
        data = mapped[at : at + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GgufTensor(name, kind.name, shape, data)
    return tensors
