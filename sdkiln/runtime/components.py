"""Building a package's models and assembling its pipeline from verified bytes, with bounded work.

diffusers' ``from_pretrained`` would read every file again by path (after verification), build a
model of whatever size its config asks for, and fill missing tensors with random values. Here
every component is built from its checked config under an allocation budget, its tensors come from
the package's verified bytes (``runtime.safetensors_data``), and a missing or extra tensor is an
error. Parsers of other libraries are called inside ``third_party``, which turns their failures
into one ``PackageError`` naming the file; our own code runs outside it, so a bug of ours keeps its
traceback.

**Allocation budget.** A model is built on the meta device while a torch-function mode adds up
the elements of every tensor its constructor creates; past twice the elements stored in its
safetensors (plus a margin for buffers) the build stops. A config that asks for a million layers or
channels of 100,000 is refused in milliseconds, before anything is allocated.
"""

from __future__ import annotations

import importlib
import inspect
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sdkiln.errors import PackageError, third_party
from sdkiln.runtime.manifest_schema import expect_dict, expect_int, short
from sdkiln.runtime.package import Package
from sdkiln.runtime.safetensors_data import TensorInfo, parse_header

LIBRARIES = ("diffusers", "transformers")
# Pipelines come from diffusers or from sdkiln's own model zoo, nowhere else.
PIPELINE_MODULES = ("diffusers", "sdkiln.model_zoo.")
# A component comes from diffusers or transformers; the zoo's own components are processors
# (model_zoo.qwen_vl_processor: Qwen2VLProcessor without the video processor that needs torchvision).
ZOO_COMPONENTS = "sdkiln.model_zoo."
# A float tensor may be stored in any of these (a bf16 package); integer and float8 tensors (the
# quantized values) must have exactly the dtype their module declares.
Prepare = Callable[[str, nn.Module], None]
"""A hook on a model component built on meta, by name, before its weights load."""
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BUDGET_MARGIN = 16 << 20  # elements beyond twice the stored ones: buffers, init temporaries
TENSOR_MARGIN = 2_000  # tensors beyond four per stored one
# Scheduler and tokenizer settings that size arrays numpy or the tokenizer allocate (outside torch,
# so the allocation budget does not see them).
SCHEDULER_BOUNDS = {"num_train_timesteps": (1, 100_000), "max_image_seq_len": (1, 1 << 24)}
MAX_CONFIG_INT = 1 << 31
MAX_TOKENIZER_LENGTH = 1 << 20
_FACTORIES = frozenset(
    {
        torch.empty,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.tensor,
        torch.empty_strided,
        torch.empty_like,
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
        torch.rand_like,
        torch.randn_like,
    }
)


