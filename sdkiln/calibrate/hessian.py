"""Second moments of linear-layer inputs (``H = E[x xᵀ]``, [K, K]) for error-compensating weight
rounding (GPTQ, ``sdkiln.optimizer.gptq``), streamed like the other observers.

An accumulator keeps one fp32 [K, K] running mean and a row count, never activations: its size is
fixed however many prompts the loop runs. K x K per layer adds up on a large model (FLUX's 12288-wide
MLP inputs take 600 MB each), so ``collect_hessians`` observes the layers in groups whose matrices
fit ``max_bytes`` together and runs the forward loop once per group: a small model takes one pass,
a large one a few. ``iter_hessians`` hands over one group at a time so a caller (GPTQ) rounds and
frees it before the next group is collected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from sdkiln.calibrate.observers import observing


class HessianAccumulator:
    """Running mean of ``x xᵀ`` over every token row of one layer's input."""

    def __init__(self) -> None:
        self.matrix: Tensor | None = None
        self.rows = 0

    def update(self, x: Tensor, step: int, num_steps: int) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.matrix is None:
            self.matrix = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        elif x.shape[1] != self.matrix.shape[0]:
            raise ValueError(
                f"input width changed from {self.matrix.shape[0]} to {x.shape[1]} during calibration"
            )
        total = self.rows + x.shape[0]
        # mean update (GPTQ's form): bounded values whatever the row count, so fp32 suffices
        self.matrix.mul_(self.rows / total).addmm_(x.T, x, alpha=1.0 / total)
        self.rows = total


def hessian_groups(widths: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Split layer names (in order) into groups whose fp32 [K, K] matrices fit ``max_bytes`` together;
    a layer larger than the budget gets a group of its own."""
    groups: list[list[str]] = []
    used = max_bytes + 1
    for name, k in widths.items():
        size = 4 * k * k
        if used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def layer_widths(transformer: nn.Module, names: list[str]) -> dict[str, int]:
    """Each named ``nn.Linear``'s input width (its Hessian is [K, K])."""
    widths = {}
    for name in names:
        module = transformer.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{name} is a {type(module).__name__}, not an nn.Linear")
        widths[name] = module.in_features
    return widths


def iter_hessians(
    pipeline: Any,
    transformer_attr: str,
    names: list[str],
    forward_loop: Callable[[Any], None],
    max_bytes: int,
) -> Iterator[dict[str, HessianAccumulator]]:
    """One group of layers at a time (``hessian_groups``): run ``forward_loop(pipeline)`` with a
    ``HessianAccumulator`` on each of the group's ``nn.Linear`` inputs and yield them. The caller
    uses and drops a group before asking for the next, so at most one group's matrices are alive;
    whatever it changes in the model meanwhile (a group's layers quantized) is what the next group's
    loop runs."""
    transformer = getattr(pipeline, transformer_attr)
    for group in hessian_groups(layer_widths(transformer, names), max_bytes):
        accs = {name: HessianAccumulator() for name in group}
        with observing(pipeline, transformer_attr, {n: a.update for n, a in accs.items()}):
            forward_loop(pipeline)
        for name, acc in accs.items():
            if acc.matrix is None:
                raise ValueError(
                    f"calibration saw no input for {transformer_attr}.{name}: the forward loop must run the pipeline, "
                    "and call that transformer (a pipeline's expert runs only the steps on its side of the boundary)"
                )
            if not bool(torch.isfinite(acc.matrix).all()):
                raise ValueError(f"{name} saw non-finite inputs during calibration")
        yield accs
        del accs


def collect_hessians(
    pipeline: Any,
    transformer_attr: str,
    names: list[str],
    forward_loop: Callable[[Any], None],
    max_bytes: int,
) -> dict[str, HessianAccumulator]:
    """Every named layer's accumulator at once (``iter_hessians`` merged; for small models and tests:
    it keeps every group's matrices)."""
    out: dict[str, HessianAccumulator] = {}
    for accs in iter_hessians(pipeline, transformer_attr, names, forward_loop, max_bytes):
        out.update(accs)
    return out
