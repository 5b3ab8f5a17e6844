"""An independent reader of Ascend quantized-weight directories, written from how MindIE SD loads
them (``mindiesd/quantization/quantize.py``, ``layer.py``, ``utils/file_utils.py``) and what
msModelSlim's savers write (``modelslim_v1/save/mindie_format.py``, ``llm_ptq`` saver), not from
sdkiln's writer. Tests parse our export with it.

Rules, each from those sources:

* Files: ``quant_model_description_<t>.json`` and ``quant_model_weight_<t>.safetensors`` side by
  side, ``<t>`` the lower-cased ``model_quant_type`` (MindIE SD derives the weights name from it);
  the description's name must not end in ``_<digits>`` (that marks a per-rank file). Files at most
  0o640, the directory at most 0o750, no symlinks.
* Description: a JSON object whose first key is ``model_quant_type``, a MindIE SD QuantAlgorithm.
  String values are ``FLOAT`` or a QuantAlgorithm; other values (``group_size``) are not types.
  Every typed key is a tensor of the weights file and every tensor is typed.
* A Linear ``L`` is quantized with type ``desc[L + ".weight"]``, or ``desc[L + ".linear.weight"]``
  when ``L + ".div.mul_scale"`` exists (SmoothQuant); FLOAT means left in float.
* Per type, the tensors MindIE SD's layer classes read, with their dtypes and shapes.
* Attention quantization (msModelSlim's ``update_fa_quant_type``, MindIE SD's ``add_fa_quant``): a
  ``"<attn>.quant_type": "FP8_DYNAMIC"`` entry (a type, not a tensor) makes MindIE SD run that
  attention module through ``FP8RotateQuantFA``, which reads ``<attn>.q_rot`` and ``<attn>.k_rot``
  (square float matrices of the head dim, FLOAT).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# mindiesd/quantization/mode.py, QuantAlgorithm values.
MINDIE_QUANT_ALGOS = {
    "W8A8", "W8A8_TIMESTEP", "W8A8_DYNAMIC", "W4A4_DYNAMIC", "W8A8_MXFP8", "W4A4_MXFP4", "W8A16", "W4A16",
    "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_PER_CHANNEL", "W8A8_PER_TENSOR",
    "W8A8_PER_CHANNEL_PER_TOKEN", "W8A8_PER_CHANNEL_PER_TENSOR", "W8A8_PER_TENSOR_PER_TOKEN", "INT8",
    "MIXED_PERCISION", "FP8_DYNAMIC", "NO_QUANT",
}  # fmt: skip
MAX_FILE_MODE = 0o640  # file_utils.MODELDATA_FILE_PERMISSION / CONFIG_FILE_PERMISSION
MAX_DIR_MODE = 0o750  # file_utils.MODELDATA_DIR_PERMISSION


class AscendFormatError(AssertionError):
    pass


@dataclass
class AscendLayerView:
    scheme: str
    prefix: str  # where its tensors live: L, or L.linear when smoothed
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # suffix -> tensor
    mul_scale: torch.Tensor | None = None  # L.div.mul_scale, the SmoothQuant input multiplier


@dataclass
class AscendModelView:
    model_quant_type: str
    description: dict
    weights: dict[str, torch.Tensor]
    layers: dict[str, AscendLayerView]
    float_keys: set[str]
    group_size: int | None
    fa_layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Attention module -> (q_rot, k_rot) of the FP8_DYNAMIC FA quantization."""


def _check_mode(path: Path, limit: int) -> None:
    if path.is_symlink():
        raise AscendFormatError(f"{path}: is a symlink")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & ~limit:
        raise AscendFormatError(f"{path}: mode {oct(mode)} exceeds {oct(limit)}")


def deq_scale_as_fp32(t: torch.Tensor) -> torch.Tensor:
    """A deq_scale as float32: itself, or the fp32 bits an int64 holds in its low 32 bits."""
    if t.dtype == torch.float32:
        return t
    if t.dtype != torch.int64 or bool(((t >> 32) != 0).any()):
        raise AscendFormatError(
            f"deq_scale must be float32, or int64 with fp32 bits in the low word; got {t.dtype}"
        )
    return t.to(torch.int32).view(torch.float32)


