"""Streaming a model's tensors to safetensors shards: tensor by tensor from wherever the model is
(CPU or an accelerator), each one copied to the host, written and hashed, then dropped, so writing
a 12-billion-parameter transformer holds one tensor on the host, never the model.

The layout is diffusers' (``diffusion_pytorch_model.safetensors``, or above ``max_shard_bytes``
``diffusion_pytorch_model-00001-of-0000N.safetensors`` plus ``diffusion_pytorch_model.safetensors.index.json``
mapping each tensor to its shard), so ``diffusers`` and ``safetensors`` read the files too. Float
tensors of the model's own (diffusers) modules are written in the deployment dtype; the quantized
layers' tensors keep the dtypes their scheme declares, and modules diffusers keeps in float32
(``_keep_in_fp32_modules``) stay float32.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from sdkiln.runtime.safetensors_data import DTYPES

MAX_SHARD_BYTES = 5 << 30
"""Bytes of tensor data per shard, at most (diffusers' and transformers' default is 5-10 GB)."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 8  # the safetensors library pads its header to a multiple of 8 bytes


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]
    """The tensor, produced when it is written (a device tensor, cast and copied then)."""

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def plan_shards(tensors: Iterable[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors packed into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(shard: list[Planned]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        header[t.name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    return len(text).to_bytes(8, "little") + text


def _write_shard(path: Path, shard: list[Planned]) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as fh:
        head = _header(shard)
        fh.write(head)
        digest.update(head)
        size += len(head)
        for t in shard:
            value = t.get().detach().to("cpu", t.dtype).contiguous()
            if tuple(value.shape) != t.shape:
                raise RuntimeError(
                    f"{t.name}: shape {tuple(value.shape)} changed from {t.shape} while written"
                )
            data = memoryview(value.reshape(-1).view(torch.uint8).numpy()) if value.numel() else b""
            fh.write(data)
            digest.update(data)
            size += len(data)
            del value, data
    return digest.hexdigest(), size


def write_shards(
    directory: Path, stem: str, tensors: Iterable[Planned], max_bytes: int = MAX_SHARD_BYTES
) -> dict[str, tuple[str, int]]:
    """Write ``tensors`` as ``stem.safetensors`` or as shards with an index in ``directory``;
    returns each written file's name -> (sha256, size), hashed as it was written."""
    shards = plan_shards(tensors, max_bytes)
    written = {}
    if len(shards) == 1:
        name = f"{stem}.safetensors"
        written[name] = _write_shard(directory / name, shards[0])
        return written
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        written[name] = _write_shard(directory / name, shard)
        weight_map.update((t.name, name) for t in shard)
    index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)}, "weight_map": weight_map}
    (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written
