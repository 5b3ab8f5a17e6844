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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from sdkiln.errors import PackageError
from sdkiln.export.ascend_schemes import FLOAT_TAG, AscendLayer, ascend_layer_tensors
from sdkiln.export.atomic import atomic_directory
from sdkiln.runtime.package import TRANSFORMER_WEIGHTS, open_package
from sdkiln.runtime.quant import scheme_classes
from sdkiln.runtime.safetensors_data import load_tensors

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


def _layer_of(key: str, modules: dict[str, Any]) -> tuple[str, str] | None:
    """(layer, suffix) when ``key`` belongs to a quantized layer (``L.weight``, ``L.div.mul_scale``)."""
    for parts in (1, 2):
        pieces = key.rsplit(".", parts)
        if len(pieces) == parts + 1 and pieces[0] in modules:
            return pieces[0], ".".join(pieces[1:])
    return None


def type_priority() -> tuple[str, ...]:
    """``model_quant_type`` ranks, lowest first: msModelSlim's AscendV1 saver ranks fewer bits above
    more and W8A8 above W8A8_DYNAMIC; W4A16 and W8A8_TIMESTEP are not in its list and are placed by
    the same rule. Each scheme's rank is its runtime class's ``ascend_rank``."""
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
    schemes: set[str] = set()
    group_sizes, policies = set(), set()
    for name, info in modules.items():
        params = {k: v for k, v in info.items() if k not in ("scheme", "smooth")}
        layer_tensors, smooth = _layer_tensors(name, info, per_layer[name])
        layer = AscendLayer(name, layer_tensors, params, deploy_dtype)
        prefix = name if smooth is None else f"{name}.linear"
        for suffix, (t, tag) in ascend_layer_tensors(info["scheme"], layer).items():
            out[f"{prefix}.{suffix}"] = (t, tag)
        if smooth is not None:
            out[f"{name}.{SMOOTH_SUFFIX}"] = (smooth, FLOAT_TAG)
        if "group_size" in params:
            group_sizes.add(int(params["group_size"]))
        if info["scheme"] == "W8A8_TIMESTEP":
            policies.add((int(params["num_steps"]), int(params["dynamic_steps"])))
        schemes.add(info["scheme"])
    if len(group_sizes) > 1:
        raise PackageError(
            f"manifest.json: layers use group sizes {sorted(group_sizes)}; the Ascend format has one"
        )
    if len(policies) > 1:
        raise PackageError(
            f"manifest.json: W8A8_TIMESTEP layers use (num_steps, dynamic_steps) {sorted(policies)}; MindIE SD "
            "applies one timestep policy to the whole model"
        )
    description: dict[str, Any] = {"model_quant_type": _model_quant_type(schemes)}
    if group_sizes:
        description["group_size"] = group_sizes.pop()
    keys = sorted(out)
    description.update({k: out[k][1] for k in keys})
    policy = dict(zip(("num_steps", "dynamic_steps"), policies.pop(), strict=True)) if policies else None
    return AscendFiles(description, {k: out[k][0].contiguous() for k in keys}, policy)


def _deploy_dtype(manifest: dict[str, Any], dtype: str | None) -> torch.dtype | None:
    """The float type MindIE SD will run in: ``dtype`` if given, else the package's model dtype
    when it is bfloat16 or float16, else None (a float32 package; only W8A8 layers need to know)."""
    name = dtype if dtype is not None else manifest["model"].get("dtype")
    if dtype is not None and dtype not in DEPLOY_DTYPES:
        raise PackageError(f"--dtype {dtype!r}: MindIE SD runs {' or '.join(DEPLOY_DTYPES)}")
    return DEPLOY_DTYPES.get(name)


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
    attr = manifest["model"]["transformer_attr"]
    weights_rel = f"{attr}/{TRANSFORMER_WEIGHTS}"
    tensors = load_tensors(pkg.data(weights_rel), weights_rel)
    files = ascend_files(manifest, tensors, _deploy_dtype(manifest, dtype))
    description, weights = files.description, files.weights
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
    )