def _expect(view: AscendLayerView, name: str, suffix: str, dtypes, shape) -> torch.Tensor:
    if suffix not in view.tensors:
        raise AscendFormatError(f"{name}: {view.scheme} needs {view.prefix}.{suffix}")
    t = view.tensors[suffix]
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes or tuple(t.shape) != tuple(shape):
        raise AscendFormatError(
            f"{view.prefix}.{suffix}: expected {dtypes} {list(shape)}, got {t.dtype} {list(t.shape)}"
        )
    return t


def _check_layer(name: str, view: AscendLayerView, group_size: int | None) -> None:
    w = view.tensors.get("weight")
    if w is None or w.dtype != torch.int8 or w.dim() != 2:
        raise AscendFormatError(f"{name}: weight must be int8 [N, K]")
    n, k = w.shape
    if "bias" in view.tensors:
        _expect(view, name, "bias", (torch.float32, torch.float16, torch.bfloat16), (n,))
    s = view.scheme
    if s in ("W8A8_DYNAMIC", "W8A16", "W8A8_TIMESTEP"):
        _expect(view, name, "weight_scale", torch.float32, (n, 1))
        if not bool((_expect(view, name, "weight_offset", torch.float32, (n, 1)) == 0).all()):
            raise AscendFormatError(f"{name}: symmetric weight_offset must be zeros")
    if s == "W4A16":
        groups = k // group_size if group_size else 1
        _expect(view, name, "weight_scale", torch.float32, (n, groups))
        _expect(view, name, "weight_offset", torch.float32, (n, groups))
        if int(w.min()) < -8 or int(w.max()) > 7:
            raise AscendFormatError(f"{name}: W4A16 weight values must be int4, in [-8, 7]")
    if s in ("W8A8", "W8A8_TIMESTEP"):
        lead = () if s == "W8A8" else (view.tensors.get("input_scale", torch.empty(0)).shape[0],)
        _expect(view, name, "input_scale", torch.float32, (*lead, 1))
        _expect(view, name, "input_offset", torch.float32, (*lead, 1))
        _expect(view, name, "deq_scale", (torch.float32, torch.int64), (*lead, n))
        _expect(view, name, "quant_bias", torch.int32, (*lead, n))
    if s not in ("W8A8", "W8A8_DYNAMIC", "W8A8_TIMESTEP", "W8A16", "W4A16"):
        raise AscendFormatError(f"{name}: this reader has no rules for {s}")


