"""LoRA on a loaded package: diffusers' calls, run as unmerged low-rank branches beside the layers.

``sdkiln.load`` gives every package pipeline diffusers' LoRA calls (:data:`METHODS`):
``load_lora_weights``, ``set_adapters``, ``disable_lora`` / ``enable_lora``, ``delete_adapters``,
``unload_lora_weights``, ``fuse_lora`` / ``unfuse_lora``, ``get_active_adapters``,
``get_list_adapters`` and ``enable_lora_hotswap``, with diffusers' names and meanings. Their state lives
in a :class:`LoraRunner` at ``pipe.sdkiln_lora``. peft is not used: a package's quantized modules are
not ``nn.Linear``, which is all peft's LoRA layers wrap.

**Formats.** A LoRA is a safetensors file or a state dict. It is normalized by the family's diffusers
converter (``<Pipeline>.lora_state_dict``: diffusers/peft keys, kohya/A1111, the FLUX community
formats), never by ours, to ``transformer.<layer>.lora_A.weight`` [r, K] and ``.lora_B.weight`` [N, r]
with an optional alpha per layer (the branch's scale is alpha / r, 1 without one). Only files ending in
``.safetensors`` are read (no pickles); a key this runtime cannot apply (a text encoder's, a LoRA bias,
a DoRA magnitude, a layer that is no linear of the transformer, a shape that is not the layer's) is
one :class:`~sdkiln.errors.SdkilnError` naming it, before anything changes.

**The branch.** Each targeted layer (a quantized module, a float ``nn.Linear``, or a SmoothQuant
``SmoothedLinear`` taken whole) gets three non-persistent buffers: ``lora_a`` [C, K], ``lora_b`` [N, C]
in the model's dtype and ``lora_scale`` [C] in fp32, C being the layer's rank capacity; and a forward
hook that adds ``sdkiln.lora_add(x, lora_a, lora_b, lora_scale, y)`` (``kernels.ops.lora``) to the
layer's output ``y``, from its input ``x`` (inside the layer's diffusers hooks where it has some: Ulysses
gathers the output projection's tokens after the branch): the unquantized input, in the model's dtype, on every
scheme. The adapters loaded at once sit side by side along C (an adapter has the same columns on
every layer it targets); a column's scale is its adapter's strength times alpha / r, 0 when the
adapter is inactive or disabled, and 0 in the padding. Where SmoothQuant folded its 1/s into the
modulation before the layer (the layer sees ``x / s``), the columns of A are multiplied by s on load,
so the branch sees the model's ``x``.

**No recompile.** Strengths, enable/disable and loading an adapter into free or freed columns change
buffer values in place (``copy_``), which neither Dynamo's guards nor a captured CUDA graph see.
Growing a layer's capacity or targeting a new layer adds buffers or hooks, which recompiles once; on a
package loaded with ``compile`` that is refused in one line, unless ``enable_lora_hotswap`` prepared
the capacity first (before its first compiled run, a package takes new layers freely).
``unload_lora_weights`` removes the buffers and hooks: the package is as loaded.

**Fusing.** ``fuse_lora`` merges the branch into float ``nn.Linear`` weights (the originals are kept
on the host so that ``unfuse_lora`` restores them exactly). A quantized weight cannot take a LoRA
without re-quantizing, so fusing a LoRA that targets a quantized layer is refused; ``sdkiln optimize
--lora`` fuses into the float model before calibration instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sdkiln.errors import SdkilnError
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.smooth import SmoothedLinear

log = logging.getLogger("sdkiln.load")

METHODS = (
    "load_lora_weights",
    "set_adapters",
    "disable_lora",
    "enable_lora",
    "delete_adapters",
    "unload_lora_weights",
    "fuse_lora",
    "unfuse_lora",
    "get_active_adapters",
    "get_list_adapters",
    "enable_lora_hotswap",
)
"""diffusers' LoRA calls a package pipeline gets, each a method of :class:`LoraRunner`."""

CONVERTERS = {
    "FluxTransformer2DModel": "FluxPipeline",
    "SD3Transformer2DModel": "StableDiffusion3Pipeline",
    "WanTransformer3DModel": "WanPipeline",
    "HunyuanVideoTransformer3DModel": "HunyuanVideoPipeline",
    "HunyuanVideo15Transformer3DModel": "HunyuanVideoPipeline",
    "QwenImageTransformer2DModel": "QwenImagePipeline",
    "Flux2Transformer2DModel": "Flux2Pipeline",
}
"""The diffusers pipeline whose ``lora_state_dict`` normalizes a LoRA for a transformer class, where the
package's own pipeline class has none (the embedded model's)."""

