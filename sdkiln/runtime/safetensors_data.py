"""Safetensors, read from a package file once: a strict header check, then each tensor's bytes read
straight into storage of its own, hashed on the way (``runtime.package.VerifiedStream``).

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the data. ``safetensors`` itself reads files by path (or maps
them), which would read them again after verification or keep the file mapped behind every tensor;
this reader parses the bytes the hash is taken over and checks every header field (types, dtypes,
that the byte ranges tile the data exactly) before anything is allocated, so a corrupt header is one
``PackageError`` naming the file and the tensor. Each tensor is allocated by torch's allocator
(aligned to 64 bytes on the CPU) and filled from the file: no copy, no view of a whole file, and at
most the file's size in memory, handed out only after the file's sha256 matched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdkiln.errors import PackageError
from sdkiln.runtime.package import VerifiedStream, parse_json, read_head

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


def parse_header(head: bytes, file_size: int, where: str) -> tuple[int, dict[str, TensorInfo]]:
    """The data's start and each tensor's ``TensorInfo`` from ``head`` (the 8-byte length and the
    JSON header) of a file of ``file_size`` bytes; ``PackageError`` for anything malformed."""
    size = int.from_bytes(head[:8], "little")
    if size > MAX_HEADER_BYTES or 8 + size > file_size or len(head) != 8 + size:
        raise PackageError(f"{where}: safetensors header of {size} bytes does not fit the file")
    header = parse_json(head[8:], f"{where} (safetensors header)")
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
    if 8 + size + position != file_size:
        raise PackageError(f"{where}: the tensors' byte ranges do not cover the data exactly")
    return 8 + size, infos


def read_tensors(
    stream: VerifiedStream, where: str, expected_head: bytes | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``stream`` reads, each in storage of its own, returned
    once the whole file matched its sha256. ``expected_head``, a header read ahead of the file
    (``Package.header``), must be the one the file holds."""
    head = read_head(stream)
    try:
        base, infos = parse_header(head, stream.size, where)
    except PackageError as exc:
        raise stream.refuse(exc) from None
    if expected_head is not None and head != expected_head:
        raise PackageError(f"{where}: changed while it was read (being rewritten?)")
    tensors = {}
    for name, info in sorted(infos.items(), key=lambda kv: kv[1].start):
        raw = torch.empty(info.end - info.start, dtype=torch.uint8)
        if raw.numel():
            stream.readinto(raw.numpy())
        tensors[name] = raw.view(DTYPES[info.dtype]).reshape(info.shape)
    stream.finish()
    return tensors


def header_infos(head: bytes, file_size: int, where: str) -> dict[str, TensorInfo]:
    return parse_header(head, file_size, where)[1]
