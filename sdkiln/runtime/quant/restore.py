"""The ``modules`` section: the quantized layers a manifest names, swapped in before the weights load.

``manifest["modules"]`` maps a Linear's name to ``{"scheme": ..., **params}`` (and ``"smooth":
true`` when SmoothQuant left it an input multiplier). At ``build`` each named ``nn.Linear`` of the
meta transformer is replaced by its scheme's runtime class built empty on the meta device, so the
safetensors load into it with ``assign=True``; at ``attach``, a transformer with per-step modules
gets the pipeline's step tracker.
"""

from __future__ import annotations

import inspect
import math

from torch import nn

from sdkiln.errors import PackageError
from sdkiln.runtime.denoising import attach_step_tracker, needs_step_tracker
from sdkiln.runtime.quant import quant_module, scheme_classes
from sdkiln.runtime.quant.smooth import SmoothedLinear
from sdkiln.runtime.restore import RestoreContext, Section

MAX_PARAM = 1 << 31


def _check_params(layer: str, scheme: str, params: dict) -> None:
    """Each parameter is one the scheme's constructor takes, of the type it declares: ``true`` is
    not the integer 1 and ``1.0`` not an int (a manifest field of the wrong type is refused, not
    coerced)."""
    signature = inspect.signature(quant_module(scheme).__init__).parameters
    for key, value in params.items():
        where = f"manifest.json: layer {layer!r} ({scheme}) {key!r}"
        param = signature.get(key)
        if param is None or param.kind is not param.KEYWORD_ONLY:
            raise PackageError(f"{where}: not a parameter of {scheme}")
        if param.annotation in ("int", int) and not (type(value) is int and 0 <= value < MAX_PARAM):
            raise PackageError(f"{where}: must be an integer in [0, 2**31), got {value!r}")
        if param.annotation in ("float", float) and not (
            type(value) in (int, float) and math.isfinite(value)
        ):
            raise PackageError(f"{where}: must be a finite number, got {value!r}")


def swap_into(model: nn.Module, modules: dict, what: str = "the transformer") -> None:
    """Replace each ``nn.Linear`` of ``model`` (built on meta) that ``modules`` names by its scheme's
    module, built empty on meta: the manifest's ``modules``, or a text encoder's
    (``runtime.quant.encoders``); ``what`` names the model in errors."""
    if not isinstance(modules, dict):
        raise PackageError(f"manifest.json: the quantized layers of {what} must be an object")
    for name, info in modules.items():
        if not isinstance(info, dict):
            raise PackageError(f"manifest.json: layer {name!r} must be an object with a 'scheme'")
        params = dict(info)
        scheme = params.pop("scheme", None)
        if scheme not in scheme_classes():
            raise PackageError(
                f"manifest.json: layer {name!r} has unknown scheme {scheme!r}; this sdkiln runs "
                f"{sorted(scheme_classes())}"
            )
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, leaf)
        except AttributeError:
            raise PackageError(f"manifest.json: layer {name!r} does not exist in {what}") from None
        if not isinstance(linear, nn.Linear):
            raise PackageError(f"manifest.json: layer {name!r} is a {type(linear).__name__}, not a Linear")
        smooth = params.pop("smooth", False)
        if not isinstance(smooth, bool):
            raise PackageError(f"manifest.json: layer {name!r} has a non-boolean 'smooth' ({smooth!r})")
        _check_params(name, scheme, params)
        try:
            module = quant_module(scheme)(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                linear.weight.dtype,
                "meta",
                **params,
            )
        except (TypeError, ValueError) as exc:
            raise PackageError(
                f"manifest.json: layer {name!r} cannot be built as {scheme} with {params}: {exc}"
            ) from None
        setattr(parent, leaf, SmoothedLinear(module, linear.in_features, "meta") if smooth else module)


def swap_modules(ctx: RestoreContext) -> None:
    swap_into(ctx.transformer, ctx.manifest["modules"])


def attach_step_tracking(ctx: RestoreContext) -> None:
    if needs_step_tracker(ctx.transformer):
        attach_step_tracker(ctx.pipeline, ctx.transformer_attr)


SECTION = Section(
    name="modules",
    present=lambda manifest: bool(manifest.get("modules")),
    build=swap_modules,
    attach=attach_step_tracking,
)
