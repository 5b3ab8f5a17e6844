"""Every user-facing config: boring, versioned, JSON round-trippable (STYLE.md habit 2).

A recipe is an ordered list of step configs. Each step config names its ``kind``; on load the
kind is resolved from an allow-list (``STEP_CONFIGS``), never unpickled. Adding a technique is one
config class registered here plus one transform registered in ``sdkiln.optimizer``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sdkiln.errors import RecipeError

STEP_CONFIGS: dict[str, type[StepConfig]] = {}


def register_config(cls: type[StepConfig]) -> type[StepConfig]:
    if cls.kind in STEP_CONFIGS:
        raise ValueError(f"step kind {cls.kind!r} is registered twice")
    STEP_CONFIGS[cls.kind] = cls
    return cls


@dataclass
class StepConfig:
    """One recipe step. Subclasses set ``kind`` and ``version`` and validate in ``__post_init__``."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "version": self.version}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> StepConfig:
        if not isinstance(data, dict) or "kind" not in data:
            raise RecipeError(f"a recipe step must be an object with a 'kind', got {data!r}")
        kind = data["kind"]
        if kind not in STEP_CONFIGS:
            raise RecipeError(f"unknown recipe step kind {kind!r}; known: {', '.join(sorted(STEP_CONFIGS))}")
        cls = STEP_CONFIGS[kind]
        version = data.get("version", cls.version)
        if version != cls.version:
            raise RecipeError(f"step {kind!r} has config version {version}; this sdkiln reads version {cls.version}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(names) - {"kind", "version"}
        if unknown:
            raise RecipeError(f"step {kind!r} has unknown fields: {', '.join(sorted(unknown))}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"step {kind!r}: {exc}") from None


@register_config
@dataclass
class W8A8DynamicConfig(StepConfig):
    """int8 per-output-channel symmetric weights; int8 per-token symmetric activations, computed at run time.

    Applies to every ``nn.Linear`` inside the transformer blocks except the family's float list and
    the extra fnmatch patterns in ``exclude``. Needs no calibration data.
    """

    kind: ClassVar[str] = "w8a8_dynamic"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str) or not all(isinstance(p, str) for p in self.exclude):
            raise ValueError("exclude must be a list of fnmatch patterns")
        self.exclude = tuple(self.exclude)


@dataclass
class RecipeConfig:
    """An ordered list of steps. ``name`` is what the user asked for (a name, a+b, or a file)."""

    name: str
    steps: list[StepConfig] = field(default_factory=list)
    version: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "steps": [s.to_dict() for s in self.steps]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RecipeConfig:
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
            raise RecipeError("a recipe must be an object with a 'steps' list")
        if data.get("version", RecipeConfig.version) != RecipeConfig.version:
            raise RecipeError(f"recipe version {data.get('version')} is not supported (this sdkiln reads 1)")
        return RecipeConfig(
            name=str(data.get("name", "custom")), steps=[StepConfig.from_dict(s) for s in data["steps"]]
        )