_A, _B = ".lora_A.weight", ".lora_B.weight"
OTHER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer_2", "prior")


def _targetable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | QuantLinear | SmoothedLinear)


def _features(module: nn.Module) -> tuple[int, int]:
    inner = module.linear if isinstance(module, SmoothedLinear) else module
    return inner.in_features, inner.out_features


def _model_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the layer computes in: a float weight's, else its bias's or its scales' float type."""
    inner = module.linear if isinstance(module, SmoothedLinear) else module
    for t in (getattr(inner, "weight", None), getattr(inner, "bias", None)):
        if isinstance(t, Tensor) and t.is_floating_point() and t.element_size() > 1:
            return t.dtype
    return torch.float32


def _branch(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return torch.ops.sdkiln.lora_add(args[0], module.lora_a, module.lora_b, module.lora_scale, output)


class _InnerBranch:
    """The branch of a layer that carries diffusers hooks (sequence parallelism's gather on the output
    projection): put inside the innermost hook, around the layer's own forward, so that it sees the
    layer's own input and output (this rank's tokens) and the hooks act on the sum. ``remove`` puts
    the forward back."""

    def __init__(self, module: nn.Module):
        self.ref = module._diffusers_hook._fn_refs[0]
        self.attr = (
            "original_forward" if getattr(self.ref, "original_forward", None) is not None else "forward"
        )
        self.original = original = getattr(self.ref, self.attr)

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            return _branch(module, args, original(*args, **kwargs))

        setattr(self.ref, self.attr, forward)

    def remove(self) -> None:
        setattr(self.ref, self.attr, self.original)


def read_lora(
    source: str | Path | Mapping[str, Tensor], weight_name: str | None, converter: type
) -> dict[str, Tensor]:
    """The LoRA's tensors, normalized by the family's diffusers converter to diffusers' keys, with
    the alphas under ``<layer>.alpha``."""
    if isinstance(source, Mapping):
        state = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            if weight_name is None:
                found = sorted(path.glob("*.safetensors"))
                if len(found) != 1:
                    raise SdkilnError(
                        f"load_lora_weights: {path} holds {len(found)} .safetensors files: give weight_name"
                    )
                path = found[0]
            else:
                path = path / weight_name
        if path.suffix != ".safetensors":
            raise SdkilnError(f"load_lora_weights: {path}: only .safetensors files are read (no pickles)")
        if not path.is_file():
            raise SdkilnError(f"load_lora_weights: {path}: no such file")
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a corrupt file is one line
            raise SdkilnError(f"load_lora_weights: {path}: not a readable safetensors file ({exc})") from None
    if not state or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise SdkilnError("load_lora_weights: the LoRA must map names to tensors, and hold some")
    try:
        out = converter.lora_state_dict(state, return_alphas=True)
    except TypeError:  # converters without alphas (alpha already in A and B)
        out = converter.lora_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - diffusers' converters raise what they raise
        raise SdkilnError(f"load_lora_weights: {converter.__name__} cannot read this LoRA: {exc}") from None
    normalized, alphas = (out if isinstance(out, tuple) else (out, None))[:2]
    normalized = dict(normalized)
    for key, value in (alphas or {}).items():
        normalized[key] = value if isinstance(value, Tensor) else torch.tensor(float(value))
    return normalized


def converter_for(pipeline_cls: type, transformer: nn.Module) -> type:
    """The class whose ``lora_state_dict`` normalizes a LoRA: the pipeline's own, else by transformer
    class (:data:`CONVERTERS`)."""
    if hasattr(pipeline_cls, "lora_state_dict"):
        return pipeline_cls
    name = CONVERTERS.get(type(transformer).__name__)
    if name is None:
        raise SdkilnError(f"load_lora_weights: no diffusers LoRA converter for {type(transformer).__name__}")
    import diffusers

    return getattr(diffusers, name)


def lora_layers(
    state: dict[str, Tensor], transformer: nn.Module, is_target: Callable[[str, nn.Module], bool]
) -> dict[str, tuple[Tensor, Tensor, float | None]]:
    """layer -> (A, B, alpha), every key checked before anything changes."""
    layers: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        component, _, rest = key.partition(".")
        if component in OTHER_COMPONENTS:
            raise SdkilnError(
                f"load_lora_weights: {key}: LoRA layers of the {component} are not supported on a package "
                "(the transformer's are)"
            )
        body = rest if component == "transformer" else key
        for suffix, slot in ((_A, "a"), (_B, "b"), (".alpha", "alpha")):
            if body.endswith(suffix):
                layers.setdefault(body.removesuffix(suffix), {})[slot] = value
                break
        else:
            raise SdkilnError(
                f"load_lora_weights: {key}: not a tensor this runtime applies (lora_A, lora_B, alpha; no "
                "LoRA bias or DoRA magnitude)"
            )
    out = {}
    for layer, parts in layers.items():
        if "a" not in parts or "b" not in parts:
            raise SdkilnError(f"load_lora_weights: {layer}: needs both lora_A and lora_B")
        try:
            module = transformer.get_submodule(layer)
        except AttributeError:
            raise SdkilnError(f"load_lora_weights: {layer}: no such layer in the transformer") from None
        if not is_target(layer, module):
            raise SdkilnError(
                f"load_lora_weights: {layer}: a {type(module).__name__}, not a linear a LoRA targets"
            )
        a, b = parts["a"], parts["b"]
        k, n = _features(module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
            raise SdkilnError(
                f"load_lora_weights: {layer}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"the layer ({k} -> {n})"
            )
        if not (
            a.is_floating_point() and b.is_floating_point() and a.isfinite().all() and b.isfinite().all()
        ):
            raise SdkilnError(f"load_lora_weights: {layer}: lora_A and lora_B must be finite float tensors")
        alpha = parts.get("alpha")
        out[layer] = (a, b, None if alpha is None else float(alpha))
    if not out:
        raise SdkilnError("load_lora_weights: the LoRA targets no layer of the transformer")
    return out


@dataclass
class Adapter:
    """One loaded LoRA: its columns (the same on every layer it targets) and, per layer, alpha / r."""

    name: str
    rank: int
    start: int
    layers: dict[str, float]
    """layer name -> alpha / r"""
    weight: float = 1.0
    active: bool = True


@dataclass
class LoraRunner:
    """The LoRA state of one package pipeline (module docstring)."""

    pipeline: Any
    transformer: nn.Module
    compiled: bool
    folded: dict[str, Tensor] | Callable[[], dict[str, Tensor]]
    """layer name -> SmoothQuant's s, where 1/s is folded into the modulation before the layer; or what
    reads them from the package, called at the first ``load_lora_weights`` (a package without a LoRA
    never reads its calibration stats)"""
    adapters: dict[str, Adapter] = field(default_factory=dict)
    capacity: int = 0
    """the rank capacity C of every targeted layer"""
    hotswap_rank: int | None = None
    enabled: bool = True
    hooks: dict[str, Any] = field(default_factory=dict)
    fused: dict[str, Tensor] = field(default_factory=dict)
    """float layer name -> its weight before ``fuse_lora`` (on the host)"""
    fused_names: set[str] = field(default_factory=set)
    dtype: torch.dtype | None = None
    """the model's dtype, which A and B are stored in (the package's; else each layer's float dtype)"""
    cache_policy: str = "headroom"
    cache_margin_db: float | None = None
    """the headroom policy's margin; None: ``runtime.cache.headroom.DEFAULT_MARGIN_DB``"""

    # ---- diffusers' calls ----

    def enable_lora_hotswap(self, target_rank: int = 128, check_compiled: str = "error") -> None:
        """Before the first LoRA: give every layer a LoRA may target a capacity of ``target_rank``
        columns now, so that loading, swapping and mixing adapters up to that many ranks in all never
        adds a buffer or a hook (no recompile under ``compile``). diffusers' call; ``check_compiled``
        is accepted for its signature."""
        if self.adapters or self.hooks:
            raise SdkilnError("enable_lora_hotswap: call it before the first load_lora_weights")
        if not isinstance(target_rank, int) or target_rank < 1:
            raise SdkilnError(f"enable_lora_hotswap: target_rank must be a positive int, got {target_rank!r}")
        self.hotswap_rank = target_rank
        self._prepare(
            [name for name, m in self.transformer.named_modules() if self._is_target(name, m)], target_rank
        )

    def load_lora_weights(
        self,
        pretrained_model_name_or_path_or_dict: str | Path | Mapping[str, Tensor],
        adapter_name: str | None = None,
        hotswap: bool = False,
        **kwargs: Any,
    ) -> None:
        """Load a LoRA as ``adapter_name`` (default ``default_N``), active at strength 1 beside the
        adapters already active. ``hotswap=True`` replaces the adapter of that name in place."""
        for key in kwargs:
            if key not in ("weight_name", "low_cpu_mem_usage", "local_files_only"):
                raise SdkilnError(f"load_lora_weights: unsupported argument {key!r} on a package")
        converter = converter_for(type(self.pipeline), self.transformer)
        state = read_lora(pretrained_model_name_or_path_or_dict, kwargs.get("weight_name"), converter)
        layers = lora_layers(state, self.transformer, self._is_target)
        rank = max(a.shape[0] for a, _, _ in layers.values())
        name = adapter_name or f"default_{len(self.adapters)}"
        old = self.adapters.get(name)
        if old is not None and not hotswap:
            raise SdkilnError(
                f"load_lora_weights: adapter {name!r} is already loaded (hotswap=True replaces it)"
            )
        if hotswap and old is None:
            raise SdkilnError(
                f"load_lora_weights: hotswap=True, but no adapter {name!r} is loaded to replace"
            )
        start = self._columns_for(name, rank, replacing=old)
        new = [layer for layer in layers if layer not in self.hooks]
        need = max(self.capacity, start + rank)
        if self._compiled_graphs() and (new or need > self.capacity):
            what = (
                f"layers no LoRA prepared ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})"
                if new
                else (f"{start + rank} ranks in all, above the {self.capacity} prepared")
            )
            raise SdkilnError(
                f"load_lora_weights: {name!r} needs {what}; this package has run compiled, and adding them would "
                "recompile it: call pipe.enable_lora_hotswap(target_rank=...) before the first LoRA"
            )
        self._prepare(list(self.hooks) + new, need)
        if old is not None:
            self._zero(old)
        if callable(self.folded):
            self.folded = self.folded()
        folded = self.folded
        adapter = Adapter(name, rank, start, {}, weight=old.weight if old else 1.0)
        with torch.no_grad():
            for layer, (a, b, alpha) in layers.items():
                module = self._module(layer)
                r = a.shape[0]
                cols = slice(start, start + r)
                a = a.to(torch.float64)
                if layer in folded:  # the layer sees x / s: A's columns times s
                    a = a * folded[layer].to(torch.float64)
                module.lora_a[cols].copy_(a.to(module.lora_a.dtype))
                module.lora_b[:, cols].copy_(b.to(module.lora_b.dtype))
                adapter.layers[layer] = (alpha if alpha is not None else r) / r
        self.adapters[name] = adapter
        self._apply_scales()
        log.info("LoRA %r: rank %d on %d layers", name, rank, len(layers))

    def set_adapters(
        self, adapter_names: str | list[str], weights: float | list[float] | None = None
    ) -> None:
        """Make exactly ``adapter_names`` active, with these strengths (1 where None)."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if weights is None or isinstance(weights, int | float):
            weights = [1.0 if weights is None else float(weights)] * len(names)
        weights = list(weights)
        if len(weights) != len(names):
            raise SdkilnError(f"set_adapters: {len(names)} adapters but {len(weights)} weights")
        for name in names:
            self._adapter(name)
        for w in weights:
            if not isinstance(w, int | float) or not math.isfinite(w):
                raise SdkilnError(f"set_adapters: a weight must be a finite number, got {w!r}")
        for adapter in self.adapters.values():
            adapter.active = adapter.name in names
        for name, w in zip(names, weights, strict=True):
            self.adapters[name].weight = float(w)
        self._apply_scales()

    def disable_lora(self) -> None:
        """Run without any adapter (their strengths are kept for ``enable_lora``)."""
        self.enabled = False
        self._apply_scales()

    def enable_lora(self) -> None:
        self.enabled = True
        self._apply_scales()

    def delete_adapters(self, adapter_names: str | list[str]) -> None:
        """Drop these adapters; their columns are zeroed and free for the next load."""
        for name in [adapter_names] if isinstance(adapter_names, str) else list(adapter_names):
            self._zero(self._adapter(name))
            del self.adapters[name]
        self._apply_scales()

    def unload_lora_weights(self) -> None:
        """Remove every adapter, buffer and hook: the package runs as loaded, bit for bit."""
        if self.fused:
            raise SdkilnError("unload_lora_weights: a LoRA is fused; call unfuse_lora first")
        for layer, handle in self.hooks.items():
            handle.remove()
            module = self._module(layer)
            for buffer in ("lora_a", "lora_b", "lora_scale"):
                module._buffers.pop(buffer, None)
        self.hooks.clear()
        self.adapters.clear()
        self.capacity = 0
        self._sync_cache()
        if self.hotswap_rank is not None:
            self.enable_lora_hotswap(self.hotswap_rank)

    def fuse_lora(
        self,
        components: Iterable[str] = ("transformer",),
        lora_scale: float = 1.0,
        adapter_names=None,
        **_: Any,
    ) -> None:
        """Merge the active adapters (or ``adapter_names``) into float layers' weights, times
        ``lora_scale``; refused where they target a quantized layer (module docstring)."""
        if self.fused:
            raise SdkilnError("fuse_lora: a LoRA is already fused; call unfuse_lora first")
        memory = getattr(self.pipeline, "sdkiln_memory", None)
        if memory is not None and memory.plan.blocks_per_group:
            raise SdkilnError(
                f"fuse_lora: the transformer's blocks stream from host copies (memory plan {memory.plan.name}), "
                "which a fused weight would not reach; keep the LoRA as a branch (set_adapters sets its strength)"
            )
        names = (
            [a.name for a in self.adapters.values() if a.active]
            if adapter_names is None
            else list(adapter_names)
        )
        chosen = [self._adapter(n) for n in names]
        layers = sorted({layer for a in chosen for layer in a.layers})
        quantized = [layer for layer in layers if not isinstance(self._module(layer), nn.Linear)]
        if quantized:
            raise SdkilnError(
                f"fuse_lora: {len(quantized)} of the layers it targets are quantized ({quantized[0]}, ...); a "
                "quantized weight cannot take a LoRA without re-quantizing: keep it as a branch (set_adapters "
                "sets its strength) or fuse it before quantization with `sdkiln optimize --lora FILE`"
            )
        with torch.no_grad():
            for layer in layers:
                module = self._module(layer)
                self.fused[layer] = module.weight.detach().to("cpu", copy=True)
                delta = torch.zeros(module.weight.shape, dtype=torch.float32, device=module.weight.device)
                for a in chosen:
                    if layer in a.layers:
                        cols = slice(a.start, a.start + a.rank)
                        s = lora_scale * a.weight * a.layers[layer]
                        delta += s * module.lora_b[:, cols].float() @ module.lora_a[cols].float()
                module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
        self.fused_names = set(names)
        self._apply_scales()

    def unfuse_lora(self, components: Iterable[str] = ("transformer",), **_: Any) -> None:
        with torch.no_grad():
            for layer, weight in self.fused.items():
                self._module(layer).weight.copy_(weight)
        self.fused.clear()
        self.fused_names = set()
        self._apply_scales()

    def set_cache_policy(self, policy: str = "headroom", margin_db: float | None = None) -> None:
        """What a package's cache schedule does while a LoRA changes the model (sdkiln's, not
        diffusers'): ``headroom`` steps up to a safer schedule of its search front (``margin_db``
        safer; default 3 dB), ``keep`` keeps it, ``off`` computes every step (``runtime.cache.headroom``)."""
        from sdkiln.runtime.cache.headroom import check_policy  # the cache hooks import diffusers' hooks

        check_policy(policy, margin_db)
        self.cache_policy, self.cache_margin_db = policy, margin_db
        self._sync_cache()

    def get_active_adapters(self) -> list[str]:
        return [a.name for a in self.adapters.values() if a.active] if self.enabled else []

    def get_list_adapters(self) -> dict[str, list[str]]:
        return {"transformer": list(self.adapters)}

    # ---- internals ----

    def _compiled_graphs(self) -> bool:
        """Whether the transformer has run compiled: from then on, a new hook or a larger buffer
        would recompile it."""
        phases = getattr(getattr(self.pipeline, "sdkiln_cold_start", None), "phases", {})
        return self.compiled and "first_step" in phases

    def _is_target(self, name: str, module: nn.Module) -> bool:
        """A layer a LoRA may target: a linear of the transformer, a SmoothedLinear taken whole."""
        if not name or not _targetable(module):
            return False
        parent = name.rpartition(".")[0]
        return not (parent and isinstance(self._module(parent), SmoothedLinear))

    def _module(self, name: str) -> nn.Module:
        return self.transformer.get_submodule(name)

    def _adapter(self, name: str) -> Adapter:
        if name not in self.adapters:
            raise SdkilnError(
                f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})"
            )
        return self.adapters[name]

    def _columns_for(self, name: str, rank: int, replacing: Adapter | None) -> int:
        """Where the adapter's columns start: its predecessor's, if it fits there, else the first free
        run that fits (the end of the used columns)."""
        if replacing is not None and rank <= replacing.rank:
            return replacing.start
        used = sorted((a.start, a.start + a.rank) for a in self.adapters.values() if a is not replacing)
        start = 0
        for lo, hi in used:
            if lo - start >= rank:
                return start
            start = max(start, hi)
        if self.hotswap_rank is not None and start + rank > self.capacity:
            raise SdkilnError(
                f"load_lora_weights: {name!r} has rank {rank}; with the adapters loaded that is {start + rank} ranks, "
                f"above enable_lora_hotswap's target_rank {self.capacity}"
            )
        return start

    def _prepare(self, layers: list[str], capacity: int) -> None:
        """Give each layer ``capacity`` columns (keeping what is there) and its hook."""
        for layer in layers:
            module = self._module(layer)
            k, n = _features(module)
            old = module._buffers.get("lora_a")
            if old is None or old.shape[0] < capacity:
                dtype = (self.dtype or _model_dtype(module)) if old is None else old.dtype
                device = next(iter([*module.parameters(), *module.buffers()]), torch.empty(0)).device
                a = torch.zeros(capacity, k, dtype=dtype, device=device)
                b = torch.zeros(n, capacity, dtype=dtype, device=device)
                scale = torch.zeros(capacity, dtype=torch.float32, device=device)
                if old is not None:
                    a[: old.shape[0]] = old
                    b[:, : old.shape[0]] = module.lora_b
                    scale[: old.shape[0]] = module.lora_scale
                for buffer, value in (("lora_a", a), ("lora_b", b), ("lora_scale", scale)):
                    module.register_buffer(buffer, value, persistent=False)
            if layer not in self.hooks:
                registry = getattr(module, "_diffusers_hook", None)
                inner = registry is not None and registry._fn_refs
                self.hooks[layer] = _InnerBranch(module) if inner else module.register_forward_hook(_branch)
        self.capacity = max(self.capacity, capacity)

    def _zero(self, adapter: Adapter) -> None:
        cols = slice(adapter.start, adapter.start + adapter.rank)
        with torch.no_grad():
            for layer in self.hooks:
                module = self._module(layer)
                module.lora_a[cols].zero_()
                module.lora_b[:, cols].zero_()
                module.lora_scale[cols].zero_()

    def _apply_scales(self) -> None:
        """Each column's scale from its adapter's state, written in place."""
        with torch.no_grad():
            for layer in self.hooks:
                module = self._module(layer)
                scale = torch.zeros(module.lora_scale.shape[0], dtype=torch.float32)
                for a in self.adapters.values():
                    on = self.enabled and a.active and a.name not in self.fused_names
                    if on and layer in a.layers:
                        scale[a.start : a.start + a.rank] = a.weight * a.layers[layer]
                module.lora_scale.copy_(scale)
        self._sync_cache()

    def _sync_cache(self) -> None:
        """The cache schedule for the model as it now is: changed while an adapter runs with a
        nonzero strength or one is fused."""
        on = [
            a
            for a in self.adapters.values()
            if self.enabled and a.active and a.weight != 0 and a.name not in self.fused_names
        ]
        from sdkiln.runtime.cache.headroom import follow

        follow(self.transformer, bool(on or self.fused), self.cache_policy, self.cache_margin_db)


def attach(
    pipeline: Any,
    transformer: nn.Module,
    compiled: bool,
    folded: dict[str, Tensor] | Callable[[], dict[str, Tensor]],
) -> None:
    """Give ``pipeline`` its :class:`LoraRunner` (``pipeline.sdkiln_lora``) and diffusers' LoRA calls."""
    name = getattr(pipeline, "sdkiln_manifest", {}).get("model", {}).get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    runner = LoraRunner(
        pipeline, transformer, compiled, folded, dtype=dtype if isinstance(dtype, torch.dtype) else None
    )
    pipeline.sdkiln_lora = runner
    for method in METHODS:  # instance attributes, over the class's peft-based methods where it has them
        object.__setattr__(pipeline, method, getattr(runner, method))
