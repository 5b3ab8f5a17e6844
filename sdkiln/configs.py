"""Every user-facing config: boring, versioned, JSON round-trippable (STYLE.md habit 2).

A recipe is an ordered list of step configs. Each step config names its ``kind``; on load the
kind is resolved from an allow-list (``STEP_CONFIGS``), never unpickled. Adding a technique is one
config class registered here plus one transform registered in ``sdkiln.optimizer``.
"""

from __future__ import annotations

import dataclasses
import math
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
            raise RecipeError(
                f"step {kind!r} has config version {version}; this sdkiln reads version {cls.version}"
            )
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(names) - {"kind", "version"}
        if unknown:
            raise RecipeError(f"step {kind!r} has unknown fields: {', '.join(sorted(unknown))}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"step {kind!r}: {exc}") from None


WEIGHT_ROUNDINGS = ("nearest", "gptq")


@dataclass
class WeightRounding:
    """How a weight-quantizing step rounds onto its grid: ``"nearest"`` (no calibration), or
    ``"gptq"``: GPTQ against each layer's input second moments from ``calib_samples`` calibration
    prompts (``sdkiln.optimizer.gptq``; same scales, same files, other integers), with ``gptq_damp``
    as the Hessian damping and ``max_hessian_mb`` as the memory the [K, K] matrices of one
    calibration pass may take (more layers than fit take more passes)."""

    weight_rounding: str = "nearest"
    calib_samples: int = 8
    calib_steps: int | None = None
    gptq_damp: float = 0.01
    max_hessian_mb: int = 2048


def _check_rounding(cfg: WeightRounding) -> None:
    if cfg.weight_rounding not in WEIGHT_ROUNDINGS:
        raise ValueError(
            f"weight_rounding must be one of {', '.join(WEIGHT_ROUNDINGS)}, got {cfg.weight_rounding!r}"
        )
    _check_calibration(cfg)
    if not cfg.gptq_damp > 0:
        raise ValueError("gptq_damp must be > 0")
    if cfg.max_hessian_mb < 1:
        raise ValueError("max_hessian_mb must be >= 1")


def _patterns(value) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise ValueError("exclude must be a list of fnmatch patterns")
    return tuple(value)


@register_config
@dataclass
class W8A8DynamicConfig(WeightRounding, StepConfig):
    """int8 per-output-channel symmetric weights; int8 per-token symmetric activations, computed at run time.

    Applies to every ``nn.Linear`` inside the transformer blocks except the family's float list and
    the extra fnmatch patterns in ``exclude``. Needs no calibration data unless its weights are
    rounded by GPTQ (``WeightRounding``).
    """

    kind: ClassVar[str] = "w8a8_dynamic"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.w8a8_dynamic"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        _check_rounding(self)


def _check_calibration(cfg) -> None:
    if cfg.calib_samples < 1:
        raise ValueError("calib_samples must be >= 1")
    if cfg.calib_steps is not None and cfg.calib_steps < 1:
        raise ValueError("calib_steps must be >= 1 (or null for the deployment steps)")


@register_config
@dataclass
class SmoothQuantConfig(StepConfig):
    """SmoothQuant before an int8 step: per-layer alpha searched on ``alphas`` by output error.

    The smoothing factor is folded into the preceding modulation/norm where that is exact; otherwise
    the layer keeps an input multiplier (``<layer>.div.mul_scale``). ``target`` is the int8 step it
    prepares (its error decides alpha: a static range, or per-token dynamic scales); a recipe sets it
    from the step that follows.
    """

    kind: ClassVar[str] = "smoothquant"
    order: ClassVar[int] = 10
    transform_module: ClassVar[str] = "sdkiln.optimizer.smoothquant"
    prepares: ClassVar[tuple[str, ...]] = ("w8a8_static", "w8a8_timestep", "w8a8_dynamic")
    alphas: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    exclude: tuple[str, ...] = ()
    calib_samples: int = 8
    calib_steps: int | None = None
    target: str | None = None

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        if self.target is not None and self.target not in self.prepares:
            raise ValueError(
                f"target must be one of {', '.join(self.prepares)} (or null: the recipe's next one)"
            )
        self.alphas = tuple(float(a) for a in self.alphas)
        if not self.alphas or not all(0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError("alphas must be a non-empty list of values in [0, 1]")
        _check_calibration(self)


@register_config
@dataclass
class W8A8StaticConfig(StepConfig):
    """W8A8 static: per-tensor asymmetric activations from calibration, per-channel symmetric weights."""

    kind: ClassVar[str] = "w8a8_static"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.w8a8_static"
    exclude: tuple[str, ...] = ()
    calib_samples: int = 8
    calib_steps: int | None = None

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        _check_calibration(self)


@register_config
@dataclass
class W8A8TimestepConfig(StepConfig):
    """W8A8 with static activation parameters per denoising step, dynamic for the first k steps.

    k is searched over ``dynamic_steps`` by final-output error on the calibration prompts. Each
    step's activation range is the union of the observed ranges of the steps within ``step_window``
    of it (0: its own range only), which keeps a few calibration samples from clipping the next
    ones' inputs; the default 4 was chosen on the embedded model (docs/benchmarks.md).
    """

    kind: ClassVar[str] = "w8a8_timestep"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.w8a8_timestep"
    exclude: tuple[str, ...] = ()
    dynamic_steps: tuple[int, ...] = (0, 1, 2, 4, 8)
    step_window: int = 4
    calib_samples: int = 8
    calib_steps: int | None = None

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        self.dynamic_steps = tuple(int(k) for k in self.dynamic_steps)
        if not self.dynamic_steps or min(self.dynamic_steps) < 0:
            raise ValueError("dynamic_steps must be a non-empty list of step counts >= 0")
        if self.step_window < 0:
            raise ValueError("step_window must be >= 0")
        _check_calibration(self)


@register_config
@dataclass
class FP8DynamicConfig(StepConfig):
    """float8_e4m3fn per-channel weights, per-token dynamic float8 activations."""

    kind: ClassVar[str] = "fp8_dynamic"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.fp8_dynamic"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)


@register_config
@dataclass
class W8A16Config(WeightRounding, StepConfig):
    """Weight-only int8, per-channel symmetric; activations stay in float. Rounding: ``WeightRounding``."""

    kind: ClassVar[str] = "w8a16"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.weight_only"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        _check_rounding(self)


@register_config
@dataclass
class W4A16Config(WeightRounding, StepConfig):
    """Weight-only int4, group-wise symmetric (``group_size`` 64 or 128), two values per byte.
    Rounding: ``WeightRounding``."""

    kind: ClassVar[str] = "w4a16"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.weight_only"
    exclude: tuple[str, ...] = ()
    group_size: int = 128

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        _check_rounding(self)
        if self.group_size not in (64, 128):
            raise ValueError("group_size must be 64 or 128")


QUANT_AUTO_SCHEMES = ("w8a8_static", "w8a8_timestep", "w8a8_dynamic", "fp8_dynamic", "w8a16", "w4a16")
"""The step kinds quant_auto can give a layer: each can be applied to one layer on its own."""


@register_config
@dataclass
class QuantAutoConfig(StepConfig):
    """Mixed precision under a quality floor: each layer takes ``scheme`` if its output SQNR on
    calibration data is at least ``sqnr_floor_db``, else the first fallback that reaches it, else float.

    Activation ranges (for w8a8_static / w8a8_timestep) come from ``calib_samples`` samples; the SQNRs
    from ``sensitivity_samples`` more (an average converges faster than a range, and each sample
    runs every candidate scheme on every layer; on fmnist-flux 4 samples land within 0.35 dB of 8).

    The floor, 40 dB, is a 1% RMS output error per layer. On the shipped fmnist-flux (bench/quant.py,
    100 samples, 28 steps) it mixes W8A8 and W8A8_DYNAMIC for an image PSNR of 49.7 dB against the
    float model, where all-static gives 44.7 and all-dynamic 50.8 (docs/benchmarks.md)."""

    kind: ClassVar[str] = "quant_auto"
    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant_auto"
    scheme: str = "w8a8_static"
    fallbacks: tuple[str, ...] = ("w8a8_dynamic",)
    sqnr_floor_db: float = 40.0
    exclude: tuple[str, ...] = ()
    calib_samples: int = 8
    sensitivity_samples: int = 4
    calib_steps: int | None = None

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        self.fallbacks = tuple(self.fallbacks)
        if self.sensitivity_samples < 1:
            raise ValueError("sensitivity_samples must be >= 1")
        order = (self.scheme, *self.fallbacks)
        unknown = [s for s in order if s not in QUANT_AUTO_SCHEMES]
        if unknown:
            raise ValueError(
                f"quant_auto cannot use {unknown[0]!r}; its schemes are {', '.join(QUANT_AUTO_SCHEMES)}"
            )
        if len(set(order)) != len(order):
            raise ValueError(f"scheme and fallbacks must name each scheme once, got {list(order)}")
        if isinstance(self.sqnr_floor_db, bool) or not isinstance(self.sqnr_floor_db, int | float):
            raise ValueError(f"sqnr_floor_db must be a number of dB, got {self.sqnr_floor_db!r}")
        self.sqnr_floor_db = float(self.sqnr_floor_db)
        if not math.isfinite(self.sqnr_floor_db):
            raise ValueError("sqnr_floor_db must be finite")
        _check_calibration(self)


@register_config
@dataclass
class CacheAutoConfig(StepConfig):
    """A static cache schedule searched on measured output error (``sdkiln.optimizer.cache_search``).

    The schedule runs ``actions`` (``skip``, ``partial:F:B``) for at most ``max_reuse`` steps in a row
    after a full step; the first ``min_full`` steps and the last step are full. Candidates come from
    ``budgets`` block-evaluation budgets in the search's dynamic program and from the fixed-interval family;
    each is confirmed end to end on ``calib_samples`` calibration samples, then up to ``refine`` more
    confirmations (``refine_tries`` neighbours per round) refine the cheapest one meeting the floor.
    The chosen schedule is the cheapest confirmed one whose mean PSNR against the uncached model on
    the calibration samples is at least ``psnr_floor_db`` and whose 5th percentile is at least
    ``psnr_p5_floor_db``.
    """

    kind: ClassVar[str] = "cache_auto"
    order: ClassVar[int] = 50
    transform_module: ClassVar[str] = "sdkiln.optimizer.cache_search"
    actions: tuple[str, ...] = ("skip", "skip~", "partial:1:1")
    max_reuse: int = 4
    min_full: int = 1
    psnr_floor_db: float = 30.0
    psnr_p5_floor_db: float = 25.0
    calib_samples: int = 4
    eval_samples: int = 8
    budgets: int = 16
    refine: int = 12
    refine_tries: int = 3
    steps: int | None = None
    """Denoising steps the schedule is searched for; None for the family's deployment default."""
    guard: bool = False
    """Ship a guard (``runtime.cache.guard``): a reuse step whose stack input changed more than
    ``guard_quantile`` of the calibration samples' change at that step times ``guard_margin`` runs full."""
    guard_quantile: float = 1.0
    guard_margin: float = 1.5

    def __post_init__(self) -> None:
        from sdkiln.runtime.cache.schedule import Action  # the runtime owns the action grammar

        self.actions = tuple(str(a) for a in self.actions)
        if not self.actions:
            raise ValueError("cache_auto needs at least one reuse action (skip, partial:F:B)")
        for a in self.actions:
            if Action.parse(a).kind == "full":
                raise ValueError(
                    "cache_auto actions are the reuse actions (skip, partial:F:B); full is implied"
                )
        if self.max_reuse < 1 or self.min_full < 1:
            raise ValueError("max_reuse and min_full must be >= 1")
        if self.calib_samples < 1 or self.eval_samples < 1:
            raise ValueError("calib_samples and eval_samples must be >= 1")
        if self.budgets < 1 or self.refine < 0 or self.refine_tries < 1:
            raise ValueError("need budgets >= 1, refine >= 0 and refine_tries >= 1")
        if self.steps is not None and self.steps < 3:
            raise ValueError("a cache schedule needs at least 3 steps")
        if not 0.0 < self.guard_quantile <= 1.0 or self.guard_margin < 1.0:
            raise ValueError("need 0 < guard_quantile <= 1 and guard_margin >= 1")


@dataclass
class RecipeConfig:
    """An ordered list of steps. ``name`` is what the user asked for (a name, a+b, or a file)."""

    name: str
    steps: list[StepConfig] = field(default_factory=list)
    version: ClassVar[int] = 1

    def __post_init__(self) -> None:
        for i, step in enumerate(self.steps):
            if not step.prepares:
                continue
            later = [s.kind for s in self.steps[i + 1 :] if s.kind in step.prepares]
            if not later:
                raise RecipeError(
                    f"step {step.kind!r} only prepares {' or '.join(step.prepares)}; the recipe must apply one "
                    f"of them after it (e.g. 'w8a8-static+smoothquant')"
                )
            target = getattr(step, "target", later[0])
            if target is None:
                step.target = later[0]
            elif target not in later:
                raise RecipeError(
                    f"step {step.kind!r} targets {target!r} but the recipe applies {later[0]!r} after it"
                )

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
