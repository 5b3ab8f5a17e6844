"""Recipe step config class -> transform. One registration per technique (STYLE habit 1)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from sdkiln.configs import Deployment, RecipeConfig, RecipeStep
from sdkiln.errors import RecipeError
from sdkiln.model_zoo import ModelSpec


@dataclass
class TransformContext:
    """What a transform may use: the pipeline being optimized, its spec, the calibration loop, and
    the recipe it belongs to (None for a recipe step applied on its own), whose deployment every
    step calibrates, searches and measures at."""

    pipeline: Any
    spec: ModelSpec
    forward_loop: Callable[[Any], None] | None
    recipe: RecipeConfig | None = None

    @property
    def transformer(self) -> nn.Module:
        return getattr(self.pipeline, self.spec.transformer_attr)

    def for_transformer(self, attr: str) -> TransformContext:
        """This context for the pipeline's transformer ``attr`` (one of ``spec.transformer_attrs``): a
        step given it calibrates, changes and records that transformer alone, on the steps it runs."""
        if attr == self.spec.transformer_attr:
            return self
        return replace(self, spec=replace(self.spec, transformer_attr=attr, experts=()))

    def transformers_of(self, step: RecipeStep) -> tuple[str, ...]:
        """The transformers a step runs on, in turn: each of the pipeline's, or, for a step that changes
        other components (``per_transformer`` False), only the main one's pass."""
        return self.spec.transformer_attrs if step.per_transformer else (self.spec.transformer_attr,)

    def step_label(self, step: RecipeStep, attr: str) -> str:
        """A recipe step's name in the plan and the progress bars: its kind, followed by the
        transformer it works on when the pipeline has several (``w8a8_dynamic [transformer_2]``)."""
        return f"{step.kind} [{attr}]" if self.spec.experts and step.per_transformer else step.kind

    @property
    def deployment(self) -> Deployment:
        return self.recipe.deployment if self.recipe is not None else Deployment()

    def call_kwargs(self) -> dict[str, Any]:
        """The pipeline call the recipe is made for: the family's defaults with the deployment's settings."""
        d = self.deployment
        return self.spec.call_kwargs(
            num_inference_steps=d.num_inference_steps,
            guidance=d.guidance,
            height=d.height,
            width=d.width,
            num_frames=d.num_frames,
            max_sequence_length=d.max_sequence_length,
        )

    def check_deployment(self) -> None:
        """Refuse a resolution setting the family's pipeline call does not take (``num_frames`` for
        an image model) or cannot take (a height that is not a multiple of its ``size_multiple``, a
        frame count off its ``frame_step``)."""
        d, spec = self.deployment, self.spec
        for name in ("height", "width", "num_frames", "max_sequence_length"):
            if getattr(d, name) is not None and name not in spec.call_defaults:
                raise RecipeError(
                    f"the recipe deploys at {name}={getattr(d, name)}, but {spec.name} "
                    f"calls its pipeline without {name}"
                )
        for name in ("height", "width"):
            value = getattr(d, name)
            if value is not None and value % spec.size_step:
                raise RecipeError(
                    f"the recipe deploys at {name}={value}, but {spec.name} takes multiples of "
                    f"{spec.size_step} (its VAE's downscale times its patch size)"
                )
        if d.max_sequence_length is not None and d.max_sequence_length > spec.max_text_tokens:
            raise RecipeError(
                f"the recipe deploys at max_sequence_length={d.max_sequence_length}, but {spec.name}'s "
                f"pipeline takes at most {spec.max_text_tokens} text tokens"
            )
        if d.num_frames is not None and spec.frame_step and (d.num_frames - 1) % spec.frame_step:
            raise RecipeError(
                f"the recipe deploys at num_frames={d.num_frames}, but {spec.name} takes "
                f"{spec.frame_step}k + 1 frames (e.g. {spec.frame_step * ((d.num_frames - 1) // spec.frame_step) + 1})"
            )

    @property
    def num_inference_steps(self) -> int:
        return int(self.call_kwargs()["num_inference_steps"])


@dataclass
class TransformResult:
    """What a recipe step decided: ``modules`` maps layer name -> {"scheme": ...} for the runtime to
    swap; ``record`` is everything else worth auditing (kept in the manifest with the step's config);
    ``files`` are extra package files (relative path -> dict of tensors, written as safetensors, a
    JSON-serializable object, written as JSON, or PNG bytes), e.g. ``calibration/stats.safetensors``;
    ``sections`` are manifest sections the runtime restores (``sdkiln.runtime.restore``), e.g.
    ``{"cache_schedule": {"file": ...}}``."""

    modules: dict[str, dict[str, Any]]
    record: dict[str, Any]
    files: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)


def step_capability(step: RecipeStep) -> str | None:
    """The family capability (``model_zoo.spec.CAPABILITIES``) a recipe step exercises."""
    if step.kind == "sparse_attention":
        return "sparse"
    if step.transform_module.startswith("sdkiln.optimizer.cache"):
        return "cache"
    if step.transform_module.startswith("sdkiln.optimizer.quant"):
        return "quant"
    return None


def refuse_steps(spec, steps) -> None:
    """The family's one-line refusal (``ModelSpec.refusals``) of a recipe step it cannot take."""
    for step in steps:
        capability = step_capability(step)
        if capability is not None:
            spec.refuse(capability)


Transform = Callable[[TransformContext, RecipeStep], TransformResult]
_TRANSFORMS: dict[type[RecipeStep], Transform] = {}


def register_transform(*config_classes: type[RecipeStep]) -> Callable[[Transform], Transform]:
    """Decorator: ``fn`` applies recipe steps of these config classes."""

    def wrap(fn: Transform) -> Transform:
        for cls in config_classes:
            if cls in _TRANSFORMS:
                raise ValueError(f"a transform for {cls.__name__} is registered twice")
            _TRANSFORMS[cls] = fn
        return fn

    return wrap


def apply_transform(ctx: TransformContext, config: RecipeStep) -> TransformResult:
    if type(config) not in _TRANSFORMS:
        importlib.import_module(config.transform_module)
    try:
        transform = _TRANSFORMS[type(config)]
    except KeyError:
        raise TypeError(f"no transform registered for {type(config).__name__}") from None
    return transform(ctx, config)