def resolve_class(path: str, base: type, what: str, modules: tuple[str, ...] = PIPELINE_MODULES) -> type:
    """``module:Class`` from the allow-list ``modules`` (a name ending in "." allows its submodules),
    and a subclass of ``base``."""
    module, _, name = path.partition(":")
    allowed = any(module == m or (m.endswith(".") and module.startswith(m)) for m in modules)
    if not name or not allowed:
        raise PackageError(f"manifest.json: {what} {path!r} is not from {' or '.join(modules)}; refusing it")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PackageError(f"manifest.json: cannot import {what} {path!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PackageError(f"manifest.json: {what} {path!r} is not a {base.__name__}")
    return cls


def _kind(value: Any) -> str:
    """A JSON value's kind: numbers (and booleans, which configs use for both) are one kind."""
    if value is None:
        return "null"
    if isinstance(value, bool | int | float):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _accepted_kinds(param: inspect.Parameter) -> set[str] | None:
    """The JSON kinds a constructor parameter takes, from its annotation (``Optional[float]``,
    ``tuple[int, ...]``) or else its default; None when neither says."""
    annotation = param.annotation
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        default = param.default
        if default is inspect.Parameter.empty or default is None:
            return None
        annotation = type(default)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = {"null"} if param.default is None else set()  # `x: float = None` takes None too
    for t in typing.get_args(annotation) if union else (annotation,):
        t = typing.get_origin(t) or t
        kind = {
            type(None): "null",
            bool: "number",
            int: "number",
            float: "number",
            str: "string",
            list: "list",
            tuple: "list",
            dict: "object",
        }.get(t)
        if kind is None:
            return None  # a type JSON does not name (a Literal, a class): not checked here
        kinds.add(kind)
    return kinds


def check_config_types(cls: type, config: dict[str, Any], where: str) -> dict[str, Any]:
    """Every config value must be of the kind (number, string, list, object, null) its class's
    constructor declares: a dict or a string where a float goes would pass ``from_config`` and fail
    at the first image. Kinds, not exact types: diffusers' own configs store ``force_upcast: float``
    as ``true``. Integers stay within 2^31."""
    params = inspect.signature(cls.__init__).parameters
    for key, value in config.items():
        param = params.get(key)
        accepted = None if param is None or key.startswith("_") else _accepted_kinds(param)
        if accepted is not None and _kind(value) not in accepted:
            raise PackageError(f"{where}: {key} must be {' or '.join(sorted(accepted))}, got {short(value)}")
        if type(value) is int and not -MAX_CONFIG_INT <= value < MAX_CONFIG_INT:
            raise PackageError(f"{where}: {key} = {value} is out of range")
    return config


class _Budget(TorchFunctionMode):
    """Counts what a constructor creates on the meta device (free there) and stops it once it asks
    for more elements or tensors than the stored weights justify, or one tensor larger than all of
    them (an intermediate of a computed buffer)."""

    def __init__(self, elements: int, tensors: int, where: str):
        super().__init__()
        self.elements, self.tensors, self.where = elements, tensors, where
        self.used = self.made = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            numel = out.numel()
            if func in _FACTORIES:
                self.used += numel
                self.made += 1
            if numel > self.elements or self.used > self.elements or self.made > self.tensors:
                raise PackageError(
                    f"{self.where}: the config asks for more than {self.elements:,} elements or "
                    f"{self.tensors:,} tensors, far more than the stored weights hold: config and weights "
                    "do not match"
                )
        return out


@contextmanager
def bounded_build(stored: tuple[int, int], where: str) -> Iterator[None]:
    """Build on the meta device, stopping past the allocation budget for ``stored`` (elements,
    tensors) weights (the module docstring)."""
    numel, count = stored
    with torch.device("meta"), _Budget(2 * numel + BUDGET_MARGIN, 4 * count + TENSOR_MARGIN, where):
        yield


def _files_of(pkg: Package, name: str, suffix: str) -> list[str]:
    return [rel for rel in pkg.files if rel.startswith(f"{name}/") and rel.endswith(suffix)]


INDEX_SUFFIX = ".safetensors.index.json"


def weight_files(pkg: Package, name: str) -> tuple[list[str], dict[str, str] | None]:
    """A component's safetensors files, and which file holds each tensor when the component is
    sharded with an index (diffusers' and transformers' ``*.safetensors.index.json``). The index
    must name each file of the component once, by its plain name, and nothing else."""
    files = _files_of(pkg, name, ".safetensors")
    indexes = _files_of(pkg, name, INDEX_SUFFIX)
    if not files:
        raise PackageError(f"{name}/: no weights (.safetensors) for this component")
    if not indexes:
        return files, None
    if len(indexes) > 1:
        raise PackageError(f"{name}/: {len(indexes)} shard indexes ({', '.join(indexes)}); one at most")
    rel = indexes[0]
    index = expect_dict(pkg.read_json(rel), rel)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PackageError(f"{rel}: weight_map must map tensor names to file names")
    named = set(weight_map.values())
    for shard in sorted(named):
        if "/" in shard or "\\" in shard or shard in ("", ".", "..") or not shard.endswith(".safetensors"):
            raise PackageError(f"{rel}: {shard!r} is not the plain name of a .safetensors file beside it")
    missing = sorted(named - {f.removeprefix(f"{name}/") for f in files})
    unnamed = sorted({f.removeprefix(f"{name}/") for f in files} - named)
    if missing or unnamed:
        what = (
            f"names {missing[0]!r}, which is not in the package"
            if missing
            else f"does not name {unnamed[0]!r}"
        )
        raise PackageError(f"{rel}: {what}; the index and the shards do not match")
    return files, {key: f"{name}/{shard}" for key, shard in weight_map.items()}


def component_tensors(pkg: Package, name: str, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a component's safetensors files (one file, or the shards of a large one),
    each file read once and verified before its tensors are used; on ``device``, each shard goes
    there before the next is read, so the host holds at most one shard."""
    files, index = weight_files(pkg, name)
    tensors: dict[str, torch.Tensor] = {}
    for rel in files:
        for key, value in pkg.tensors(rel, device).items():
            if key in tensors:
                raise PackageError(f"{rel}: tensor {key!r} is stored twice in {name}/")
            if index is not None and index.get(key) != rel:
                raise PackageError(
                    f"{rel}: tensor {key!r} is not where the shard index says ({index.get(key)})"
                )
            tensors[key] = value
    if index is not None and set(index) != set(tensors):
        raise PackageError(
            f"{name}/: the shard index names tensor {sorted(set(index) - set(tensors))[0]!r}, which no shard holds"
        )
    return tensors


def stored_infos(pkg: Package, name: str) -> dict[str, TensorInfo]:
    """What a component's safetensors headers say they hold, by tensor name (read ahead of the
    weights, checked when the weights are read)."""
    infos: dict[str, TensorInfo] = {}
    for rel in weight_files(pkg, name)[0]:
        try:
            found = parse_header(pkg.header(rel), pkg.manifest["files"][rel]["size"], rel)[1]
        except PackageError:
            pkg.verify_file(rel)  # a damaged file is reported as damaged, not as a bad header
            raise
        for key, info in found.items():
            if key in infos:
                raise PackageError(f"{rel}: tensor {key!r} is stored twice in {name}/")
            infos[key] = info
    return infos


def stored_size(pkg: Package, name: str) -> tuple[int, int]:
    """The elements and the number of tensors a component's safetensors hold."""
    infos = stored_infos(pkg, name).values()
    return sum(info.numel for info in infos), len(infos)


def fill_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], where: str, keep: tuple[str, ...] = ()
) -> nn.Module:
    """Load ``tensors`` into a model built on meta, with ``assign=True``: every tensor must be one
    the model has, of the shape it has, and no parameter or buffer may be left without a value.
    ``keep`` names buffers the model computed itself (not stored)."""
    expected = model.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise PackageError(f"{where}: tensor {unexpected[0]!r} is not part of the model")
    for key, value in tensors.items():
        want = expected[key]
        if tuple(value.shape) != tuple(want.shape):
            raise PackageError(
                f"{where}: tensor {key!r} has shape {list(value.shape)}, the model's config needs "
                f"{list(want.shape)}"
            )
        if value.dtype != want.dtype and (want.dtype not in FLOAT_DTYPES or value.dtype not in FLOAT_DTYPES):
            raise PackageError(f"{where}: tensor {key!r} is {value.dtype}, the model needs {want.dtype}")
    model.load_state_dict(tensors, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [
        n
        for n, t in list(model.named_parameters()) + list(model.named_buffers())
        if t.is_meta and n not in keep
    ]
    if missing:
        raise PackageError(
            f"{where}: tensors missing for {missing[:3]} (refusing to initialise them randomly)"
        )
    return model.eval()


def _model(
    pkg: Package, name: str, cls: type, library: str, device: torch.device | None, prepare: Prepare | None
) -> nn.Module:
    config_rel = f"{name}/config.json"
    config = expect_dict(pkg.read_json(config_rel), config_rel)
    check_config_types(cls if library == "diffusers" else cls.config_class, config, config_rel)
    with (
        third_party(config_rel, f"building {cls.__name__} from its config"),
        bounded_build(stored_size(pkg, name), config_rel),
    ):
        model = cls.from_config(config) if library == "diffusers" else cls(cls.config_class.from_dict(config))
    # Buffers a model computes from its config and does not store (CLIP's position ids) are built
    # again for real: only when the meta build says they are small.
    stored = set(model.state_dict())
    computed = {n: b.numel() for n, b in model.named_buffers() if n not in stored}
    if sum(computed.values()) > BUDGET_MARGIN:
        raise PackageError(
            f"{config_rel}: buffers of {sum(computed.values()):,} elements computed from the config"
        )
    if computed:
        from accelerate import init_empty_weights

        with (
            third_party(config_rel, f"building {cls.__name__}'s buffers"),
            init_empty_weights(include_buffers=False),
        ):
            model = (
                cls.from_config(config) if library == "diffusers" else cls(cls.config_class.from_dict(config))
            )
    if prepare is not None:
        prepare(name, model)
    tensors = component_tensors(pkg, name, device)
    if library == "transformers":
        tensors = _model_keys(model, tensors, config_rel)
    return fill_weights(model, tensors, f"{name}/", keep=tuple(computed))


def _model_keys(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A transformers model's stored names as the model names them: transformers 5 saves some models
    under their checkpoint names (Qwen2.5-VL's ``model.embed_tokens`` for the model's
    ``model.language_model.embed_tokens``) and renames on load, with its own mapping, used here."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return tensors
    renamed = {}
    for key, value in tensors.items():
        new, converter = rename_source_key(key, renamings, converters)
        if converter is not None:
            raise PackageError(f"{where}: tensor {key!r} needs a weight conversion sdkiln does not run")
        renamed[new] = value
    return renamed


def _image_processor(pkg: Package, name: str, cls: type) -> Any:
    rel = f"{name}/preprocessor_config.json"
    config = expect_dict(pkg.read_json(rel), rel)
    with third_party(rel, f"building {cls.__name__}"):
        return cls.from_dict(config)


def _scheduler(pkg: Package, name: str, cls: type) -> Any:
    rel = f"{name}/scheduler_config.json"
    config = check_config_types(cls, expect_dict(pkg.read_json(rel), rel), rel)
    for key, (lo, hi) in SCHEDULER_BOUNDS.items():
        if key in config:
            expect_int(config[key], f"{rel}: {key}", lo, hi)
    with third_party(rel, f"building {cls.__name__}"):
        return cls.from_config(config)


def _guider(pkg: Package, name: str, cls: type) -> Any:
    """A guider (diffusers' classifier-free guidance and kin): settings only, like a scheduler."""
    rel = f"{name}/guider_config.json"
    config = check_config_types(cls, expect_dict(pkg.read_json(rel), rel), rel)
    with third_party(rel, f"building {cls.__name__}"):
        return cls.from_config(config)


def _from_files(pkg: Package, name: str, cls: type) -> Any:
    """Tokenizers and processors read their files by path: the verified bytes are written to a private
    directory for them, so they read exactly what was verified."""
    files = _files_of(pkg, name, "")
    for rel in files:
        if rel.endswith(".json"):
            expect_dict(pkg.read_json(rel), rel)  # the strict JSON limits, before the tokenizer's parser
    with tempfile.TemporaryDirectory(prefix="sdkiln-tok-") as tmp:
        for rel in files:
            target = Path(tmp) / Path(rel).relative_to(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(pkg.data(rel))
        with third_party(f"{name}/", f"loading {cls.__name__}"):
            return cls.from_pretrained(tmp, local_files_only=True)


def _check_max_length(tokenizer: Any, name: str) -> None:
    # Pipelines pad CLIP prompts to model_max_length. The tokenizers library allocates that many
    # tokens (and aborts the process when it cannot); at 2^64 and above (transformers' "no limit",
    # int(1e30)) it refuses with an OverflowError, which a run reports as one RunError.
    length = tokenizer.model_max_length
    if type(length) is not int:
        raise PackageError(
            f"{name}/tokenizer_config.json: model_max_length must be an integer, got {short(length)}"
        )
    if MAX_TOKENIZER_LENGTH < length < 2**64:
        raise PackageError(
            f"{name}/tokenizer_config.json: model_max_length {length}: padding to it would allocate "
            f"that many tokens (at most {MAX_TOKENIZER_LENGTH:,}, or transformers' 'no limit')"
        )


def _tokenizer(pkg: Package, name: str, cls: type) -> Any:
    tokenizer = _from_files(pkg, name, cls)
    _check_max_length(tokenizer, name)
    return tokenizer


def _processor(pkg: Package, name: str, cls: type) -> Any:
    """A transformers processor (its tokenizer, image processor and chat template, from JSON files):
    its tokenizer is held to a tokenizer's limits."""
    processor = _from_files(pkg, name, cls)
    if getattr(processor, "tokenizer", None) is not None:
        _check_max_length(processor.tokenizer, name)
    return processor


def load_component(
    pkg: Package,
    name: str,
    library: str,
    class_name: str,
    declared: Any = None,
    device: torch.device | None = None,
    prepare: Prepare | None = None,
) -> Any:
    """One component from its files, a model's weights on ``device`` when given. ``declared``, the
    pipeline's annotation for it, is checked before anything is built: a model must be of the
    declared class (a transformer posing as a VAE is refused before its constructor runs).
    ``prepare(name, model)`` runs on a model built on meta, before its weights load (the package
    sections' ``component`` handlers: a quantized text encoder's modules)."""
    from diffusers import ModelMixin, SchedulerMixin
    from diffusers.guiders.guider_utils import BaseGuidance
    from transformers import ImageProcessingMixin, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

    if library not in LIBRARIES and not library.startswith(ZOO_COMPONENTS):
        raise PackageError(f"model_index.json: component {name!r} comes from {library!r}, not {LIBRARIES}")
    cls = resolve_class(
        f"{library}:{class_name}", object, f"component {name!r}", modules=(*LIBRARIES, ZOO_COMPONENTS)
    )
    if isinstance(cls, type) and issubclass(cls, ProcessorMixin):  # Qwen2VLProcessor without torchvision
        from sdkiln.model_zoo.qwen_vl_processor import substitute

        cls = substitute(library, class_name, where=name) or cls
    if library not in LIBRARIES and not issubclass(cls, ProcessorMixin):
        raise PackageError(f"model_index.json: component {name!r} is sdkiln's {class_name}, not a processor")
    if (
        isinstance(declared, type)
        and issubclass(declared, nn.Module)
        and not issubclass(cls, declared)
        # a head of the declared model on its config (CLIPVisionModelWithProjection for a pipeline typed
        # CLIPVisionModel: Wan image-to-video's published image encoder), not any model of that config
        and not (
            library == "transformers"
            and cls.__name__.startswith(declared.__name__)
            and getattr(cls, "config_class", None) is getattr(declared, "config_class", 0)
        )
    ):
        raise PackageError(
            f"model_index.json: {name} is a {class_name}, the pipeline takes a {declared.__name__}"
        )
    if issubclass(cls, ModelMixin | PreTrainedModel):
        return _model(pkg, name, cls, library, device, prepare)
    if issubclass(cls, SchedulerMixin):
        return _scheduler(pkg, name, cls)
    if issubclass(cls, BaseGuidance):
        return _guider(pkg, name, cls)
    if issubclass(cls, PreTrainedTokenizerBase):
        return _tokenizer(pkg, name, cls)
    if issubclass(cls, ImageProcessingMixin):
        return _image_processor(pkg, name, cls)
    if issubclass(cls, ProcessorMixin):
        return _processor(pkg, name, cls)
    raise PackageError(f"model_index.json: component {name!r} is a {class_name}, which sdkiln does not load")


def assemble(
    pkg: Package,
    pipeline_cls: type,
    transformers: dict[str, nn.Module],
    device: torch.device | None = None,
    prepare: Prepare | None = None,
) -> Any:
    """The pipeline from ``model_index.json``: each listed component loaded from the package (its
    weights on ``device`` when given; ``prepare`` as in ``load_component``), the transformers given
    (by attribute: the package's, and an expert's), checked against what the pipeline class takes."""
    index = expect_dict(pkg.read_json("model_index.json"), "model_index.json")
    if index.get("_class_name") != pipeline_cls.__name__:
        raise PackageError(
            f"model_index.json: _class_name {index.get('_class_name')!r} but the manifest names "
            f"{pipeline_cls.__name__}"
        )
    params = inspect.signature(pipeline_cls.__init__).parameters
    components: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        if name not in params or name == "self":
            raise PackageError(f"model_index.json: {pipeline_cls.__name__} takes no component {name!r}")
        if name in transformers:
            transformer = transformers[name]
            if entry != [type(transformer).__module__.split(".")[0], type(transformer).__name__]:
                raise PackageError(
                    f"model_index.json: {name} must be {['diffusers', type(transformer).__name__]}, got {entry!r}"
                )
            components[name] = transformer
            continue
        param = params[name]
        if not isinstance(entry, list):  # a pipeline setting (Wan's boundary_ratio), not a component
            accepted = _accepted_kinds(param)
            if accepted is None or _kind(entry) not in accepted - {"list", "object"}:
                raise PackageError(f"model_index.json: {name!r} must be [library, class], got {short(entry)}")
            components[name] = entry
            continue
        if len(entry) != 2 or not all(e is None or isinstance(e, str) for e in entry):
            raise PackageError(
                f"model_index.json: component {name!r} must be [library, class], got {entry!r}"
            )
        if entry[0] is None or entry[1] is None:
            if param.default is inspect.Parameter.empty:
                raise PackageError(f"model_index.json: {pipeline_cls.__name__} needs component {name!r}")
            components[name] = None
        else:
            components[name] = load_component(
                pkg, name, *entry, declared=param.annotation, device=device, prepare=prepare
            )
    missing = [
        n
        for n, p in params.items()
        if n != "self"
        and p.default is inspect.Parameter.empty
        and n not in components
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if missing:
        raise PackageError(f"model_index.json: {pipeline_cls.__name__} needs component {missing[0]!r}")
    _check_vocabularies(components)
    if pipeline_cls.__module__.startswith("sdkiln."):  # our own pipeline: a failure is our bug
        return pipeline_cls(**components)
    with third_party("model_index.json", f"assembling {pipeline_cls.__name__}"):
        return pipeline_cls(**components)


def _check_vocabularies(components: dict[str, Any]) -> None:
    """Each tokenizer's ids must index its text encoder's embedding (``tokenizer_2`` feeds
    ``text_encoder_2``, a ``processor``'s tokenizer ``text_encoder``): a token added in a tokenizer file
    would otherwise fail inside the model."""
    for name, component in components.items():
        if name == "processor":
            tokenizer, encoder_name = getattr(component, "tokenizer", None), "text_encoder"
        elif name.startswith("tokenizer"):
            tokenizer, encoder_name = component, name.replace("tokenizer", "text_encoder")
        else:
            continue
        encoder = components.get(encoder_name)
        if tokenizer is None or not hasattr(encoder, "get_input_embeddings"):
            continue
        rows = encoder.get_input_embeddings().num_embeddings
        if len(tokenizer) > rows:
            raise PackageError(
                f"{name}/: the tokenizer has {len(tokenizer)} tokens, but {encoder_name} embeds only {rows}"
            )
