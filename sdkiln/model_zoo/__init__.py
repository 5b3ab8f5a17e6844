"""One ModelSpec per model family. ``get_spec(name)`` resolves a CLI model name."""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import torch

from sdkiln import hub
from sdkiln.errors import ModelError, third_party
from sdkiln.model_zoo.spec import AttentionSite, BlockList, ModelSpec

# name -> module that defines SPEC. Modules import lazily so `import sdkiln` stays light.
_SPEC_MODULES = {
    "fmnist-flux": "sdkiln.model_zoo.fmnist.spec",
    "flux-tiny": "sdkiln.model_zoo.flux",
    "sd3-tiny": "sdkiln.model_zoo.sd3",
    "wan-tiny": "sdkiln.model_zoo.wan",
}
DEFAULT_MODEL = "fmnist-flux"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtypes a model is optimized in (``optimize --dtype``)."""
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_HEADER_LIMIT = 100 * 2**20


def spec_names() -> list[str]:
    return list(_SPEC_MODULES)


def get_spec(name: str | None = None) -> ModelSpec:
    name = name or DEFAULT_MODEL
    if name not in _SPEC_MODULES:
        raise ModelError(
            f"unknown model {name!r}: not a model name ({', '.join(_SPEC_MODULES)}) nor a directory"
        )
    return importlib.import_module(_SPEC_MODULES[name]).SPEC


def spec_for_pipeline(pipeline) -> ModelSpec:
    """The spec whose pipeline class matches ``pipeline`` (for models loaded from a directory)."""
    cls = f"{type(pipeline).__module__}:{type(pipeline).__name__}"
    short = type(pipeline).__name__
    for name in _SPEC_MODULES:
        spec = get_spec(name)
        if spec.pipeline_class == cls or spec.pipeline_class.split(":")[-1] == short:
            return spec
    raise ModelError(
        f"no sdkiln model spec for pipeline class {short}; known families: {', '.join(_SPEC_MODULES)}"
    )


def stored_dtype(directory: Path, component: str) -> torch.dtype | None:
    """The floating dtype ``component``'s weights are stored in, from the header of its first
    safetensors file (the header only: at most a few MB of a multi-GB file); None when there are no
    safetensors files or no floating tensors in that header."""
    files = sorted((directory / component).glob("*.safetensors"))
    if not files:
        return None
    try:
        with open(files[0], "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if not 0 < size <= _HEADER_LIMIT:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelError(f"{files[0]}: not a readable safetensors file ({exc})") from None
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _SAFETENSORS_DTYPES:
            return _SAFETENSORS_DTYPES[entry["dtype"]]
    return None


def _import_class(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def load_model(model: str | None = None, dtype: torch.dtype | None = None):
    """A zoo name (or None: the embedded model), a local diffusers directory or a
    ``modelscope://ORG/NAME`` id (``sdkiln.hub``) -> (pipeline, spec, id).

    Every component is loaded in one dtype (diffusers' ``dtype``): ``dtype``, else the dtype the
    transformer is stored in; a zoo model is built in float32 and cast when ``dtype`` says so. A real
    FLUX or SD3 directory stores 16-bit weights, and loading some components in fp32 and the rest as
    stored fails at the first forward."""
    if model is None or model in _SPEC_MODULES:
        spec = get_spec(model)
        pipe = spec.build()
        if dtype is not None and dtype != torch.float32:
            pipe.to(dtype)
        return pipe, spec, spec.name
    if hub.is_hub_id(model):  # modelscope://ORG/NAME: its snapshot, recorded under the id
        pipe, spec, _ = load_model(str(hub.resolve(model)), dtype)
        return pipe, spec, model
    path = Path(model)
    index = path / "model_index.json"
    if (path / "manifest.json").is_file() and b'"sdkiln-package"' in (path / "manifest.json").read_bytes()[
        :4096
    ]:
        raise ModelError(
            f"{model}: is an sdkiln package, not a base model; optimize the model it was made from "
            "(`sdkiln inspect` names it)"
        )
    if not index.is_file():
        raise ModelError(
            f"{model}: not a model name ({', '.join(_SPEC_MODULES)}) nor a diffusers directory with model_index.json"
        )
    try:
        class_name = json.loads(index.read_text(encoding="utf-8"))["_class_name"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise ModelError(f"{index}: unreadable model index ({exc})") from None
    for name in _SPEC_MODULES:
        spec = get_spec(name)
        if spec.pipeline_class.split(":")[-1] == class_name:
            dtype = dtype or stored_dtype(path, spec.transformer_attr) or torch.float32
            with third_party(str(path), f"loading {class_name} with diffusers", ModelError):
                pipe = _import_class(spec.pipeline_class).from_pretrained(
                    str(path), use_safetensors=True, dtype=dtype
                )
            return pipe, spec, str(path.resolve())
    raise ModelError(
        f"{index}: pipeline class {class_name} has no sdkiln model spec ({', '.join(_SPEC_MODULES)})"
    )


__all__ = [
    "AttentionSite",
    "BlockList",
    "ModelSpec",
    "get_spec",
    "spec_names",
    "spec_for_pipeline",
    "load_model",
    "stored_dtype",
    "DTYPES",
    "DEFAULT_MODEL",
]
