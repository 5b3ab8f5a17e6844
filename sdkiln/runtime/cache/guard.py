"""The optional guard of a cache schedule: compute anyway when the input is unusual.

A static schedule decides by the step index alone. The guard adds one check at each planned reuse
step: the **input change**, the relative L1 change of the block stack's input (the first block's
first stream, ``hidden_states``) since the last step that computed, per batch row, the largest row
taken. It costs one subtraction and one reduction and no block evaluation, so it is the cheapest of
the indicators the cache profile records. If it exceeds the step's threshold, the step runs full
(and refreshes the caches): an input the calibration never saw is not served from a cache.

Thresholds come from calibration (``sdkiln.optimizer.cache.search``): the schedule runs on the calibration samples
with the guard recording, and each reuse step's threshold is a quantile of the values seen there
times a margin. The schedule stores them per branch and step; a step without one is never forced.

The decision needs the indicator on the host, so a guarded schedule syncs once per reuse step (an
unguarded one never does). Under ``torch.distributed`` the decision is reduced across ranks (max:
one rank forcing forces all), so that every rank runs the same blocks at the same step. Under the
parallel runtime the indicator is computed on the whole sequence (gathered from the sequence
ranks, padding cut) and the reduction joins only the ranks that run the call
(``sdkiln.runtime.parallel``): every rank decides from the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

INDICATOR = "input_change"


def input_change(current: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per batch row: |current - reference|_1 / |reference|_1 (float32, shape [batch])."""
    c, r = current.detach().float().flatten(1), reference.float().flatten(1)
    return (c - r).abs().sum(1) / r.abs().sum(1).clamp_min(1e-12)


WORLD = "world"
"""``agree``'s default group: the default process group, whichever it is when the guard decides."""


def agree(force: bool, device: torch.device, group: Any = WORLD) -> bool:
    """Whether any rank of ``group`` forces a compute (each of them gets the same answer): the
    default process group by default; the flag itself for ``group=None`` (this rank alone) and
    outside ``torch.distributed``."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return force
    flag = torch.tensor([int(force)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=None if group == WORLD else group)
    return bool(flag.item())


@dataclass
class Guard:
    """Thresholds per branch and step (None: never forced), or a recorder when ``record`` is set.
    The cache runner applies it (``CacheRunner._guard_forces``) and counts its checks."""

    thresholds: dict[str, list[float | None]] = field(default_factory=dict)
    quantile: float | None = None
    margin: float | None = None
    record: bool = False
    values: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """Recorded indicator values, (branch, step) -> one per batch row and call."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Guard | None:
        """The guard of a schedule's ``guards`` object; None when it has none."""
        if not d:
            return None
        if d.get("indicator") != INDICATOR:
            raise ValueError(
                f"unknown cache guard indicator {d.get('indicator')!r}; this sdkiln knows {INDICATOR}"
            )
        thresholds = {
            str(b): [None if t is None else float(t) for t in ts] for b, ts in dict(d["thresholds"]).items()
        }
        for key in ("quantile", "margin"):
            value = d.get(key)
            if value is not None and not (type(value) in (int, float) and math.isfinite(value)):
                raise ValueError(f"cache guard {key} must be a finite number, got {value!r}")
        return cls(thresholds, d.get("quantile"), d.get("margin"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "indicator": INDICATOR,
            "reduce": "max over batch rows, then max across ranks",
            "quantile": self.quantile,
            "margin": self.margin,
            "thresholds": self.thresholds,
        }

    def threshold(self, step: int, branch: str) -> float | None:
        ts = self.thresholds.get(branch)
        if ts is None and len(self.thresholds) == 1:  # one list serves every branch, like the actions
            ts = next(iter(self.thresholds.values()))
        return None if ts is None or step >= len(ts) else ts[step]

    def observe(self, step: int, branch: str, change: torch.Tensor) -> None:
        """Record one call's per-row input change (a recording guard)."""
        self.values.setdefault((branch, step), []).extend(change.cpu().tolist())


def calibrate(
    values: dict[tuple[str, int], list[float]], num_steps: int, quantile: float, margin: float
) -> Guard:
    """Thresholds from recorded values: per branch and step, ``quantile`` of the values times ``margin``."""
    if not 0.0 < quantile <= 1.0 or margin < 1.0:
        raise ValueError("a cache guard needs 0 < quantile <= 1 and margin >= 1")
    thresholds: dict[str, list[float | None]] = {}
    for (branch, step), vals in sorted(values.items()):
        ts = thresholds.setdefault(branch, [None] * num_steps)
        ts[step] = float(torch.quantile(torch.tensor(vals, dtype=torch.float64), quantile)) * margin
    return Guard(thresholds, quantile, margin)
