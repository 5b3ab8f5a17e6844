"""One ModelSpec per model family. ``get_spec(name)`` resolves a CLI model name or a manifest's
family; ``load_model`` detects which variant of its family a diffusers directory holds."""

from __future__ import annotations

import importlib
import inspect
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sdkiln import hub
from sdkiln.errors import ModelError, third_party
from sdkiln.model_zoo.spec import AttentionSite, BlockList, ModelSpec, Variant

# family -> module that defines SPEC, the family resolved to its zoo build. Modules import lazily so
# `import sdkiln` stays light.
_FAMILY_MODULES = {
    "fmnist-flux": "sdkiln.model_zoo.fmnist.spec",
    "flux": "sdkiln.model_zoo.flux",
    "flux-kontext": "sdkiln.model_zoo.flux_kontext",
    "flux2": "sdkiln.model_zoo.flux2",
    "hunyuan-video": "sdkiln.model_zoo.hunyuan_video",
    "hunyuan-video-1.5": "sdkiln.model_zoo.hunyuan_video15",
    "qwen-image": "sdkiln.model_zoo.qwen_image",
    "qwen-image-edit": "sdkiln.model_zoo.qwen_image_edit",
    "sd3": "sdkiln.model_zoo.sd3",
    "wan": "sdkiln.model_zoo.wan",
    "wan-i2v": "sdkiln.model_zoo.wan_i2v",
    "wan2.2-a14b": "sdkiln.model_zoo.wan22_a14b",
    "wan2.2-a14b-i2v": "sdkiln.model_zoo.wan22_a14b_i2v",
}
# zoo name (a model `optimize` builds by name; the family packages made before variants record) -> family
_ZOO = {
    "fmnist-flux": "fmnist-flux",
    "flux-tiny": "flux",
    "flux-kontext-tiny": "flux-kontext",
    "flux2-tiny": "flux2",
    "hunyuan-video-tiny": "hunyuan-video",
    "hunyuan-video-1.5-tiny": "hunyuan-video-1.5",
    "qwen-image-tiny": "qwen-image",
    "qwen-image-edit-tiny": "qwen-image-edit",
    "sd3-tiny": "sd3",
    "wan-tiny": "wan",
    "wan-i2v-tiny": "wan-i2v",
    "wan2.2-a14b-tiny": "wan2.2-a14b",
    "wan2.2-a14b-i2v-tiny": "wan2.2-a14b-i2v",
}
DEFAULT_MODEL = "fmnist-flux"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtypes a model is optimized in (``optimize --dtype``)."""
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_HEADER_LIMIT = 100 * 2**20


def spec_names() -> list[str]:
    """The zoo names: the models ``optimize`` builds by name."""
    return list(_ZOO)


def get_spec(name: str | None = None, variant: str | None = None) -> ModelSpec:
    """The spec of a zoo name (``flux-tiny``) or a family (``flux``), resolved to ``variant``; without
    one, to the zoo build. A manifest's ``model.family`` and ``model.variant`` go here (a package made
    before variants records the zoo name and no variant)."""
    name = name or DEFAULT_MODEL
    family = _ZOO.get(name, name)
    if family not in _FAMILY_MODULES:
        raise ModelError(
            f"unknown model {name!r}: not a model name ({', '.join(_ZOO)}), a family "
            f"({', '.join(_FAMILY_MODULES)}) nor a directory"
        )
    spec = importlib.import_module(_FAMILY_MODULES[family]).SPEC
    return spec if variant is None else spec.resolve(variant)


def _families() -> list[ModelSpec]:
    return [get_spec(family) for family in _FAMILY_MODULES]


def families_help() -> str:
    """One line per family: its name, pipeline class, zoo build and variants (``optimize --help``)."""
    zoo = {family: name for name, family in _ZOO.items()}
    lines = []
    for spec in _families():
        variants = ", ".join(v for v in spec.variant_names() if v not in ("tiny", "embedded"))
        cls = spec.pipeline_class.split(":")[-1]
        lines.append(f"  {spec.family:<18} {cls:<28} zoo: {zoo[spec.family]:<22} {variants or '-'}")
    return "\n".join(lines)


def _family_of(class_name: str, index: Mapping[str, Any]) -> ModelSpec | None:
    """The family of a pipeline of class ``class_name`` whose config is ``index``: of the families of
    that class whose ``layout`` the config sets, the one naming the most entries (Wan2.2-A14B's two
    experts ahead of Wan's one transformer); None when no family has the class."""
    fitting = [
        spec
        for spec in _families()
        if spec.pipeline_class.split(":")[-1] == class_name and spec.matches_layout(index)
    ]
    return max(fitting, key=lambda spec: len(spec.layout), default=None)


def spec_for_pipeline(pipeline) -> ModelSpec:
    """The spec whose pipeline class matches ``pipeline``, resolved to the variant its transformer's
    config is (for a pipeline object given to ``optimize``)."""
    short = type(pipeline).__name__
    spec = _family_of(short, pipeline.config)
    if spec is None:
        raise ModelError(
            f"no sdkiln model spec for pipeline class {short}; known families: {', '.join(_FAMILY_MODULES)}"
        )
    spec.refuse_layout(pipeline.config, f"{short} object")
    return spec.detect(getattr(pipeline, spec.transformer_attr).config, f"{short} object")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path}: missing ({what})") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: unreadable {what} ({exc})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: unreadable {what} (not a JSON object)")
    return value