def read_ascend_dir(root: str | os.PathLike) -> AscendModelView:
    root = Path(root)
    _check_mode(root, MAX_DIR_MODE)
    names = sorted(p.name for p in root.iterdir())
    descs = [n for n in names if re.fullmatch(r"quant_model_description_[a-z0-9_]+\.json", n)]
    if len(descs) != 1 or len(names) != 2:
        raise AscendFormatError(f"{root}: expected one description and one weights file, found {names}")
    desc_path = root / descs[0]
    if re.search(r"_\d+\.json$", desc_path.name):
        raise AscendFormatError(f"{desc_path.name}: a _<digits> suffix marks a per-rank description")
    for p in root.iterdir():
        _check_mode(p, MAX_FILE_MODE)
    desc = json.loads(desc_path.read_text(encoding="utf-8"))
    if not isinstance(desc, dict) or next(iter(desc), None) != "model_quant_type":
        raise AscendFormatError("the description must be an object whose first key is model_quant_type")
    mqt = desc["model_quant_type"]
    if mqt not in MINDIE_QUANT_ALGOS:
        raise AscendFormatError(f"model_quant_type {mqt!r} is not a MindIE SD QuantAlgorithm")
    if desc_path.name != f"quant_model_description_{mqt.lower()}.json":
        raise AscendFormatError(f"{desc_path.name} does not match model_quant_type {mqt}")
    weights_path = root / f"quant_model_weight_{mqt.lower()}.safetensors"
    if not weights_path.is_file():
        raise AscendFormatError(f"MindIE SD would look for {weights_path.name}, which is missing")
    weights = load_file(weights_path)
    typed = {k: v for k, v in desc.items() if k != "model_quant_type" and isinstance(v, str)}
    fa = {k[: -len(".quant_type")]: v for k, v in typed.items() if k.endswith(".quant_type")}
    typed = {k: v for k, v in typed.items() if not k.endswith(".quant_type")}
    fa_layers = {}
    for attn, kind in fa.items():
        if kind != "FP8_DYNAMIC":
            raise AscendFormatError(
                f"{attn}.quant_type: MindIE SD quantizes attention as FP8_DYNAMIC, got {kind!r}"
            )
        rots = []
        for r in ("q_rot", "k_rot"):
            t = weights.get(f"{attn}.{r}")
            if t is None or typed.get(f"{attn}.{r}") != "FLOAT" or t.dim() != 2 or t.shape[0] != t.shape[1]:
                raise AscendFormatError(f"{attn}: FP8RotateQuantFA needs {attn}.{r}, a square FLOAT matrix")
            rots.append(t)
        fa_layers[attn] = tuple(rots)
    for k, v in typed.items():
        if v != "FLOAT" and v.upper() not in MINDIE_QUANT_ALGOS:
            raise AscendFormatError(f"{k}: type {v!r} is neither FLOAT nor a QuantAlgorithm")
    if set(typed) != set(weights):
        raise AscendFormatError(
            f"description and weights disagree: only described {sorted(set(typed) - set(weights))[:3]}, "
            f"only stored {sorted(set(weights) - set(typed))[:3]}"
        )
    group_size = desc.get("group_size")
    layers: dict[str, AscendLayerView] = {}
    for key, tag in typed.items():
        if not key.endswith(".weight") or tag == "FLOAT":
            continue
        prefix = key[: -len(".weight")]
        layer = prefix
        if prefix.endswith(".linear") and f"{prefix[: -len('.linear')]}.div.mul_scale" in typed:
            layer = prefix[: -len(".linear")]
        view = AscendLayerView(scheme=tag, prefix=prefix)
        if layer != prefix:
            view.mul_scale = weights[f"{layer}.div.mul_scale"]
        for k2 in typed:
            if k2.startswith(prefix + ".") and "." not in k2[len(prefix) + 1 :]:
                suffix = k2[len(prefix) + 1 :]
                expected = "FLOAT" if suffix == "bias" else tag
                if typed[k2] != expected:
                    raise AscendFormatError(f"{k2}: tagged {typed[k2]}, expected {expected}")
                view.tensors[suffix] = weights[k2]
        _check_layer(layer, view, group_size)
        layers[layer] = view
    owned = {f"{v.prefix}.{s}" for v in layers.values() for s in v.tensors}
    owned |= {f"{name}.div.mul_scale" for name, v in layers.items() if v.prefix != name}
    float_keys = set(typed) - owned
    if any(typed[k] != "FLOAT" for k in float_keys):
        raise AscendFormatError(
            f"tensors typed but belonging to no quantized layer: {sorted(float_keys)[:3]}"
        )
    return AscendModelView(mqt, desc, weights, layers, float_keys, group_size, fa_layers)


def mindie_linear(view: AscendLayerView, x: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """What MindIE SD's layer classes compute from these tensors (``layer.py``), in float64, after
    multiplying x by ``div.mul_scale`` for a smoothed layer:

    * W8A8 (ATB quant + linear): ``x_q = sat(round(x / input_scale + input_offset))``,
      ``y = (x_q @ W.T + quant_bias) * deq_scale``; W8A8_TIMESTEP the same with row ``step``;
    * W8A8_DYNAMIC (``npu_dynamic_quant`` + ``npu_quant_matmul``): per-token ``s = rowmax|x| / 127``,
      ``y = (round(x / s) @ W.T) * s * weight_scale + bias``;
    * W8A16 / W4A16 (``npu_weight_quant_batchmatmul``): ``y = x @ (W * weight_scale).T + bias``.
    """
    t = view.tensors
    x = x.double() if view.mul_scale is None else x.double() * view.mul_scale.double()
    w = t["weight"].double()
    bias = t["bias"].double() if "bias" in t else 0.0
    if view.scheme in ("W8A8", "W8A8_TIMESTEP"):

        def row(name):
            return t[name] if view.scheme == "W8A8" else t[name][step]

        x_q = torch.round(x / row("input_scale").double() + row("input_offset").double()).clamp(-128, 127)
        deq = deq_scale_as_fp32(row("deq_scale")).double()
        return (x_q @ w.T + row("quant_bias").double()) * deq
    if view.scheme == "W8A8_DYNAMIC":
        s = x.abs().amax(dim=-1, keepdim=True) / 127
        return (torch.round(x / s) @ w.T) * s * t["weight_scale"].double().T + bias
    scale = t["weight_scale"].double()
    w = w * scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
    return x @ w.T + bias
