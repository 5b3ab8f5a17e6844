"""Quantization recipe steps: one scheme on every chosen layer, SmoothQuant before an int8 scheme,
and quant_auto's per-layer mix. Each config's ``kind`` is its runtime class's ``recipe_kind``
(``sdkiln.runtime.quant``); ``module_params()`` is what the step passes to that class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from sdkiln.configs.recipe import RecipeStep, register_step

WEIGHT_ROUNDINGS = ("nearest", "gptq")


def _patterns(value) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise ValueError("exclude must be a list of fnmatch patterns")
    return tuple(value)


def _check_samples(cfg) -> None:
    if cfg.calib_samples < 1:
        raise ValueError("calib_samples must be >= 1")


@dataclass
class QuantStep(RecipeStep):
    """A step that quantizes the ``nn.Linear`` layers inside the transformer blocks, except the
    family's float list and the fnmatch patterns in ``exclude``."""

    order: ClassVar[int] = 20
    quantizes: ClassVar[bool] = True
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)

    def module_params(self) -> dict[str, Any]:
        """Keyword arguments of the runtime class's ``from_linear`` for this step's layers."""
        return {}

    def scheme_kinds(self) -> tuple[str, ...]:
        """The recipe kinds of the schemes this step may give a layer (its own kind)."""
        return (self.kind,)


@dataclass
class WeightRounding:
    """How a weight-quantizing step rounds onto its grid: ``"nearest"`` (no calibration), or
    ``"gptq"``: GPTQ against each layer's input second moments from ``calib_samples`` calibration
    prompts (``sdkiln.optimizer.quant.gptq``; same scales, same files, other integers), with
    ``gptq_damp`` as the Hessian damping and ``max_hessian_mb`` as the memory the [K, K] matrices of
    one calibration pass may take (more layers than fit take more passes)."""

    weight_rounding: str = "nearest"
    calib_samples: int = 8
    gptq_damp: float = 0.01
    max_hessian_mb: int = 2048

    def _check_rounding(self) -> None:
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ValueError(
                f"weight_rounding must be one of {', '.join(WEIGHT_ROUNDINGS)}, got {self.weight_rounding!r}"
            )
        _check_samples(self)
        if not self.gptq_damp > 0:
            raise ValueError("gptq_damp must be > 0")
        if self.max_hessian_mb < 1:
            raise ValueError("max_hessian_mb must be >= 1")


@register_step
@dataclass
class W8A8DynamicConfig(WeightRounding, QuantStep):
    """int8 per-output-channel symmetric weights; int8 per-token symmetric activations, computed at
    run time. Needs no calibration data unless its weights are rounded by GPTQ (``WeightRounding``)."""

    kind: ClassVar[str] = "w8a8_dynamic"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.weights"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_rounding()


