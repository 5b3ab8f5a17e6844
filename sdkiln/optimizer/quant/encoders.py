"""The text-encoder quantization step (``TextEncoderQuantConfig``): the pipeline's text encoders'
Linears in a weight-built scheme, behind a measured quality gate.

1. **capture**: the family's calibration prompts (``PromptLoop``'s prompts, seeds and deployment
   call; a user's forward loop is not used, since it would be stopped at its first transformer
   call) run through the pipeline until its first transformer call, which is stopped: no denoising
   step runs. Each encoder's calls (their arguments: token ids and masks) are kept, and the floating
   tensors the transformer was given: the conditioning, as the pipeline made it from the encoders'
   outputs (the hidden state it picks, cropped, masked, concatenated).
2. **measure**: per encoder, the others float, every chosen Linear computes through the scheme's
   module, built from the float weight for each call and dropped after it (one layer's quantized
   copy alive at a time: the encoder is never held twice). The prompts run again to the transformer;
   the **gate** reads the lowest SQNR of the transformer's inputs against the float run's (energies
   summed over the prompts; inputs the encoder does not reach are equal and not counted). The
   encoder's own outputs (every floating tensor it returns, ``pooler_output`` and each of
   ``hidden_states`` included, read by the pipeline or not) are recorded too.
3. **decide**: at or above the floor (``sqnr_floor_db``, default the family's
   ``text_encoder_floor_db``) each chosen Linear is replaced by the scheme's module, the float layer
   freed as its module comes (the same modules, so the same outputs, as measured); below it the
   encoder stays float, and the step warns and records the measurement. With several encoders
   quantized, the conditioning they give together is measured once more and recorded.

The manifest section ``text_encoders`` names, per quantized encoder, its layers as ``modules``
does for the transformer (``sdkiln.runtime.quant.encoders`` rebuilds them at load); the step's
record and the quality report carry the measured SQNRs.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs import RECIPE_STEPS, TextEncoderQuantConfig
from sdkiln.metrics import ratio_db
from sdkiln.optimizer.plan import Phase, register_plan
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.quant import by_recipe_kind
from sdkiln.runtime.quant.encoders import SECTION_NAME

Call = tuple[tuple[Any, ...], dict[str, Any]]


class _Stop(Exception):
    """Raised by the transformer's first call: the prompts are encoded, nothing else is needed."""


def text_encoder_names(pipeline: Any, asked: tuple[str, ...]) -> list[str]:
    """The text encoders the step takes: ``asked``, else every ``text_encoder*`` model component."""
    present = [
        n for n, c in pipeline.components.items() if n.startswith("text_encoder") and isinstance(c, nn.Module)
    ]
    if not present:
        raise ValueError("text_encoder_quant: the pipeline has no text encoder")
    missing = [n for n in asked if n not in present]
    if missing:
        raise ValueError(
            f"text_encoder_quant: the pipeline has no text encoder {missing[0]!r} (it has {', '.join(present)})"
        )
    return list(asked) or present


def run_to_transformer(
    ctx: TransformContext, samples: int, names: list[str] = ()
) -> tuple[dict[str, list[Call]], list[dict[str, torch.Tensor]]]:
    """``samples`` calibration prompts through the pipeline, each stopped at its first transformer
    call: the calls of each encoder of ``names``, and per prompt the floating tensors that first
    transformer call was given (by argument name), the conditioning the encoders produced."""
    pipeline, spec = ctx.pipeline, ctx.spec
    loop = PromptLoop(spec, samples, ctx.call_kwargs())
    call = loop.call_kwargs()
    calls: dict[str, list[Call]] = {n: [] for n in names}
    given: list[dict[str, torch.Tensor]] = []
    handles = []

    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        given.append(dict(_outputs({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs})))
        raise _Stop

    try:
        for name in names:
            handles.append(
                getattr(pipeline, name).register_forward_pre_hook(
                    lambda _m, args, kwargs, name=name: calls[name].append((args, kwargs)), with_kwargs=True
                )
            )
        for attr in spec.transformer_attrs:  # ahead of the phase meter's counter: no forward runs
            handles.append(
                getattr(pipeline, attr).register_forward_pre_hook(stop, prepend=True, with_kwargs=True)
            )
        pipeline.set_progress_bar_config(disable=True)
        prompts, seeds = loop.plan()
        with torch.inference_mode():
            for prompt, seed in tqdm(
                list(zip(prompts, seeds, strict=True)), desc="encode", unit="prompt", leave=False
            ):
                generator = torch.Generator("cpu").manual_seed(seed)
                with contextlib.suppress(_Stop):
                    pipeline(prompt=prompt, generator=generator, **call, **spec.condition(call))
    finally:
        for handle in handles:
            handle.remove()
    for name, got in calls.items():
        if not got:
            raise ValueError(
                f"text_encoder_quant: the pipeline did not call {name} on the calibration prompts"
            )
    if len(given) != len(prompts):
        raise ValueError("text_encoder_quant: the pipeline returned without calling its transformer")
    return calls, given


