"""A block-sparse attention plan as data: what the ``sparse_attention`` package section holds.

``attention/sparse_attention.json`` says, for one transformer, how block-sparse attention runs:
the block size, the tile that orders image tokens into local blocks, whether a video's first frame
stays dense, how blocks are selected (``topk``: a sparsity ``s`` keeps ``ceil((1 - s) * n)`` of the
``n`` key blocks per query block; ``mass``: the fewest key blocks whose pooled attention mass reaches
a threshold), the value per attention layer and head group, how many initial denoising steps stay
dense, and over how many denoising steps a block selection is reused. Attention layers the plan does
not list run dense. Written by ``sdkiln.sparsify``, read by ``runtime/sparse/restore.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sdkiln.errors import PackageError

PLAN_FILE = "attention/sparse_attention.json"
SELECTIONS = ("topk", "mass")


@dataclass
class SparseAttentionPlan:
    block_size: int
    tile: tuple[int, int, int]
    """Frames, rows and columns of one tile; image tokens are ordered tile by tile."""
    layers: dict[str, list[float]]
    """Attention module name -> one value per head group: the sparsity (``topk``) or the mass (``mass``)."""
    selection: str = "topk"
    first_frame_dense: bool = True
    """A video's first frame attends and is attended densely (a single-frame image has no such frame)."""
    dense_steps: int = 0
    """The first ``dense_steps`` denoising steps run dense attention."""
    mask_reuse: int = 1
    """A block selection is made every ``mask_reuse`` denoising steps and reused in between."""
    config_hash: str = ""
    """The transformer config the plan was calibrated for (``model_zoo.fingerprint.config_hash``)."""
    record: dict[str, Any] = field(default_factory=dict)
    """What calibration measured (per-layer errors, the dense-step search): for audit, not read."""
    version: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        tile = tuple(self.tile)
        if len(tile) != 3 or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in tile):
            raise ValueError(f"tile is three positive integers (frames, rows, columns), got {self.tile!r}")
        self.tile = tile
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection is one of {SELECTIONS}, got {self.selection!r}")
        for name, low in (("dense_steps", 0), ("mask_reuse", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.layers, dict):
            raise ValueError("layers maps attention module names to lists of per-head-group values")
        groups = {len(v) if isinstance(v, list) else 0 for v in self.layers.values()}
        if len(groups) > 1 or 0 in groups:
            raise ValueError("every layer lists one value per head group, the same number of groups")
        topk = self.selection == "topk"
        for name, values in self.layers.items():
            for v in values:
                number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                if not number or not (0.0 <= v < 1.0 if topk else 0.0 < v <= 1.0):
                    what = "a sparsity in [0, 1)" if topk else "a mass in (0, 1]"
                    raise ValueError(f"layer {name!r}: each value is {what}, got {v!r}")

    @property
    def head_groups(self) -> int:
        return len(next(iter(self.layers.values()))) if self.layers else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "block_size": self.block_size,
            "tile": list(self.tile),
            "selection": self.selection,
            "first_frame_dense": self.first_frame_dense,
            "dense_steps": self.dense_steps,
            "mask_reuse": self.mask_reuse,
            "config_hash": self.config_hash,
            "layers": {k: [float(x) for x in v] for k, v in self.layers.items()},
            "record": self.record,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = PLAN_FILE) -> SparseAttentionPlan:
        if not isinstance(data, dict):
            raise PackageError(f"{where}: a sparse-attention plan is a JSON object")
        if data.get("version") != 1:
            raise PackageError(f"{where}: plan version {data.get('version')!r}; this sdkiln reads version 1")
        known = {"version", "block_size", "tile", "selection", "first_frame_dense", "dense_steps",
                 "mask_reuse", "config_hash", "layers", "record"}  # fmt: skip
        unknown = sorted(set(data) - known)
        if unknown:
            raise PackageError(f"{where}: unknown field {unknown[0]!r}")
        missing = sorted({"block_size", "tile", "layers"} - set(data))
        if missing:
            raise PackageError(f"{where}: missing field {missing[0]!r}")
        layers = data["layers"]
        if not isinstance(layers, dict) or not all(isinstance(v, list) for v in layers.values()):
            raise PackageError(f"{where}: layers maps attention module names to lists of values")
        if not isinstance(data.get("tile"), list) or not isinstance(data.get("record", {}), dict):
            raise PackageError(f"{where}: tile is a list and record an object")
        if not isinstance(data.get("first_frame_dense", True), bool) or not isinstance(
            data.get("config_hash", ""), str
        ):
            raise PackageError(f"{where}: first_frame_dense is a boolean and config_hash a string")
        try:
            return cls(
                block_size=data["block_size"],
                tile=tuple(data["tile"]),
                layers={str(k): list(v) for k, v in layers.items()},
                selection=data.get("selection", "topk"),
                first_frame_dense=data.get("first_frame_dense", True),
                dense_steps=data.get("dense_steps", 0),
                mask_reuse=data.get("mask_reuse", 1),
                config_hash=data.get("config_hash", ""),
                record=data.get("record", {}),
            )
        except ValueError as exc:
            raise PackageError(f"{where}: {exc}") from None
