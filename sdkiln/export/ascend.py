"""The Ascend export: a verified package -> the two files MindIE SD's ``quantize()`` reads.

MindIE SD 3.x (``mindiesd.quantize(transformer, quant_des_path)``) loads what msModelSlim's MindIE
format saver writes (sources in ``docs/ascend.md``):

* ``quant_model_description_<type>.json``: a flat JSON object, ``model_quant_type`` first, then one
  entry per tensor of the weights file, ``"<module>.<tensor>": "<TYPE>"``. Float tensors (every
  bias, every layer left in float) are ``"FLOAT"``. MindIE SD looks a Linear up under
  ``<layer>.weight`` (``<layer>.linear.weight`` when it carries a SmoothQuant ``div.mul_scale``),
  quantizes it with that type, and leaves layers tagged FLOAT alone.
* ``quant_model_weight_<type>.safetensors``: all those tensors in one file (MindIE SD does not read
  shards), ``<type>`` being ``model_quant_type`` in lower case.

A model that mixes schemes is tagged per tensor; its ``model_quant_type`` (which also names the
files) is the lowest-bit scheme present, ranked as msModelSlim's AscendV1 saver ranks them.
MindIE SD refuses files wider than 0o640: both are 0o640, the directory 0o750, nothing is a link,
and the directory is built beside the target, fsynced and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from sdkiln.configs import AttentionQuantConfig, QuantStep, RecipeConfig, SmoothQuantConfig
from sdkiln.errors import PackageError, RecipeError
from sdkiln.export.ascend_schemes import FLOAT_TAG, NEEDS_DEPLOY_DTYPE, AscendLayer, ascend_layer_tensors
from sdkiln.export.atomic import atomic_directory
from sdkiln.kernels.ops.quantized_attention import hadamard
from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.fingerprint import config_hash
from sdkiln.runtime.attention.quantized import NAME as ATTENTION_QUANT
from sdkiln.runtime.attention.quantized import AttentionQuantPlan
from sdkiln.runtime.components import component_tensors
from sdkiln.runtime.manifest_schema import short
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import by_recipe_kind, scheme_classes
from sdkiln.runtime.restore import section_file

FILE_MODE = 0o640
DIR_MODE = 0o750
DESCRIPTION_FILE = "quant_model_description_{type}.json"
WEIGHTS_FILE = "quant_model_weight_{type}.safetensors"
DEPLOY_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# A SmoothQuant input multiplier; MindIE SD then reads the layer's tensors under "<layer>.linear.".
SMOOTH_SUFFIX = "div.mul_scale"


@dataclass(frozen=True)
class AscendExport:
    root: Path
    model_quant_type: str
    description: Path
    weights: Path
    schemes: dict[str, int]
    """Quantized layers per scheme."""
    timestep_policy: dict[str, int] | None
    regridded: int
    """W8A8 layers whose static scales were rounded here for the deployment dtype (only in packages
    written before sdkiln stored them on that grid); MindIE SD then differs from our runtime by that
    rounding."""
    attention: dict[str, Any] | None = None
    """With an attention-quantization plan: what of it the export carries (``fa_quant``)."""


def _layer_of(key: str, modules: dict[str, Any]) -> tuple[str, str] | None:
    """(layer, suffix) when ``key`` belongs to a quantized layer (``L.weight``, ``L.div.mul_scale``)."""
    for parts in (1, 2):
        pieces = key.rsplit(".", parts)
        if len(pieces) == parts + 1 and pieces[0] in modules:
            return pieces[0], ".".join(pieces[1:])
    return None


def type_priority() -> tuple[str, ...]:
    """``model_quant_type`` ranks, lowest first: msModelSlim's AscendV1 saver ranks fewer bits above
    more and W8A8 above W8A8_DYNAMIC; W8A8_TIMESTEP is not in its list and is placed by the same
    rule. Each scheme's rank is its runtime class's ``ascend_rank``."""
    ranked = sorted(
        (c for c in scheme_classes().values() if c.ascend_rank is not None), key=lambda c: c.ascend_rank
    )
    return (FLOAT_TAG, *(c.scheme for c in ranked))


def _model_quant_type(schemes: set[str]) -> str:
    if not schemes:
        raise PackageError(
            "manifest.json: the package quantizes no layer; MindIE SD runs a float model without Ascend files"
        )
    priority = type_priority()
    unknown = schemes - set(priority)
    if unknown:
        raise PackageError(f"no model_quant_type rank for {sorted(unknown)}")
    return max(schemes, key=priority.index)


@dataclass(frozen=True)
class AscendFiles:
    description: dict[str, Any]
    weights: dict[str, Tensor]
    timestep_policy: dict[str, int] | None
    """``{"num_steps": T, "dynamic_steps": k}`` of the W8A8_TIMESTEP layers: MindIE SD takes the
    policy at load time (``TimestepPolicyConfig``), so it is reported rather than written."""
    regridded: int


def _layer_tensors(
    name: str, info: dict[str, Any], tensors: dict[str, Tensor]
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The layer's own tensors by suffix, and its SmoothQuant multiplier if the manifest says ``smooth``
    (our runtime then keeps the layer under ``<layer>.linear.``, as MindIE SD names it too)."""
    smooth = tensors.pop(SMOOTH_SUFFIX, None)
    if bool(info.get("smooth")) != (smooth is not None):
        raise PackageError(
            f"{name}: manifest smooth={bool(info.get('smooth'))} but {name}.{SMOOTH_SUFFIX} is "
            f"{'present' if smooth is not None else 'missing'}"
        )
    if smooth is None:
        return tensors, None
    inner = {s.removeprefix("linear."): t for s, t in tensors.items() if s.startswith("linear.")}
    if len(inner) != len(tensors):
        raise PackageError(f"{name}: a smoothed layer keeps its tensors under {name}.linear.*")
    return inner, smooth