def _transformer_config(directory: Path, index: Mapping[str, Any], attr: str) -> dict[str, Any]:
    """``<directory>/<attr>/config.json`` over its diffusers class's constructor defaults: a published
    config.json leaves out keys added to the class after it was written (SD3-medium has no ``qk_norm``)."""
    import diffusers

    entry = index.get(attr)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
        raise ModelError(f"{directory / 'model_index.json'}: {attr} is {entry!r}, not a diffusers class")
    cls = getattr(diffusers, str(entry[1]), None)
    if not isinstance(cls, type):
        raise ModelError(f"{directory / 'model_index.json'}: {attr} class {entry[1]!r} is not in diffusers")
    config = _read_json(directory / attr / "config.json", "transformer config")
    params = inspect.signature(cls.__init__).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **config}


def detect(directory: Path) -> ModelSpec:
    """The spec, resolved to its variant, of the diffusers directory ``directory``, from its JSON alone
    (model_index.json and the transformer's config.json; no weights are read)."""
    index = _read_json(directory / "model_index.json", "model index")
    class_name = index.get("_class_name")
    spec = _family_of(str(class_name), index)
    if spec is None:
        raise ModelError(
            f"{directory / 'model_index.json'}: pipeline class {class_name} has no sdkiln model spec "
            f"({', '.join(_FAMILY_MODULES)})"
        )
    spec.refuse_layout(index, str(directory))
    return spec.detect(_transformer_config(directory, index, spec.transformer_attr), str(directory))


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


def _straight_to(device: torch.device | None) -> dict[str, Any]:
    """``from_pretrained``'s arguments that load every component onto an accelerator as it is read
    (diffusers' ``device_map`` with a device type: no copy of the model on the host); the CPU, or an
    accelerator other than the first, loads on the host and moves after."""
    if device is None or device.type == "cpu" or device.index not in (None, 0):
        return {}
    return {"device_map": device.type}


def _import_own_components(path: Path) -> None:
    """Import the sdkiln modules a directory's model_index.json names as component libraries (a saved
    Qwen-Image-Edit test build's processor, ``sdkiln.model_zoo.qwen_vl_processor``): diffusers loads a
    component from a library only once it is imported. Only sdkiln's own model zoo is imported."""
    index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    for entry in index.values() if isinstance(index, dict) else ():
        library = entry[0] if isinstance(entry, list) and entry and isinstance(entry[0], str) else ""
        if library.startswith("sdkiln.model_zoo.") and library.replace(".", "").replace("_", "").isalnum():
            try:
                importlib.import_module(library)
            except ImportError:
                raise ModelError(
                    f"{path}/model_index.json: component library {library!r} is not in sdkiln"
                ) from None


def _substituted(path: Path) -> dict:
    """The components of a directory loaded as another class than model_index.json names (a
    ``Qwen2VLProcessor`` without torchvision: ``model_zoo.qwen_vl_processor.substitute``), by name, for
    diffusers' ``from_pretrained`` to take as they are."""
    from sdkiln.model_zoo.qwen_vl_processor import SUBSTITUTES, substitute

    index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    out = {}
    for name, entry in index.items() if isinstance(index, dict) else ():
        if isinstance(entry, list) and tuple(entry) in SUBSTITUTES:
            cls = substitute(*entry, where=f"{path}/{name}")
            if cls is not None:
                with third_party(f"{path}/{name}", f"loading {cls.__name__}", ModelError):
                    out[name] = cls.from_pretrained(path / name)
    return out


def load_model(
    model: str | None = None, dtype: torch.dtype | None = None, device: torch.device | None = None
):
    """A zoo name (or None: the embedded model), a local diffusers directory or a
    ``modelscope://ORG/NAME`` id (``sdkiln.hub``) -> (pipeline, spec, id).

    A directory's spec is resolved to the variant it holds (``detect``) before any weights load. Every
    component is loaded in one dtype (diffusers' ``dtype``): ``dtype``, else the dtype the transformer
    is stored in; a zoo model is built in float32 and cast when ``dtype`` says so. A real FLUX or SD3
    directory stores 16-bit weights, and loading some components in fp32 and the rest as stored fails
    at the first forward. With ``device`` (an accelerator), a directory's components are loaded
    straight onto it; the caller moves a zoo model."""
    if model is None or model in _ZOO:
        spec = get_spec(model)
        pipe = spec.build()
        if dtype is not None and dtype != torch.float32:
            pipe.to(dtype)
        return pipe, spec, spec.name
    if hub.is_hub_id(model):  # modelscope://ORG/NAME: its snapshot, recorded under the id
        pipe, spec, _ = load_model(str(hub.resolve(model)), dtype, device)
        return pipe, spec, model
    path = Path(model)
    if (path / "manifest.json").is_file() and b'"sdkiln-package"' in (path / "manifest.json").read_bytes()[
        :4096
    ]:
        raise ModelError(
            f"{model}: is an sdkiln package, not a base model; optimize the model it was made from "
            "(`sdkiln inspect` names it)"
        )
    if not (path / "model_index.json").is_file():
        raise ModelError(
            f"{model}: not a model name ({', '.join(_ZOO)}) nor a diffusers directory with model_index.json"
        )
    spec = detect(path)
    dtype = dtype or stored_dtype(path, spec.transformer_attr) or torch.float32
    class_name = spec.pipeline_class.split(":")[-1]
    _import_own_components(path)
    with third_party(str(path), f"loading {class_name} with diffusers", ModelError):
        pipe = _import_class(spec.pipeline_class).from_pretrained(
            str(path), use_safetensors=True, dtype=dtype, **_straight_to(device), **_substituted(path)
        )
    return pipe, spec, str(path.resolve())


__all__ = [
    "AttentionSite",
    "BlockList",
    "ModelSpec",
    "Variant",
    "detect",
    "get_spec",
    "spec_names",
    "spec_for_pipeline",
    "load_model",
    "stored_dtype",
    "DTYPES",
    "DEFAULT_MODEL",
]
