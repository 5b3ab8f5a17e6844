"""GPTQ: error-compensating rounding of a weight onto a fixed integer grid (Frantar et al., 2023).

Rounding each weight to its nearest grid value minimises ``|W - Q|`` but not the layer's output
error on real inputs, ``E[|(W - Q) x|²] = tr((W - Q) H (W - Q)ᵀ)`` with ``H = E[x xᵀ]`` from
calibration (``sdkiln.calibrate.hessian``). GPTQ rounds the input columns one at a time and spreads
each column's rounding error over the columns not yet rounded, weighted by the inverse Hessian, so
correlated input channels absorb each other's errors. The grid (per-row or group-wise ``scale``,
``[qmin, qmax]``) is the scheme's own: the result is stored and run exactly like nearest rounding (same tensors, same
kernels, same Ascend files), only the integer values differ. msModelSlim offers the same choice for
its weights (``w_method="GPTQ"``). W8A8_DYNAMIC, W8A16 and W4A16 take it (``weight_rounding``).

This is the blocked ("lazy batch") form of the algorithm on the weight's device, in float64 up to
``FLOAT64_MAX_K`` input channels and in float32 above (as GPTQ's reference implementation runs):
a [K, K] float64 matrix of FLUX.1-dev's 15360-wide single-block output layer is 1.9 GB, and the
inverse takes two of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from statistics import median
from typing import Any

import torch
from torch import Tensor

from sdkiln.calibrate.hessian import hessian_groups, iter_hessians, layer_widths
from sdkiln.calibrate.loop import resolve_loop
from sdkiln.optimizer.registry import TransformContext

FLOAT64_MAX_K = 4096
"""The widest input a layer's GPTQ runs in float64 for (a [K, K] float64 matrix of 128 MB)."""


def expand_scale(scale: Tensor, k: int) -> Tensor:
    """A per-row [N, 1] or group-wise [N, C] scale as [N, K] (each of the C groups spans K / C inputs)."""
    n, c = scale.shape
    if k % c:
        raise ValueError(f"{c} scale groups do not divide {k} input channels")
    return scale.repeat_interleave(k // c, dim=1)


def output_error(weight: Tensor, dequantized: Tensor, hessian: Tensor) -> float:
    """``tr((W - Ŵ) H (W - Ŵ)ᵀ)``: the mean squared output error over the calibration inputs, summed
    over output channels."""
    work = torch.float64 if hessian.shape[0] <= FLOAT64_MAX_K else torch.float32
    h = hessian.detach().to(work)
    total = 0.0
    for start in range(0, weight.shape[0], 1024):  # a band of rows at a time: no [N, K] product whole
        err = weight[start : start + 1024].detach().to(work) - dequantized[start : start + 1024].detach().to(
            work
        )
        total += float(((err @ h) * err).sum(dtype=torch.float64))
    return total


def gptq_round(
    weight: Tensor,
    hessian: Tensor,
    scale: Tensor,
    qmin: int,
    qmax: int,
    damp: float = 0.01,
    block: int = 128,
) -> Tensor:
    """Integer values [N, K] (float64, in ``[qmin, qmax]``) for ``weight`` [N, K] on the grid
    ``scale`` ([N, 1] per row, or [N, C] for C groups of K / C consecutive inputs), rounded by GPTQ
    against ``hessian`` [K, K].

    ``damp`` times the mean diagonal is added to the diagonal (the Hessian of a few calibration
    prompts is often singular); an input channel that never saw a non-zero value has no error to
    compensate and is rounded to nearest. With ``H`` diagonal the result is nearest rounding.
    """
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian is {tuple(hessian.shape)}, the weight has {k} input channels")
    if scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(f"scale must be [{n}, 1] or [{n}, groups], got {tuple(scale.shape)}")
    if damp <= 0:
        raise ValueError("damp must be > 0")
    work = torch.float64 if k <= FLOAT64_MAX_K else torch.float32
    w = weight.detach().to(work).clone()
    h = hessian.detach().to(device=w.device, dtype=work).clone()
    s = expand_scale(scale.detach().to(device=w.device, dtype=work), k)
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    # Upper Cholesky factor of H⁻¹: row i holds how column i's error is spread over columns >= i.
    # One step at a time, each [K, K] intermediate freed as the next is made: at most two alive.
    hinv = torch.linalg.cholesky(h)
    del h
    hinv = torch.cholesky_inverse(hinv)
    hinv = torch.linalg.cholesky(hinv, upper=True)
    q = torch.empty_like(w)
    for start in range(0, k, block):
        end = min(start + block, k)
        w_blk = w[:, start:end].clone()
        err_blk = torch.empty_like(w_blk)
        hinv_blk = hinv[start:end, start:end]
        for i in range(end - start):
            col, s_col = w_blk[:, i], s[:, start + i]
            q_col = torch.clamp(torch.round(col / s_col), qmin, qmax)
            q[:, start + i] = q_col
            err = (col - q_col * s_col) / hinv_blk[i, i]
            w_blk[:, i:] -= err.unsqueeze(1) * hinv_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = err
        w[:, end:] -= err_blk @ hinv[start:end, end:]
    return q


def gptq_layer(
    weight: Tensor, hessian: Tensor, scale: Tensor, qmin: int, qmax: int, damp: float
) -> tuple[Tensor, float]:
    """(GPTQ's integer values, its calibration output error relative to nearest rounding's on the
    same grid: below 1 is better)."""
    s = expand_scale(scale.detach().double(), weight.shape[1])
    nearest = torch.round(weight.detach().double() / s).clamp(qmin, qmax)
    values = gptq_round(weight, hessian, scale, qmin, qmax, damp=damp)
    before = output_error(weight, nearest * s, hessian)
    after = output_error(weight, values * s, hessian)
    return values, (after / before if before > 0 else 1.0)


def gptq_groups(
    ctx: TransformContext, config: Any, names: list[str]
) -> tuple[Iterator[dict[str, Tensor]], dict[str, Any]]:
    """The input second moments of the named Linears, one group at a time (``iter_hessians``, groups
    within ``config.max_hessian_mb``), each group over the step's calibration loop at the deployment
    (a config with ``calib_samples``), and the calibration record."""
    loop, record = resolve_loop(ctx.spec, ctx.forward_loop, config.calib_samples, ctx.call_kwargs())
    groups = iter_hessians(
        ctx.pipeline, ctx.spec.transformer_attr, names, loop, config.max_hessian_mb * 2**20
    )
    return _handed_over(groups), record


def _handed_over(groups) -> Iterator[dict[str, Tensor]]:
    """Each group's matrices, taken out of their accumulators so the caller's dict is their only
    holder: when it drops them the memory is free, before the next group is collected."""
    for accs in groups:
        matrices = {}
        for name, acc in accs.items():
            matrices[name], acc.matrix = acc.matrix, None
        del accs
        yield matrices


def gptq_passes(ctx: TransformContext, config: Any, names: list[str]) -> int:
    """How many calibration passes ``gptq_groups`` runs: one per group."""
    widths = layer_widths(ctx.transformer, names)
    return len(hessian_groups(widths, config.max_hessian_mb * 2**20))


def gptq_record(ratios: dict[str, float]) -> dict[str, Any]:
    """What a step's manifest record says about its GPTQ rounding."""
    return {
        "weight_rounding": "gptq",
        "gptq_error_ratio": {k: round(v, 6) for k, v in ratios.items()},
        "gptq_error_ratio_median": round(median(ratios.values()), 6),
    }