def ascend_files(
    manifest: dict[str, Any], tensors: dict[str, Tensor], deploy_dtype: torch.dtype | None
) -> AscendFiles:
    """The description and the weight tensors for a package's manifest and transformer tensors.

    Every tensor of the transformer's state dict is written: a quantized layer's in its scheme's
    Ascend form, every other one unchanged and tagged FLOAT. Non-persistent buffers (stored in the
    package only because our runtime builds on the meta device) are not part of the model's weights.
    """
    modules = manifest["modules"]
    skip = set(manifest["model"].get("nonpersistent_buffers", []))
    per_layer: dict[str, dict[str, Tensor]] = {name: {} for name in modules}
    out: dict[str, tuple[Tensor, str]] = {}
    for key, t in tensors.items():
        if key in skip:
            continue
        owner = _layer_of(key, modules)
        if owner is None:
            out[key] = (t, FLOAT_TAG)
        else:
            per_layer[owner[0]][owner[1]] = t
    _refuse_folds(manifest)
    schemes: set[str] = set()
    policies, regridded = set(), 0
    for name, info in modules.items():
        params = {k: v for k, v in info.items() if k not in ("scheme", "smooth")}
        layer_tensors, smooth = _layer_tensors(name, info, per_layer[name])
        layer = AscendLayer(name, layer_tensors, params, deploy_dtype)
        prefix = name if smooth is None else f"{name}.linear"
        for suffix, (t, tag) in ascend_layer_tensors(info["scheme"], layer).items():
            out[f"{prefix}.{suffix}"] = (t, tag)
        if smooth is not None:
            out[f"{name}.{SMOOTH_SUFFIX}"] = (smooth, FLOAT_TAG)
        regridded += layer.regridded
        if info["scheme"] == "W8A8_TIMESTEP":
            policies.add((int(params["num_steps"]), int(params["dynamic_steps"])))
        schemes.add(info["scheme"])
    if len(policies) > 1:
        raise PackageError(
            f"manifest.json: W8A8_TIMESTEP layers use (num_steps, dynamic_steps) {sorted(policies)}; MindIE SD "
            "applies one timestep policy to the whole model"
        )
    description: dict[str, Any] = {"model_quant_type": _model_quant_type(schemes)}
    keys = sorted(out)
    description.update({k: out[k][1] for k in keys})
    policy = dict(zip(("num_steps", "dynamic_steps"), policies.pop(), strict=True)) if policies else None
    return AscendFiles(description, {k: out[k][0].contiguous() for k in keys}, policy, regridded)


FA_QUANT_TYPE = "FP8_DYNAMIC"
"""MindIE SD's attention quantization (``FP8RotateQuantFA``): Q, K and V quantized to FP8 per block at run
time, after Q and K are multiplied by the layer's ``q_rot`` and ``k_rot``."""


