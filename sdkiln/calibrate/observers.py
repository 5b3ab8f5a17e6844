"""Streaming observers of linear-layer inputs, hooked on for one run of the forward loop.

An observer keeps running statistics, never activations: its state has a fixed size (a few [K]
vectors and a [T, K] table, for K input channels and T denoising steps) however many prompts the
loop runs. Per layer it tracks

* ``channel_min`` / ``channel_max`` [K]: per input channel over every token, step and prompt; the
  per-tensor ``min``/``max`` and the per-channel ``channel_absmax`` follow from them;
* ``step_min`` / ``step_max`` [T] and ``step_channel_absmax`` [T, K]: the same per denoising step,
  the step being the real step index from ``sdkiln.runtime.denoising`` (both CFG branches of a step
  land in the same row). Steps the loop never ran keep ``+inf`` / ``-inf`` / 0.

``observing`` attaches removable forward pre-hooks (and a step tracker, if the transformer has
none), yields while the loop runs, and removes everything again, also when the loop raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from sdkiln.errors import StepError
from sdkiln.runtime.denoising import (
    DenoisingStepTracker,
    attach_step_tracker,
    detach_step_tracker,
    step_tracker,
)

InputCallback = Callable[[Tensor, int, int], None]
"""Called with (the layer's input, the denoising step, the run's step count)."""


class InputObserver:
    """Running statistics of one layer's input; see the module docstring."""

    def __init__(self) -> None:
        self.num_steps: int | None = None
        self.channel_min: Tensor | None = None
        self.channel_max: Tensor | None = None
        self.step_min: Tensor | None = None
        self.step_max: Tensor | None = None
        self.step_channel_absmax: Tensor | None = None

    def update(self, x: Tensor, step: int, num_steps: int) -> None:
        cmin, cmax = torch.aminmax(x.detach().reshape(-1, x.shape[-1]), dim=0)
        cmin, cmax = cmin.float(), cmax.float()
        if self.num_steps is None:
            self._allocate(cmin, num_steps)
        elif num_steps != self.num_steps or cmin.numel() != self.channel_min.numel():
            raise ValueError(
                f"calibration ran this layer with {num_steps} steps and {cmin.numel()} channels after "
                f"{self.num_steps} and {self.channel_min.numel()}: per-step statistics need one step count"
            )
        if not 0 <= step < num_steps:
            raise StepError(f"denoising step {step} is outside the run's {num_steps} steps")
        torch.minimum(self.channel_min, cmin, out=self.channel_min)
        torch.maximum(self.channel_max, cmax, out=self.channel_max)
        self.step_min[step] = torch.minimum(self.step_min[step], cmin.min())
        self.step_max[step] = torch.maximum(self.step_max[step], cmax.max())
        self.step_channel_absmax[step] = torch.maximum(
            self.step_channel_absmax[step], torch.maximum(-cmin, cmax)
        )

    def _allocate(self, like: Tensor, num_steps: int) -> None:
        k = like.numel()
        self.num_steps = num_steps
        self.channel_min = torch.full((k,), torch.inf, device=like.device)
        self.channel_max = torch.full((k,), -torch.inf, device=like.device)
        self.step_min = torch.full((num_steps,), torch.inf, device=like.device)
        self.step_max = torch.full((num_steps,), -torch.inf, device=like.device)
        self.step_channel_absmax = torch.zeros(num_steps, k, device=like.device)

    @property
    def seen(self) -> bool:
        return self.num_steps is not None

    @property
    def min(self) -> float:
        return float(self.channel_min.min())

    @property
    def max(self) -> float:
        return float(self.channel_max.max())

    @property
    def channel_absmax(self) -> Tensor:
        return torch.maximum(-self.channel_min, self.channel_max)

    def steps_seen(self) -> Tensor:
        """[T] bool: the steps the loop ran this layer at."""
        return self.step_max >= self.step_min

    def state(self) -> dict[str, Tensor]:
        """The statistics as CPU tensors, as ``calibration/stats.safetensors`` stores them."""
        tensors = {
            "min": self.channel_min.min().reshape(1),
            "max": self.channel_max.max().reshape(1),
            "channel_min": self.channel_min,
            "channel_max": self.channel_max,
            "step_min": self.step_min,
            "step_max": self.step_max,
            "step_channel_absmax": self.step_channel_absmax,
        }
        return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


def _pre_hook(name: str, callback: InputCallback, tracker: DenoisingStepTracker):
    def hook(module, args):
        if tracker.step is None:
            raise StepError(f"{name} ran outside the transformer's forward, so its denoising step is unknown")
        if not args:
            raise ValueError(f"{name} was called without a positional input; observers read args[0]")
        with torch.no_grad():  # a user's loop may run with autograd on; statistics never need it
            callback(args[0], tracker.step, tracker.num_steps)

    return hook


@contextmanager
def observing(
    pipeline: Any, transformer_attr: str, callbacks: dict[str, InputCallback]
) -> Iterator[DenoisingStepTracker]:
    """Hook ``callbacks[name]`` onto the input of each named transformer submodule while the block runs."""
    transformer = getattr(pipeline, transformer_attr)
    tracker = step_tracker(transformer)
    owned = tracker is None
    if owned:
        tracker = attach_step_tracker(pipeline, transformer_attr)
    handles = []
    try:
        for name, callback in callbacks.items():
            handles.append(
                transformer.get_submodule(name).register_forward_pre_hook(_pre_hook(name, callback, tracker))
            )
        yield tracker
    finally:
        for handle in handles:
            handle.remove()
        if owned:
            detach_step_tracker(transformer)


def collect_input_stats(
    pipeline: Any, transformer_attr: str, names: list[str], forward_loop: Callable[[Any], None]
) -> dict[str, InputObserver]:
    """Run ``forward_loop(pipeline)`` once with an ``InputObserver`` on each named layer."""
    observers = {name: InputObserver() for name in names}
    with observing(pipeline, transformer_attr, {n: o.update for n, o in observers.items()}):
        forward_loop(pipeline)
    for name, obs in observers.items():
        if not obs.seen:
            raise ValueError(
                f"calibration saw no input for {transformer_attr}.{name}: the forward loop must run the pipeline, "
                "and call that transformer (a pipeline's expert runs only the steps on its side of the boundary)"
            )
        if not bool(torch.isfinite(obs.channel_min).all() and torch.isfinite(obs.channel_max).all()):
            raise ValueError(f"{name} saw non-finite inputs during calibration")
    return observers


def stats_tensors(kind: str, observers: dict[str, InputObserver]) -> dict[str, Tensor]:
    """``{"<kind>/<layer>.<stat>": tensor}`` for ``calibration/stats.safetensors``."""
    return {f"{kind}/{layer}.{k}": v for layer, obs in observers.items() for k, v in obs.state().items()}
