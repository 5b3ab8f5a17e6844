"""The ``forward_loop(pipeline)`` contract and the default loop.

Calibration never owns the user's prompt pipeline (ModelOpt's ``mtq.quantize``): a step that needs
calibration data attaches its observers, calls ``forward_loop(pipeline)``, and detaches them. Any
callable that runs the pipeline on representative inputs will do; it returns nothing.

When the user gives none, ``PromptLoop`` is used: the model family's ``calibration_prompts`` (sample
i uses prompt ``spread_index(i, len(prompts))`` and seed ``CALIBRATION_SEED + i``; a loop with
``first=n`` runs samples n, n+1, ..., which a step uses for data held out from the first loop) at
the recipe's deployment call (denoising steps, guidance, resolution), so both
classifier-free-guidance branches run as they will in production. Decoding is skipped (``output_type="latent"``): nothing
after the denoiser is calibrated. ``record()`` is what a package stores about it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from sdkiln.calibrate.steps import on_step_end
from sdkiln.model_zoo import ModelSpec

ForwardLoop = Callable[[Any], None]
CALIBRATION_SEED = 0
_RESOLUTION_ARGS = ("height", "width", "num_frames")


def spread_index(i: int, n: int) -> int:
    """Which of ``n`` prompts sample ``i`` uses: ``(i * k) % n`` with the stride ``k`` near ``n`` over the
    golden ratio and coprime to ``n``.

    Prompt lists are often grouped by subject (the embedded model's captions come about twelve per
    class, in class order), so taking the first N would calibrate a few samples on one subject. The
    stride spreads any N consecutive samples over the whole list (every ``n`` consecutive samples
    visit every prompt once), and is a pure function of ``i`` and ``n``, so every rank and every run
    plans the same samples.
    """
    if n < 1:
        raise ValueError("no calibration prompts")
    k = max(1, round(n / ((1 + 5**0.5) / 2)))
    while math.gcd(k, n) != 1:
        k += 1
    return (i * k) % n


def prompts_sha256(prompts: list[str]) -> str:
    """Hash of the prompt list in order (canonical JSON), so a package names its calibration set."""
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass
class PromptLoop:
    """The default forward loop: ``samples`` calibration prompts through the pipeline, one at a time."""

    spec: ModelSpec
    samples: int
    call: dict[str, Any] | None = None
    """The deployment call (``spec.call_kwargs(...)``); None for the family's defaults."""
    first: int = 0
    """Index of the first sample: its prompt is ``prompts[spread_index(first, len(prompts))]``, its seed ``CALIBRATION_SEED + first``."""

    def plan(self) -> tuple[list[str], list[int]]:
        prompts, ids = self.spec.calibration_prompts, range(self.first, self.first + self.samples)
        return [prompts[spread_index(i, len(prompts))] for i in ids], [CALIBRATION_SEED + i for i in ids]

    def call_kwargs(self) -> dict[str, Any]:
        return {**(self.spec.call_kwargs() if self.call is None else self.call), "output_type": "latent"}

    def __call__(self, pipeline: Any) -> None:
        self.run(pipeline)

    @torch.inference_mode()
    def run(self, pipeline: Any, capture_latents: bool = False) -> torch.Tensor | None:
        """Run the plan; with ``capture_latents``, return the final latents of every sample (fp32, CPU)."""
        call = self.call_kwargs()
        last: dict[str, torch.Tensor] = {}

        def capture(_pipe, _step, _t, kwargs):
            last["latents"] = kwargs["latents"].detach()
            return kwargs

        pipeline.set_progress_bar_config(disable=True)
        prompts, seeds = self.plan()
        finals = []
        for prompt, seed in tqdm(
            list(zip(prompts, seeds, strict=True)), desc="calibrate", unit="prompt", leave=False
        ):
            generator = torch.Generator("cpu").manual_seed(seed)
            with on_step_end(pipeline, capture) if capture_latents else contextlib.nullcontext({}) as extra:
                pipeline(prompt=prompt, generator=generator, **call, **self.spec.condition(call), **extra)
            if capture_latents:
                finals.append(last.pop("latents").float().cpu())
        return torch.cat(finals) if capture_latents else None

    def record(self) -> dict[str, Any]:
        """What the package stores about this calibration: enough to run it again."""
        prompts, seeds = self.plan()
        call = self.call_kwargs()
        return {
            "loop": "default",
            "samples": self.samples,
            "prompts": prompts,
            "prompts_sha256": prompts_sha256(prompts),
            "seeds": seeds,
            "steps": call.get("num_inference_steps"),
            "guidance": {self.spec.guidance_arg: call.get(self.spec.guidance_arg)},
            "resolution": {k: call[k] for k in _RESOLUTION_ARGS if k in call},
        }


def resolve_loop(
    spec: ModelSpec,
    forward_loop: ForwardLoop | None,
    samples: int,
    call: dict[str, Any] | None,
    first: int = 0,
) -> tuple[ForwardLoop, dict[str, Any]]:
    """The loop a calibrating step runs and its record: the user's loop as given, else ``PromptLoop``
    from sample ``first`` (a second pass on held-out samples starts after the first pass's).

    A user loop's prompts are unknown to us; its record says so, and the step adds the step count the
    observers saw.
    """
    if forward_loop is not None:
        return forward_loop, {"loop": "user"}
    loop = PromptLoop(spec, samples, call, first=first)
    return loop, loop.record()
