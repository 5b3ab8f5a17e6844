"""Safetensors, read from a package's verified bytes: a strict header check, then tensors that are
views of those bytes (no second read of the file, no copy).

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the data. ``safetensors`` itself reads files by path, which would
read them again after verification; this reader parses the same bytes the hash was taken over, and
checks every header field (types, dtypes, that the byte ranges tile the data exactly) before a view
is made, so a corrupt header is one ``PackageError`` naming the file and the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdkiln.errors import PackageError
from sdkiln.runtime.package import parse_json

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_DIMS = 8
MAX_DIM = 1 << 40


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(data: bytearray, where: str) -> tuple[int, dict[str, TensorInfo]]:
    """The data's start and each tensor's ``TensorInfo``; ``PackageError`` for anything malformed."""
    if len(data) < 8:
        raise PackageError(f"{where}: {len(data)} bytes, too short for a safetensors file")
    size = int.from_bytes(data[:8], "little")
    if size > MAX_HEADER_BYTES or 8 + size > len(data):
        raise PackageError(f"{where}: safetensors header of {size} bytes does not fit the file")
    header = parse_json(data[8 : 8 + size], f"{where} (safetensors header)")
    if not isinstance(header, dict):
        raise PackageError(f"{where}: safetensors header is not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PackageError(f"{where}: safetensors __metadata__ must map strings to strings")
    infos = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise PackageError(f"{where}: tensor {name!r}: header entry must have dtype, shape, data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise PackageError(f"{where}: tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape)
        ):
            raise PackageError(f"{where}: tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise PackageError(f"{where}: tensor {name!r}: data_offsets {offsets!r} is not [start, end]")
        info = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
        if info.end - info.start != info.numel * DTYPES[dtype].itemsize:
            raise PackageError(
                f"{where}: tensor {name!r}: {info.end - info.start} bytes for shape {shape} of {dtype}"
            )
        infos[name] = info
    position = 0
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != position:
            raise PackageError(f"{where}: tensor {name!r}: byte ranges overlap or leave a gap")
        position = info.end
    if 8 + size + position != len(data):
        raise PackageError(f"{where}: the tensors' byte ranges do not cover the data exactly")
    return 8 + size, infos


def load_tensors(data: bytearray, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file held in ``data``, as views of it (copied only where a
    tensor's offset is not aligned to its element size)."""
    base, infos = read_header(data, where)
    buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    tensors = {}
    for name, info in infos.items():
        dtype = DTYPES[info.dtype]
        raw = buf[base + info.start : base + info.end]
        if (base + info.start) % dtype.itemsize:
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(info.shape)
    return tensors


def header_numel(data: bytearray, where: str) -> int:
    return sum(info.numel for info in read_header(data, where)[1].values())