def fa_quant(
    plan: AttentionQuantPlan, head_dim: int
) -> tuple[dict[str, tuple[Tensor, str]], dict[str, str], dict]:
    """The attention plan in the form msModelSlim exports for MindIE SD (``docs/ascend.md``): per layer
    ``"<attn>.quant_type": "FP8_DYNAMIC"`` in the description and ``<attn>.q_rot``, ``<attn>.k_rot``
    ([D, D], FLOAT; the Hadamard rotation the plan chose, or the identity) in the weights. MindIE SD
    quantizes such a layer at every step, so only the layers the plan quantizes at every step are
    written (never a (layer, step) the plan keeps float), and only a plan calibrated in MindIE SD's own
    arithmetic (``layout="mindie"``, the recipe ``attn-fp8-ascend``: its decisions were measured on what
    Ascend computes; a SageAttention-layout plan's were not). Returns (tensors, description entries,
    what was carried)."""
    tensors: dict[str, tuple[Tensor, str]] = {}
    entries: dict[str, str] = {}
    every = sorted(n for n, e in plan.layers.items() if all(e["steps"]))
    pairs = sum(sum(e["steps"]) for e in plan.layers.values())
    carried = {
        "formats": f"{plan.qk}/{plan.pv}",
        "layout": plan.layout,
        "plan_layers": len(plan.layers),
        "layers": 0,
        "left_float_pairs": pairs,
    }
    if plan.layout != "mindie":
        carried["reason"] = (
            f"MindIE SD quantizes attention in FP8 blocks of its own ({FA_QUANT_TYPE}: Q per 128 tokens, K and V "
            f"per 256, no K smoothing); this plan ({plan.qk.upper()} QK / {plan.pv.upper()} PV) was calibrated "
            "in SageAttention's layout, so its attention runs in float there (make the package with "
            "attn-fp8-ascend, which calibrates MindIE SD's arithmetic)"
        )
        return tensors, entries, carried
    for name in every:
        rot = hadamard(head_dim) if plan.layers[name]["rotate"] else torch.eye(head_dim)
        tensors[f"{name}.q_rot"], tensors[f"{name}.k_rot"] = (rot, FLOAT_TAG), (rot.clone(), FLOAT_TAG)
        entries[f"{name}.quant_type"] = FA_QUANT_TYPE
    carried["layers"] = len(every)
    carried["left_float_pairs"] = pairs - plan.num_steps * len(every)
    if carried["left_float_pairs"]:
        carried["reason"] = (
            f"MindIE SD quantizes a layer's attention at every step: the {len(plan.layers) - len(every)} layers the "
            "plan quantizes at some steps only run in float there"
        )
    return tensors, entries, carried


def _refuse_folds(manifest: dict[str, Any]) -> None:
    """A SmoothQuant step that folded its smoothing into float modulation Linears changed weights
    MindIE SD never loads (it takes float weights from the user's own model), so its int8 layers
    would run behind unsmoothed inputs there."""
    for step in manifest["recipe"].get("steps", []):
        record = step.get("result") if isinstance(step, dict) else None
        folded = record.get("folded") if isinstance(record, dict) else None
        if isinstance(folded, list) and folded:
            raise PackageError(
                f"manifest.json: SmoothQuant folded its smoothing into the float modulation of {len(folded)} "
                f"layers (e.g. {short(folded[0])}), which MindIE SD never loads; make the package for Ascend "
                "with `optimize --format ascend` (it keeps every smoothing as an input multiplier) or a "
                "recipe whose smoothquant step has fold: false"
            )


def _deploy_dtype(model_dtype: str | None, dtype: str | None, error=PackageError) -> torch.dtype | None:
    """The float type MindIE SD will run in: ``dtype`` if given, else the model's dtype when it is
    bfloat16 or float16, else None (a float32 model: only some schemes' files need to know)."""
    if dtype is not None and dtype not in DEPLOY_DTYPES:
        raise error(f"--dtype {dtype!r}: MindIE SD runs {' or '.join(DEPLOY_DTYPES)}")
    return DEPLOY_DTYPES.get(dtype if dtype is not None else model_dtype)


def ascend_recipe(recipe: RecipeConfig, model_dtype: str, dtype: str | None) -> RecipeConfig:
    """``recipe`` as ``optimize(format="ascend")`` runs it, checked before any calibration: every
    scheme it can give a layer has a MindIE SD format, the deployment dtype is known where the files
    depend on it, and SmoothQuant keeps every smoothing as an input multiplier (MindIE SD loads only
    quantized layers, so a fold into a float modulation would be lost there)."""
    deploy = _deploy_dtype(model_dtype, dtype, RecipeError)
    classes = by_recipe_kind()
    steps, dependent = [], set()
    for step in recipe.steps:
        for kind in step.scheme_kinds() if isinstance(step, QuantStep) else ():
            cls = classes[kind]
            if cls.ascend_rank is None:
                raise RecipeError(
                    f"recipe {recipe.name!r}: {step.kind} gives layers {cls.scheme}, which cannot be "
                    f"exported for Ascend: {cls.ascend_refusal}"
                )
            dependent |= {cls.scheme} & NEEDS_DEPLOY_DTYPE
        if isinstance(step, AttentionQuantConfig) and step.layout != "mindie":
            raise RecipeError(
                f"recipe {recipe.name!r}: its attention_quant step calibrates the {step.layout!r} layout, which "
                "MindIE SD does not run; for Ascend use attn-fp8-ascend (MindIE SD's FP8 blocks)"
            )
        steps.append(dataclasses.replace(step, fold=False) if isinstance(step, SmoothQuantConfig) else step)
    if deploy is None and dependent:
        raise RecipeError(
            f"the model is {model_dtype} and MindIE SD runs bfloat16 or float16; the Ascend files of "
            f"{', '.join(sorted(dependent))} layers depend on which: pass --ascend-dtype (ascend_dtype=)"
        )
    return dataclasses.replace(recipe, steps=steps)