def _sqnr(pairs: Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]) -> dict[str, float]:
    """SQNR in dB per tensor name over (reference, approximation) pairs, energies summed first."""
    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    for ref, out in pairs:
        for key, value in ref.items():
            r = value.double()
            signal[key] = signal.get(key, 0.0) + float(r.square().sum())
            noise[key] = noise.get(key, 0.0) + float((out[key].double() - r).square().sum())
    return {k: ratio_db(signal[k], noise[k]) for k in signal}


def conditioning_sqnr(
    reference: list[dict[str, torch.Tensor]], given: list[dict[str, torch.Tensor]]
) -> dict[str, float]:
    """SQNR of each transformer input the change reached (an input it left equal, the latents, the
    timestep, is not listed)."""
    return {k: v for k, v in _sqnr(zip(reference, given, strict=True)).items() if v != math.inf}


def _outputs(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating tensor of an encoder's output, named by where it sits (``hidden_states[3]``)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield prefix or "output", value
    elif isinstance(value, dict):  # a transformers ModelOutput is an OrderedDict of its set fields
        for key, item in value.items():
            yield from _outputs(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _outputs(item, f"{prefix}[{i}]")


def chosen_linears(encoder: nn.Module, exclude: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the encoder's Linears the step takes, those ``exclude`` keeps float)."""
    chosen, kept = [], []
    for name, module in encoder.named_modules():
        if isinstance(module, nn.Linear):
            (kept if any(fnmatch.fnmatchcase(name, p) for p in exclude) else chosen).append(name)
    return chosen, kept


def applicable(
    encoder: nn.Module, layers: list[str], cls: type, params: dict
) -> tuple[list[str], dict[str, str]]:
    """(the layers the scheme can take, the others with why), each module built once and dropped.

    A layer whose weight is tied to another parameter (an ``lm_head`` sharing the token embedding)
    stays float. A layer of the model's ``_keep_in_fp32_modules`` (T5's and UMT5's ``wo``) is taken only by a
    scheme whose weight is int8: the model casts that layer's input to its weight's dtype unless the
    weight is int8 (transformers' rule for 8-bit weights), so an fp8 or packed-int4 weight would turn
    the input into fp8 or uint8."""
    keep = tuple(getattr(encoder, "_keep_in_fp32_modules", None) or ())
    owners: dict[int, list[str]] = {}
    for pname, param in encoder.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    taken, not_applicable = [], {}
    for name in layers:
        tied = [n for n in owners[id(encoder.get_submodule(name).weight)] if n != f"{name}.weight"]
        if tied:
            not_applicable[name] = (
                f"its weight is tied to {tied[0]} (the model ties them again when it loads)"
            )
            continue
        try:
            module = cls.from_linear(encoder.get_submodule(name), **params)
        except ValueError as exc:
            not_applicable[name] = str(exc)
            continue
        kept = next((part for part in name.split(".") if part in keep), None)
        if kept is not None and module.weight.dtype != torch.int8:
            not_applicable[name] = (
                f"{type(encoder).__name__} keeps {kept!r} in float32 and casts its input to its weight's dtype "
                f"unless int8; {cls.scheme} stores {str(module.weight.dtype).removeprefix('torch.')}"
            )
        else:
            taken.append(name)
    return taken, not_applicable


@contextlib.contextmanager
def _trial(encoder: nn.Module, layers: list[str], cls: type, params: dict) -> Iterator[None]:
    """Every layer of ``layers`` computes through the scheme's module, built from its float weight
    for each call and dropped after it."""

    def forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return cls.from_linear(linear, **params)(x)

    patched = [encoder.get_submodule(name) for name in layers]
    try:
        for linear in patched:
            linear.forward = forward.__get__(linear)  # an instance attribute: nn.Module.__call__ finds it
        yield
    finally:
        for linear in patched:
            linear.__dict__.pop("forward", None)


def measure_encoder(
    encoder: nn.Module, calls: list[Call], layers: list[str], cls: type, params: dict
) -> dict[str, float]:
    """SQNR in dB of each output of ``encoder`` with ``layers`` in the scheme, over ``calls``."""

    def pairs() -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        with torch.inference_mode():
            for args, kwargs in calls:
                ref = dict(_outputs(encoder(*args, **kwargs)))
                with _trial(encoder, layers, cls, params):
                    yield ref, dict(_outputs(encoder(*args, **kwargs)))

    return _sqnr(pairs())


def _swap(encoder: nn.Module, layers: list[str], cls: type, params: dict) -> dict[str, dict[str, Any]]:
    """Each of ``layers`` replaced by its scheme module, the float layer freed as it goes."""
    modules = {}
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        owner = encoder.get_submodule(parent)
        module = cls.from_linear(getattr(owner, leaf), **params)
        setattr(owner, leaf, module)
        modules[name] = {"scheme": module.scheme, **module.params()}
    return modules


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no infinity


@register_transform(TextEncoderQuantConfig)
def quantize_text_encoders(ctx: TransformContext, config: TextEncoderQuantConfig) -> TransformResult:
    cls = by_recipe_kind()[config.scheme]
    params = RECIPE_STEPS[config.scheme]().module_params()
    floor = ctx.spec.text_encoder_floor_db if config.sqnr_floor_db is None else config.sqnr_floor_db
    names = text_encoder_names(ctx.pipeline, config.encoders)
    calls, reference = run_to_transformer(ctx, config.calib_samples, names)
    record: dict[str, Any] = {"scheme": cls.scheme, **params, "sqnr_floor_db": floor, "encoders": {}}
    passed = {}
    for name in names:  # each measured alone, the others float
        encoder = getattr(ctx.pipeline, name)
        layers, kept = chosen_linears(encoder, config.exclude)
        if not layers:
            raise ValueError(f"text_encoder_quant: {name} has no Linear layer outside the step's excludes")
        taken, not_applicable = applicable(encoder, layers, cls, params)
        outputs = measure_encoder(encoder, calls[name], taken, cls, params)
        with _trial(encoder, taken, cls, params):
            conditioning = conditioning_sqnr(reference, run_to_transformer(ctx, config.calib_samples)[1])
        gate = min(conditioning.values(), default=math.inf)
        entry = {
            "sqnr_db": _finite(gate),
            "conditioning_sqnr_db": {k: _finite(v) for k, v in conditioning.items()},
            "output_sqnr_db": {k: _finite(v) for k, v in outputs.items()},
            "calls": len(calls[name]),
            "float": kept + sorted(not_applicable),
            "not_applicable": not_applicable,
        }
        if not taken:
            entry["decision"] = f"float: {cls.scheme} cannot take any of its Linears"
        elif gate >= floor:
            entry |= {"decision": "quantized", "quantized": len(taken)}
            passed[name] = taken
        else:
            entry["decision"] = (
                f"float: the transformer's conditioning keeps {gate:.1f} dB SQNR, below the floor {floor:g} dB"
            )
            warnings.warn(f"text_encoder_quant: {name} stays {entry['decision']}", stacklevel=2)
        record["encoders"][name] = entry
    section = {
        name: {"modules": _swap(getattr(ctx.pipeline, name), taken, cls, params)}
        for name, taken in passed.items()
    }
    if len(section) > 1:  # what the transformer gets from them together
        together = conditioning_sqnr(reference, run_to_transformer(ctx, config.calib_samples)[1])
        record["conditioning_sqnr_db"] = {k: _finite(v) for k, v in together.items()}
    return TransformResult(modules={}, record=record, sections={SECTION_NAME: section} if section else {})


@register_plan(TextEncoderQuantConfig)
def plan_text_encoders(ctx: TransformContext, config: TextEncoderQuantConfig) -> list[Phase]:
    """The prompts are encoded and the pipeline stopped before its transformer: no forward."""
    return [Phase(config.kind, 0)]
