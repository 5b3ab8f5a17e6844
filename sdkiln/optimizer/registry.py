"""Step config class -> transform. One registration per technique (STYLE.md habit 1)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from sdkiln.configs import StepConfig
from sdkiln.model_zoo import ModelSpec


@dataclass
class StepContext:
    """What a transform may use: the pipeline being optimized, its spec, and the calibration loop."""

    pipeline: Any
    spec: ModelSpec
    forward_loop: Callable[[Any], None] | None

    @property
    def transformer(self) -> nn.Module:
        return getattr(self.pipeline, self.spec.transformer_attr)


@dataclass
class StepResult:
    """What a step decided: ``modules`` maps layer name -> {"scheme": ...} for the runtime to swap;
    ``record`` is everything else worth auditing (kept in the manifest with the step's config);
    ``files`` are extra package files (relative path -> dict of tensors, written as safetensors, or
    a JSON-serializable object, written as JSON), e.g. ``calibration/stats.safetensors``."""

    modules: dict[str, dict[str, Any]]
    record: dict[str, Any]
    files: dict[str, Any] = field(default_factory=dict)


Transform = Callable[[StepContext, StepConfig], StepResult]
_TRANSFORMS: dict[type[StepConfig], Transform] = {}


def register_transform(config_cls: type[StepConfig]) -> Callable[[Transform], Transform]:
    def wrap(fn: Transform) -> Transform:
        if config_cls in _TRANSFORMS:
            raise ValueError(f"a transform for {config_cls.__name__} is registered twice")
        _TRANSFORMS[config_cls] = fn
        return fn

    return wrap


def apply_step(ctx: StepContext, config: StepConfig) -> StepResult:
    if type(config) not in _TRANSFORMS:
        importlib.import_module(config.transform_module)
    try:
        transform = _TRANSFORMS[type(config)]
    except KeyError:
        raise TypeError(f"no transform registered for {type(config).__name__}") from None
    return transform(ctx, config)