def check_replaceable(target: Path, force: bool) -> None:
    """``--force`` replaces a previous Ascend export, never anything else (a package, a model)."""
    if not os.path.lexists(target):
        return
    if not force:
        raise PackageError(f"{target}: already exists; pass --force (force=True) to replace it")
    patterns = (DESCRIPTION_FILE.split("{")[0], WEIGHTS_FILE.split("{")[0])
    if (
        target.is_symlink()
        or not target.is_dir()
        or not all(n.startswith(patterns) for n in os.listdir(target))
    ):
        raise PackageError(
            f"{target}: is not an Ascend export (quant_model_* files only); refusing to replace it"
        )


def _write_private(path: Path, write) -> None:
    write(path)
    os.chmod(path, FILE_MODE)


def export_ascend(
    package: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None, force: bool = False
) -> AscendExport:
    """Write the Ascend description and weights of the package at ``package`` into ``out_dir``.

    The package is verified completely first. ``dtype`` ("bfloat16" or "float16") is the type
    MindIE SD will run the model in; it decides ``deq_scale``'s form and defaults to the package's.
    ``out_dir`` is created atomically; an existing one is replaced only with ``force``.
    """
    pkg = open_package(package)
    manifest = pkg.manifest
    get_spec(manifest["model"]["family"]).refuse("ascend")  # refusals are the family's
    attr = manifest["model"]["transformer_attr"]
    tensors = component_tensors(pkg, attr)
    files = ascend_files(manifest, tensors, _deploy_dtype(manifest["model"].get("dtype"), dtype))
    description, weights = files.description, files.weights
    attention = None
    where = section_file(manifest, ATTENTION_QUANT)
    if where is not None:
        plan = AttentionQuantPlan.from_dict(pkg.read_json(where), where)
        config = pkg.read_json(f"{attr}/config.json")
        if plan.config_hash != config_hash(config):
            raise PackageError(f"{where}: the plan was calibrated for another transformer config")
        stray = sorted(n for n in plan.layers if not any(k.startswith(f"{n}.") for k in tensors))
        if stray:
            raise PackageError(f"{where}: the plan names {stray[0]!r}, which is no module of the transformer")
        head_dim = config.get("attention_head_dim")
        if not isinstance(head_dim, int):
            raise PackageError(
                f"{attr}/config.json: no attention_head_dim to size the attention rotations by"
            )
        fa_tensors, fa_entries, attention = fa_quant(plan, head_dim)
        description |= fa_entries | {k: tag for k, (_, tag) in fa_tensors.items()}
        weights |= {k: t.contiguous() for k, (t, _) in fa_tensors.items()}
    quant_type = description["model_quant_type"].lower()
    target = Path(out_dir)
    with atomic_directory(target, check=lambda t: check_replaceable(t, force), mode=DIR_MODE) as tmp:
        desc_path = tmp / DESCRIPTION_FILE.format(type=quant_type)
        weights_path = tmp / WEIGHTS_FILE.format(type=quant_type)
        text = json.dumps(description, indent=2) + "\n"
        _write_private(desc_path, lambda p: p.write_text(text, encoding="utf-8"))
        _write_private(weights_path, lambda p: save_file(weights, str(p), metadata={"format": "pt"}))
    schemes: dict[str, int] = {}
    for info in manifest["modules"].values():
        schemes[info["scheme"]] = schemes.get(info["scheme"], 0) + 1
    return AscendExport(
        root=target,
        model_quant_type=description["model_quant_type"],
        description=target / desc_path.name,
        weights=target / weights_path.name,
        schemes=schemes,
        timestep_policy=files.timestep_policy,
        regridded=files.regridded,
        attention=attention,
    )
