"""Recipes and their serializer: the allow-list of recipe step kinds, the recipe step base class, the
deployment a recipe is made for, and ``RecipeConfig`` (STYLE habit 2).

A recipe is an ordered list of **recipe steps** (the techniques it applies) made for one
**deployment**: the pipeline call it optimizes for, with its number of **denoising steps**,
guidance and resolution. Every recipe step calibrates, searches and measures at that call, and the
package's manifest records it, so the calibration record, a cache schedule and the manifest agree
by construction. On load a step's ``kind`` is resolved from the allow-list (``RECIPE_STEPS``),
never unpickled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sdkiln.errors import RecipeError

RECIPE_STEPS: dict[str, type[RecipeStep]] = {}


def register_step(cls: type[RecipeStep]) -> type[RecipeStep]:
    """Class decorator: allow ``cls`` in recipes under its ``kind``."""
    if cls.kind in RECIPE_STEPS:
        raise ValueError(f"recipe step kind {cls.kind!r} is registered twice")
    RECIPE_STEPS[cls.kind] = cls
    return cls


@dataclass
class RecipeStep:
    """One recipe step. Subclasses set ``kind``, ``version``, ``order`` and ``transform_module`` and
    validate in ``__post_init__``.

    ``order`` places the step in a recipe whatever order its names were given in (smoothing before
    quantization before caching); ``transform_module`` is the ``sdkiln.optimizer`` module whose
    registered transform applies it, imported only when the step runs.
    """

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1
    order: ClassVar[int] = 50
    transform_module: ClassVar[str] = ""
    prepares: ClassVar[tuple[str, ...]] = ()
    """For a step that only prepares another (SmoothQuant): the kinds of which one must follow it."""
    quantizes: ClassVar[bool] = False
    """A weight-quantization step. Two of them in one recipe must split the layers with ``exclude``
    (a later step quantizes only the Linears an earlier one left), so recipe names, which carry no
    ``exclude``, combine at most one."""
    per_transformer: ClassVar[bool] = True
    """The step runs on each of the pipeline's transformers in turn (Wan2.2-A14B's two); False for a
    step that changes other components (the text encoders), which runs once."""

    def __new__(cls, *args: Any, **kwargs: Any):
        moved = sorted(set(kwargs) & set(_LEGACY_STEP_COUNTS))
        if moved:
            raise RecipeError(
                f"{cls.__name__}({moved[0]}=...): a recipe has one denoising step count, on its deployment: "
                "RecipeConfig(..., deployment=Deployment(num_inference_steps=N))"
            )
        return super().__new__(cls)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "version": self.version}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RecipeStep:
        if not isinstance(data, dict) or "kind" not in data:
            raise RecipeError(f"a recipe step must be an object with a 'kind', got {data!r}")
        kind = data["kind"]
        if kind not in RECIPE_STEPS:
            raise RecipeError(f"unknown recipe step kind {kind!r}; known: {', '.join(sorted(RECIPE_STEPS))}")
        cls = RECIPE_STEPS[kind]
        version = data.get("version", cls.version)
        if version != cls.version:
            raise RecipeError(
                f"recipe step {kind!r} has config version {version}; this sdkiln reads version {cls.version}"
            )
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(names) - {"kind", "version"}
        if unknown:
            raise RecipeError(f"recipe step {kind!r} has unknown fields: {', '.join(sorted(unknown))}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"recipe step {kind!r}: {exc}") from None


def _positive_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise RecipeError(f"deployment {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Deployment:
    """The pipeline call a recipe optimizes for; None leaves the model variant's default.

    ``guidance`` is the variant's guidance argument (``guidance_scale``; the FLUX test build's
    ``true_cfg_scale``).
    """

    num_inference_steps: int | None = None
    guidance: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    max_sequence_length: int | None = None
    """Text tokens the prompt is encoded to (T5's padding length in FLUX, SD3 and Wan)."""
    version: ClassVar[int] = 1

    def __post_init__(self) -> None:
        for name in ("num_inference_steps", "height", "width", "num_frames", "max_sequence_length"):
            _positive_int(name, getattr(self, name))
        if self.guidance is not None and (
            isinstance(self.guidance, bool)
            or not isinstance(self.guidance, int | float)
            or not math.isfinite(self.guidance)
        ):
            raise RecipeError(f"deployment guidance must be a finite number, got {self.guidance!r}")

    def merged(self, other: Deployment, what: str = "the override") -> Deployment:
        """This deployment with ``other``'s settings added; a setting both give differently is refused."""
        out = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and theirs is not None and mine != theirs:
                raise RecipeError(f"the recipe deploys at {f.name}={mine} but {what} says {theirs}; use one")
            out[f.name] = mine if theirs is None else theirs
        return Deployment(**out)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version} | {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> Deployment:
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe's deployment must be an object, got {data!r}")
        if data.get("version", cls.version) != cls.version:
            raise RecipeError(
                f"deployment version {data.get('version')!r} is not supported (this sdkiln reads 1)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"version"}
        if unknown:
            raise RecipeError(f"deployment has unknown fields: {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in data.items() if k in names})


# Recipe files written before recipes had a deployment named the denoising step count per step.
_LEGACY_STEP_COUNTS = {"calib_steps": None, "steps": "cache_auto"}  # field -> the kind it was on (None: any)


def _lift_step_counts(steps: list[Any], deployment: Deployment) -> Deployment:
    """Move the legacy per-step ``calib_steps`` / cache_auto ``steps`` into the deployment, refusing
    a recipe whose steps name different counts."""
    counts = {}
    for data in steps:
        if not isinstance(data, dict):
            continue
        for name, kind in _LEGACY_STEP_COUNTS.items():
            if name in data and (kind is None or data.get("kind") == kind):
                value = data.pop(name)
                if value is not None:
                    counts.setdefault(value, []).append(f"{data.get('kind')}.{name}")
    if len(counts) > 1:
        where = "; ".join(f"{', '.join(w)} = {v}" for v, w in counts.items())
        raise RecipeError(
            f"recipe steps name different denoising step counts ({where}); a recipe has one: "
            '"deployment": {"num_inference_steps": N}'
        )
    for value, where in counts.items():
        deployment = deployment.merged(Deployment(num_inference_steps=value), where[0])
    return deployment


@dataclass
class RecipeConfig:
    """An ordered list of recipe steps and the deployment they are made for. ``name`` is what the
    user asked for (a name, a+b, or a file)."""

    name: str
    steps: list[RecipeStep] = field(default_factory=list)
    deployment: Deployment = field(default_factory=Deployment)
    version: ClassVar[int] = 1

    def __post_init__(self) -> None:
        for i, step in enumerate(self.steps):
            if step.prepares:
                self._prepared_by(i)
        steps = self.deployment.num_inference_steps
        if steps is not None and steps < 3 and any(s.kind == "cache_auto" for s in self.steps):
            raise RecipeError(
                f"a cache schedule needs at least 3 denoising steps; the recipe deploys at {steps}"
            )

    def _prepared_by(self, i: int) -> str:
        step = self.steps[i]
        later = [s.kind for s in self.steps[i + 1 :] if s.kind in step.prepares]
        if not later:
            raise RecipeError(
                f"recipe step {step.kind!r} only prepares {' or '.join(step.prepares)}; the recipe must apply "
                f"one of them after it (e.g. 'w8a8-static+smoothquant')"
            )
        target = getattr(step, "target", None)
        if target is not None and target not in later:
            raise RecipeError(
                f"recipe step {step.kind!r} targets {target!r} but the recipe applies {later[0]!r} after it"
            )
        return target or later[0]

    def target_of(self, step: RecipeStep) -> str | None:
        """The kind ``step`` prepares in this recipe: its own ``target``, else the first later step
        it can prepare; None for a step that prepares nothing."""
        return self._prepared_by(self.steps.index(step)) if step.prepares else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "deployment": self.deployment.to_dict(),
            "steps": [s.to_dict() for s in self.steps],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RecipeConfig:
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
            raise RecipeError("a recipe must be an object with a 'steps' list")
        if data.get("version", RecipeConfig.version) != RecipeConfig.version:
            raise RecipeError(f"recipe version {data.get('version')} is not supported (this sdkiln reads 1)")
        unknown = set(data) - {"name", "version", "deployment", "steps"}
        if unknown:
            raise RecipeError(f"a recipe has unknown fields: {', '.join(sorted(unknown))}")
        steps = [dict(s) if isinstance(s, dict) else s for s in data["steps"]]
        deployment = _lift_step_counts(steps, Deployment.from_dict(data.get("deployment", {})))
        return RecipeConfig(
            name=str(data.get("name", "custom")),
            steps=[RecipeStep.from_dict(s) for s in steps],
            deployment=deployment,
        )
