"""Sparsity recipe steps: block-sparse attention calibrated per layer, and 2:4 weight sparsity."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sdkiln.configs.recipe import RecipeStep, register_step


def _in_range(name: str, value: float, low: float, high: float, closed_high: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (value == high and not closed_high):
        raise ValueError(f"{name} must be in [{low}, {high}{']' if closed_high else ')'}, got {value!r}")


@register_step
@dataclass
class SparseAttentionConfig(RecipeStep):
    """Block-sparse attention (``sdkiln.sparsify.attention``, ``docs/sparsity.md``).

    Calibrated (the default): on ``calib_samples`` calibration samples at the recipe's deployment,
    every self-attention layer (and head group, with ``head_groups`` > 1) gets the largest sparsity
    in ``grid`` whose attention output stays within ``budget`` relative L1 error of dense attention
    over the sparse denoising steps; then the fewest initial dense steps (up to ``max_dense_steps``,
    default a quarter of the steps) whose final outputs reach ``psnr_floor_db`` against dense
    attention. ``sparsity`` instead gives every layer that sparsity (uniform, for comparison), and
    ``mass`` keeps per query block the fewest key blocks reaching that cumulative attention mass.
    ``dense_steps`` fixes the dense steps instead of searching them. ``block_size`` None is the
    family's (``ModelSpec.sparse_block_size``); ``mask_reuse`` reuses a block selection over that
    many denoising steps.
    """

    kind: ClassVar[str] = "sparse_attention"
    order: ClassVar[int] = 45
    transform_module: ClassVar[str] = "sdkiln.sparsify.attention"
    budget: float = 0.05
    grid: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
    sparsity: float | None = None
    mass: float | None = None
    head_groups: int = 1
    block_size: int | None = None
    dense_steps: int | None = None
    max_dense_steps: int | None = None
    psnr_floor_db: float = 30.0
    mask_reuse: int = 1
    first_frame_dense: bool = True
    calib_samples: int = 2

    def __post_init__(self) -> None:
        _in_range("budget", self.budget, 0.0, 1.0, True)
        self.grid = tuple(sorted(float(g) for g in self.grid))
        if not self.grid:
            raise ValueError("grid lists the sparsities calibration chooses from")
        for g in self.grid:
            _in_range("each grid sparsity", g, 0.0, 1.0, False)
        if self.sparsity is not None and self.mass is not None:
            raise ValueError("give sparsity (uniform top-k) or mass (uniform cumulative mass), not both")
        if self.sparsity is not None:
            _in_range("sparsity", self.sparsity, 0.0, 1.0, False)
        if self.mass is not None:
            _in_range("mass", self.mass, 0.0, 1.0, True)
            if self.mass == 0.0:
                raise ValueError("mass must be positive")
        for name, low in (("head_groups", 1), ("mask_reuse", 1), ("calib_samples", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("block_size", "dense_steps", "max_dense_steps"):
            value = getattr(self, name)
            low = 1 if name == "block_size" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be None or an integer >= {low}, got {value!r}")
        _in_range("psnr_floor_db", self.psnr_floor_db, 0.0, 200.0, True)

    @property
    def calibrated(self) -> bool:
        return self.sparsity is None and self.mass is None


@register_step
@dataclass
class Sparse24Config(RecipeStep):
    """2:4 weight sparsity (``sdkiln.sparsify.weights``): in every block Linear that is not kept in
    float, of each 4 consecutive input weights of a row the 2 of smallest magnitude become zero, the
    pattern NVIDIA's sparse tensor cores run. Off by default: without retraining the embedded model
    reaches only 18.9 dB PSNR against its unpruned self (``docs/sparsity.md``). Applied to the float
    weights before any quantization step."""

    kind: ClassVar[str] = "sparse_2_4"
    order: ClassVar[int] = 5
    transform_module: ClassVar[str] = "sdkiln.sparsify.weights"
    exclude: tuple[str, ...] = ()
    """fnmatch patterns of Linear names (relative to the transformer) left dense."""

    def __post_init__(self) -> None:
        self.exclude = tuple(str(p) for p in self.exclude)