@register_step
@dataclass
class SmoothQuantConfig(RecipeStep):
    """SmoothQuant before an int8 step: per-layer alpha searched on ``alphas`` by output error.

    With ``fold`` the smoothing factor is folded into the preceding adaLN modulation where the
    family's spec says that is exact; every other layer (all of them without ``fold``) keeps an input
    multiplier (``<layer>.div.mul_scale``). MindIE SD applies only multipliers (it loads no float
    weights), so ``optimize(format="ascend")`` turns ``fold`` off. The int8 step it prepares (its
    error decides alpha: a static range, or per-token dynamic scales) is the recipe's next one, or
    ``target`` when given.
    """

    kind: ClassVar[str] = "smoothquant"
    order: ClassVar[int] = 10
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.smoothquant"
    prepares: ClassVar[tuple[str, ...]] = ("w8a8_static", "w8a8_timestep", "w8a8_dynamic")
    alphas: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    exclude: tuple[str, ...] = ()
    calib_samples: int = 8
    target: str | None = None
    fold: bool = True

    def __post_init__(self) -> None:
        self.exclude = _patterns(self.exclude)
        if not isinstance(self.fold, bool):
            raise ValueError(f"fold must be true or false, got {self.fold!r}")
        if self.target is not None and self.target not in self.prepares:
            raise ValueError(
                f"target must be one of {', '.join(self.prepares)} (or null: the recipe's next one)"
            )
        self.alphas = tuple(float(a) for a in self.alphas)
        if not self.alphas or not all(0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError("alphas must be a non-empty list of values in [0, 1]")
        _check_samples(self)


@register_step
@dataclass
class W8A8StaticConfig(QuantStep):
    """W8A8 static: per-tensor asymmetric activations from calibration, per-channel symmetric weights."""

    kind: ClassVar[str] = "w8a8_static"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.w8a8_static"
    calib_samples: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_samples(self)


@register_step
@dataclass
class W8A8TimestepConfig(QuantStep):
    """W8A8 with static activation parameters per denoising step, dynamic for the first k steps.

    k is searched over ``dynamic_steps`` by final-output error on the calibration prompts. Each
    step's activation range is the union of the observed ranges of the steps within ``step_window``
    of it (0: its own range only), which keeps a few calibration samples from clipping the next
    ones' inputs (the default's measurement: docs/benchmarks.md).
    """

    kind: ClassVar[str] = "w8a8_timestep"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.w8a8_timestep"
    dynamic_steps: tuple[int, ...] = (0, 1, 2, 4, 8)
    step_window: int = 4
    calib_samples: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dynamic_steps = tuple(int(k) for k in self.dynamic_steps)
        if not self.dynamic_steps or min(self.dynamic_steps) < 0:
            raise ValueError("dynamic_steps must be a non-empty list of step counts >= 0")
        if self.step_window < 0:
            raise ValueError("step_window must be >= 0")
        _check_samples(self)


@register_step
@dataclass
class FP8DynamicConfig(QuantStep):
    """float8_e4m3fn per-channel weights, per-token dynamic float8 activations."""

    kind: ClassVar[str] = "fp8_dynamic"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.weights"


@register_step
@dataclass
class W8A16Config(WeightRounding, QuantStep):
    """Weight-only int8, per-channel symmetric; activations stay in float. Rounding: ``WeightRounding``."""

    kind: ClassVar[str] = "w8a16"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.weights"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_rounding()


@register_step
@dataclass
class W4A16Config(WeightRounding, QuantStep):
    """Weight-only int4, group-wise symmetric (``group_size`` 64 or 128), two values per byte.
    Rounding: ``WeightRounding``."""

    kind: ClassVar[str] = "w4a16"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.weights"
    group_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_rounding()
        if self.group_size not in (64, 128):
            raise ValueError("group_size must be 64 or 128")

    def module_params(self) -> dict[str, Any]:
        return {"group_size": self.group_size}


def quant_auto_schemes() -> tuple[str, ...]:
    """The scheme kinds quant_auto can give a layer: every runtime scheme class's ``recipe_kind``."""
    from sdkiln.runtime.quant import by_recipe_kind  # the runtime classes are the single source

    return tuple(by_recipe_kind())


@register_step
@dataclass
class QuantAutoConfig(QuantStep):
    """Mixed precision under a quality floor: each layer takes ``scheme`` if its output SQNR on
    calibration data is at least ``sqnr_floor_db``, else the first fallback that reaches it, else float.

    Activation ranges (for schemes built from them) come from ``calib_samples`` samples; the SQNRs
    from ``sensitivity_samples`` more (an average converges faster than a range, and each sample
    runs every candidate scheme on every layer). The floor, 40 dB, is a 1% RMS output error per
    layer; what it gives on the embedded model is in docs/benchmarks.md.
    """

    kind: ClassVar[str] = "quant_auto"
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.quant_auto"
    scheme: str = "w8a8_static"
    fallbacks: tuple[str, ...] = ("w8a8_dynamic",)
    sqnr_floor_db: float = 40.0
    calib_samples: int = 8
    sensitivity_samples: int = 4

    def scheme_kinds(self) -> tuple[str, ...]:
        return (self.scheme, *self.fallbacks)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.fallbacks = tuple(self.fallbacks)
        if self.sensitivity_samples < 1:
            raise ValueError("sensitivity_samples must be >= 1")
        order = (self.scheme, *self.fallbacks)
        known = quant_auto_schemes()
        unknown = [s for s in order if s not in known]
        if unknown:
            raise ValueError(f"quant_auto cannot use {unknown[0]!r}; its schemes are {', '.join(known)}")
        if len(set(order)) != len(order):
            raise ValueError(f"scheme and fallbacks must name each scheme once, got {list(order)}")
        if isinstance(self.sqnr_floor_db, bool) or not isinstance(self.sqnr_floor_db, int | float):
            raise ValueError(f"sqnr_floor_db must be a number of dB, got {self.sqnr_floor_db!r}")
        self.sqnr_floor_db = float(self.sqnr_floor_db)
        if not math.isfinite(self.sqnr_floor_db):
            raise ValueError("sqnr_floor_db must be finite")
        _check_samples(self)


TEXT_ENCODER_SCHEMES = ("w8a16", "w4a16", "w8a8_dynamic", "fp8_dynamic")
"""The schemes a text encoder's Linears can take: those built from the weight alone (no activation
ranges to calibrate, no denoising step to follow)."""


@register_step
@dataclass
class TextEncoderQuantConfig(RecipeStep):
    """Quantize the pipeline's text encoders: every ``nn.Linear`` of each, but the fnmatch patterns in
    ``exclude``, takes ``scheme`` with that scheme's default parameters (W4A16: groups of 128), built
    by the same runtime classes and run by the same kernels as the transformer's layers.

    A quality gate decides per encoder: its outputs on ``calib_samples`` calibration prompts (the
    tensors of what it returns, every one the pipeline could read) are computed with the scheme and
    in float, and the encoder is quantized only if the lowest output SQNR reaches ``sqnr_floor_db``
    (None: the family's ``ModelSpec.text_encoder_floor_db``); below it the encoder stays in float and
    the step warns and records why. ``encoders`` names the components to take (default: every
    ``text_encoder*`` the pipeline has).
    """

    kind: ClassVar[str] = "text_encoder_quant"
    order: ClassVar[int] = 5
    """First: every later step calibrates, searches and measures with the encoders as deployed."""
    per_transformer: ClassVar[bool] = False
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.encoders"
    scheme: str = "w8a16"
    encoders: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    calib_samples: int = 4
    sqnr_floor_db: float | None = None

    def __post_init__(self) -> None:
        if self.scheme not in TEXT_ENCODER_SCHEMES:
            raise ValueError(
                f"scheme must be one of {', '.join(TEXT_ENCODER_SCHEMES)} (the schemes built from the "
                f"weight alone), got {self.scheme!r}"
            )
        self.exclude = _patterns(self.exclude)
        if isinstance(self.encoders, str) or not all(
            isinstance(n, str) and n.startswith("text_encoder") for n in self.encoders
        ):
            raise ValueError("encoders must be a list of component names (text_encoder, text_encoder_2, ...)")
        self.encoders = tuple(self.encoders)
        _check_samples(self)
        if self.sqnr_floor_db is not None:
            if isinstance(self.sqnr_floor_db, bool) or not isinstance(self.sqnr_floor_db, int | float):
                raise ValueError(f"sqnr_floor_db must be a number of dB or null, got {self.sqnr_floor_db!r}")
            self.sqnr_floor_db = float(self.sqnr_floor_db)
            if not math.isfinite(self.sqnr_floor_db):
                raise ValueError("sqnr_floor_db must be finite (or null: the family's floor)")


ATTENTION_ROTATIONS = ("auto", "on", "off")


@register_step
@dataclass
class AttentionQuantConfig(RecipeStep):
    """Quantized attention (``sdkiln.optimizer.quant.attention``, ``docs/attention-quantization.md``):
    ``sdkiln::quantized_attention`` with Q and K in ``qk`` (INT8 or FP8) and P and V in ``pv`` (FP8,
    INT8 or float), decided per attention layer and denoising step.

    On ``calib_samples`` calibration samples every routed attention call is computed in float (what the
    model runs on) and quantized, with and without a Hadamard rotation of Q and K (``rotate="auto"``:
    per layer, the one of higher mean SQNR; ``"on"``/``"off"`` fix it); a (layer, step) runs quantized
    where the lowest SQNR of its outputs over the samples reaches ``sqnr_floor_db``. The plan then runs
    end to end on the same samples: where the mean PSNR of the images against float attention misses
    ``psnr_floor_db``, the per-call floor rises by ``floor_step_db``, up to ``retries`` times.

    ``layout="mindie"`` (FP8 only; the recipe ``attn-fp8-ascend``) calibrates ``sdkiln::fp8_block_attention``
    instead: MindIE SD's FP8RotateQuantFA arithmetic (Q per 128 tokens, K and V per 256, no K smoothing, P
    unquantized), so that the decisions ``export-ascend`` writes were measured on what Ascend computes.
    """

    kind: ClassVar[str] = "attention_quant"
    order: ClassVar[int] = 40
    """After the linears' quantization (attention's inputs as deployed), before block-sparse attention
    and the cache search (which measure with it)."""
    transform_module: ClassVar[str] = "sdkiln.optimizer.quant.attention"
    qk: str = "int8"
    pv: str = "fp8"
    rotate: str = "auto"
    layout: str = "sage"
    sqnr_floor_db: float = 30.0
    psnr_floor_db: float = 38.0
    """An error 38 dB below the image adds about 1 dB at most to a package at 31 dB (powers add)."""
    floor_step_db: float = 3.0
    retries: int = 3
    calib_samples: int = 2

    def __post_init__(self) -> None:
        from sdkiln.kernels.ops.quantized_attention import PV_FORMATS, QK_FORMATS

        if self.qk not in QK_FORMATS or self.pv not in PV_FORMATS:
            raise ValueError(f"qk is one of {', '.join(QK_FORMATS)} and pv one of {', '.join(PV_FORMATS)}")
        from sdkiln.runtime.attention.quantized import check_layout

        check_layout(self.layout, self.qk, self.pv)
        if self.rotate not in ATTENTION_ROTATIONS:
            raise ValueError(f"rotate is one of {', '.join(ATTENTION_ROTATIONS)}, got {self.rotate!r}")
        for name in ("sqnr_floor_db", "psnr_floor_db", "floor_step_db"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of dB, got {value!r}")
            setattr(self, name, float(value))
        if self.floor_step_db <= 0:
            raise ValueError("floor_step_db must be positive")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        _check_samples(self)
