"""What sdkiln knows about one model family, as data (STYLE.md habit 6).

Generic code (optimizer, calibration, cache hooks, the attention seam) never branches on a model
name: it reads the spec. A spec names the transformer's block lists, how each block kind passes
hidden states, the layers that stay in float, where its attention runs and which tokens are text,
the default recipe, how the family's pipeline is called, and builds a tiny random-weight pipeline
of the real diffusers classes for tests and smoke runs.

A family is not its test build: its ``variants`` are the published models (FLUX.1-dev, FLUX.1-schnell)
and the zoo's own build ("tiny"), told apart by their transformer's width, each with its own call
defaults. A spec object is always resolved to one variant (``ModelSpec.resolve``); the zoo's ``SPEC``
is the family resolved to the build it makes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sdkiln.errors import ModelError


@dataclass(frozen=True)
class BlockList:
    """One list of transformer blocks, e.g. FLUX's ``transformer_blocks``.

    ``inputs`` are the forward argument names that carry hidden states into a block and
    ``outputs`` the names of what the block returns, in return order. FLUX's double block takes
    ``(hidden_states, encoder_hidden_states)`` and returns ``(encoder_hidden_states, hidden_states)``.
    """

    attr: str
    inputs: tuple[str, ...] = ("hidden_states",)
    outputs: tuple[str, ...] = ("hidden_states",)


@dataclass(frozen=True)
class SmoothFold:
    """Where SmoothQuant can fold its per-channel factor s exactly: an adaLN modulation.

    In every block of the block list ``block_list``, the Linears ``consumers`` (names relative to the
    block) all read ``LN(x) * (1 + scale) + shift`` -- a LayerNorm without affine -- and nothing else
    does; ``shift`` and ``scale`` are chunks ``shift`` and ``scale`` of the ``chunks``-way split of the
    float Linear ``source``'s output, and nothing else reads those two chunks. Dividing that input by
    s is then exact by rewriting ``source``'s rows: shift rows ``W/s, b/s``; scale rows
    ``W/s, (b + 1)/s - 1``. (A LayerNorm's own affine would be the other exact place; FLUX-style
    blocks have none in front of their Linears.)
    """

    block_list: str
    source: str
    consumers: tuple[str, ...]
    chunks: int
    shift: int
    scale: int


TEXT_PLACES = ("none", "first", "last", "all")
KEY_CALLS = ("text", "image")

CAPABILITIES = ("quant", "cache", "sparse", "cfg-parallel", "ulysses", "ring", "compile", "ascend", "onnx")
"""What a family can be put through; ``ModelSpec.refusals`` names those it cannot, each with its reason
(docs/families.md is the table, tests/families the suite that checks both the capabilities and the refusals)."""


@dataclass(frozen=True)
class AttentionSite:
    """Attention modules of one kind, as the attention seam (``sdkiln.runtime.attention``) routes them.

    ``modules`` is an fnmatch pattern over the transformer's module names whose ``processor`` is a
    ``processor`` (its class name). ``call`` is how that diffusers processor computes attention:
    ``"dispatch"``, through ``dispatch_attention_fn`` with [B, S, H, D] tensors (FLUX, Wan), or
    ``"sdpa"``, through ``F.scaled_dot_product_attention`` with [B, H, S, D] (SD3's joint
    processor). ``query_text`` and ``key_text`` say where the text tokens are among the queries and
    the keys: ``"first"``/``"last"`` (a joint sequence: as many as the transformer's text argument
    has tokens), ``"all"`` (cross-attention keys) or ``"none"``.

    ``key_calls`` names, in order, the attention calls the processor makes per module call, all with the
    same queries, by what their keys are: ``"text"``, the keys ``key_text`` describes (the site's own
    sequence with its text where ``key_text`` says; only text when ``"all"``), or ``"image"``, an image
    context's tokens and nothing else (Wan2.1 image-to-video's ``attn2`` first attends over its CLIP
    image tokens, then over the text: ``("image", "text")``). Keys that are context only, all text or
    an image context, are not the transformer's own tokens: whole on every rank, never made sparse.
    """

    modules: str
    processor: str
    call: str = "dispatch"
    query_text: str = "none"
    key_text: str = "none"
    key_calls: tuple[str, ...] = ("text",)

    def __post_init__(self) -> None:
        if self.call not in ("dispatch", "sdpa"):
            raise ValueError(f"AttentionSite.call is 'dispatch' or 'sdpa', got {self.call!r}")
        if self.query_text not in TEXT_PLACES or self.key_text not in TEXT_PLACES:
            raise ValueError(f"AttentionSite text places are {TEXT_PLACES}")
        if not self.key_calls or any(k not in KEY_CALLS for k in self.key_calls):
            raise ValueError(
                f"AttentionSite.key_calls is a non-empty tuple of {KEY_CALLS}, got {self.key_calls!r}"
            )

    def context_keys(self, call: int) -> bool:
        """Whether the keys of the processor's attention call number ``call`` are context only (all
        text, or an image context), not the transformer's own tokens."""
        return self.key_calls[call] == "image" or self.key_text == "all"

    @property
    def attends_own_tokens(self) -> bool:
        """Whether some call's keys are the transformer's own tokens: what block-sparse attention can
        make sparse."""
        return not all(self.context_keys(i) for i in range(len(self.key_calls)))


GRID_LAYOUTS = ("ids", "latents")


@dataclass(frozen=True)
class TokenGrid:
    """Where each image (or video) token sits, as (frame, row, column), for block-sparse attention's
    tiling (``sdkiln.runtime.sparse``), read from the transformer's argument ``arg``:

    * ``"ids"``: position ids [S, 3] (or [B, S, 3]) whose axes 0, 1, 2 are frame, row and column, one
      row per image token in sequence order (FLUX's ``img_ids``);
    * ``"latents"``: the latents [B, C, F, H, W] (or [B, C, H, W]) that the transformer patchifies by
      ``patch`` (frames, rows, columns) into tokens in row-major order (Wan's ``hidden_states``).
    """

    arg: str
    layout: str
    patch: tuple[int, int, int] = (1, 1, 1)

    def __post_init__(self) -> None:
        if self.layout not in GRID_LAYOUTS:
            raise ValueError(f"TokenGrid.layout is one of {GRID_LAYOUTS}, got {self.layout!r}")


@dataclass(frozen=True)
class SequenceSplit:
    """Where the parallel runtime shards the sequence: the argument ``name`` of ``module`` (a module
    name in the transformer, "" for the transformer itself), or with ``output=True`` its output number
    ``name``, split along ``dim`` when it has ``ndim`` dimensions (diffusers' ``ContextParallelInput``:
    a tensor of another rank, e.g. Wan2.1's per-sample timestep, is left whole)."""

    module: str
    name: str | int
    dim: int
    ndim: int
    output: bool = False


@dataclass(frozen=True)
class SequenceGather:
    """Where the parallel runtime gathers the sequence again: ``module``'s output, along ``dim``, cut
    back to the length the split input ``length_of`` had (diffusers' ``ContextParallelOutput``)."""

    module: str
    dim: int
    ndim: int
    length_of: str = "hidden_states"


@dataclass(frozen=True)
class ParallelPlan:
    """How a family's transformer runs sequence-parallel with its text replicated on every rank:
    diffusers' ``_cp_plan`` as sdkiln data (``sdkiln.runtime.parallel.sharding``). ``image`` names the
    split input that is the image or video stream, ``text`` the transformer argument with the text."""

    splits: tuple[SequenceSplit, ...]
    gathers: tuple[SequenceGather, ...]
    image: str = "hidden_states"


def with_area(call: dict[str, Any]) -> dict[str, Any]:
    """``call`` with its ``max_area``, where it has one, following its height and width: FLUX.1-Kontext's
    pipeline scales its output to ``max_area`` pixels whatever size it is asked for."""
    if "max_area" in call and "height" in call and "width" in call:
        call["max_area"] = int(call["height"]) * int(call["width"])
    return call


def calibration_image(height: int, width: int):
    """A fixed RGB picture (PIL) of ``height`` x ``width``: smooth colour gradients with a few discs, the
    same bits on every machine, for calibrating and evaluating image-conditioned families offline."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / max(height - 1, 1), x / max(width - 1, 1)
    rgb = np.stack([x, y, 1 - (x + y) / 2], axis=-1)
    for cy, cx, r, colour in ((0.3, 0.3, 0.18, (0.9, 0.2, 0.1)), (0.65, 0.7, 0.22, (0.1, 0.5, 0.9))):
        inside = (y - cy) ** 2 + (x - cx) ** 2 < r**2
        rgb[inside] = colour
    return Image.fromarray((rgb * 255).round().astype(np.uint8), "RGB")


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back: a config saved with tuples compares equal to its config.json."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def no_guidance_arg(pipeline_class: str) -> str:
    """Raises: a guidance value given for a pipeline whose guidance is its guider component's."""
    raise ModelError(
        f"{pipeline_class.rpartition(':')[2]} takes no guidance argument: its guidance is the guidance_scale "
        "of its guider component (guider/guider_config.json in the model directory), which the package keeps"
    )


@dataclass(frozen=True)
class Variant:
    """One model of a family: a published one (FLUX.1-dev, Wan2.1-T2V-14B) or the zoo's own build.

    ``match`` maps transformer config keys to the values this variant has. It names width only --
    heads, head size, text and pooled widths, channels, the guidance embedding, QK norm -- never depth
    (``num_layers``), so that a real-width model cut to two blocks for a test is still recognised.
    ``call_defaults`` are the published defaults of a pipeline call (steps, guidance, resolution, text
    tokens), ``guidance_arg`` the call argument that sets its guidance (FLUX.1-dev's distilled
    ``guidance_scale``; the tiny FLUX build's ``true_cfg_scale``) and ``sparse_block_size`` the tokens
    per block of block-sparse attention at its usual resolution. Each is given whole rather than as a
    change to the family's, so that resolving an already resolved spec leaves nothing stale.
    """

    name: str
    description: str
    match: dict[str, Any]
    call_defaults: dict[str, Any]
    guidance_arg: str | None = "guidance_scale"
    """None: the pipeline takes no guidance argument (HunyuanVideo-1.5's guidance is its ``guider``
    component's ``guidance_scale``, saved with the package)."""
    sparse_block_size: int = 64
    size_multiple: int | None = None
    """Height and width multiple when not the family's (Wan2.2 TI2V-5B: its VAE's 16 times patch 2)."""

    def matches(self, config: Mapping[str, Any]) -> bool:
        return all(_plain(config.get(key)) == _plain(value) for key, value in self.match.items())


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """The zoo name of the family's test build (``flux-tiny``), whatever variant the spec is resolved to."""
    family: str
    """The family (``flux``, ``sd3``, ``wan``, ``fmnist-flux``): what a package's manifest records."""
    description: str
    pipeline_class: str
    """Import path ``module:Class`` of the pipeline; the runtime resolves it from an allow-list."""
    transformer_attr: str
    """Name of the denoiser component in the pipeline (``transformer`` or ``unet``)."""
    block_lists: tuple[BlockList, ...]
    float_layers: tuple[str, ...]
    """fnmatch patterns over module names (relative to the transformer) kept in float."""
    default_recipe: str
    """What the recipe name ``default`` stands for on this family."""
    build: Callable[[], Any]
    """Returns the family's default pipeline (tiny random weights, or the shipped embedded model)."""
    guidance_arg: str | None = "guidance_scale"
    """The pipeline call argument that sets guidance (the resolved variant's); None: the pipeline
    takes its guidance from its ``guider`` component, and ``guidance`` is refused (``call_kwargs``)."""
    weight_only_layers: tuple[str, ...] = ()
    """fnmatch patterns of in-block layers whose inputs must stay float (adaLN modulation linears,
    whose outputs scale every activation of a block): a step that quantizes activations keeps them
    in float; a weight-only step (W8A16, W4A16) takes them like any layer."""
    cfg_calls: tuple[str, ...] = ()
    """When the pipeline runs the unconditional branch as a second transformer call per step: the
    first argument above 1 and every other one set (FLUX: ``("true_cfg_scale", "negative_prompt")``,
    Wan: ``("guidance_scale",)``); empty: one call per step (SD3 batches both branches). Counts the
    forwards ``optimize`` plans."""
    call_defaults: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a pipeline call: steps, guidance, resolution, anything family-specific
    (the resolved variant's)."""
    size_multiple: int = 16
    """Height and width must be multiples of this (the VAE's downscale times the patch size), unless
    the variant says otherwise (``size_step``)."""
    variant_size_multiple: int | None = None
    """The resolved variant's ``Variant.size_multiple``."""
    frame_step: int | None = None
    """A video family's frame counts are ``frame_step * k + 1`` (the VAE's temporal downscale)."""
    max_text_tokens: int = 512
    """The most ``max_sequence_length`` the family's pipeline takes (T5's 512 in FLUX, SD3, Wan)."""
    text_encoder_floor_db: float = 30.0
    """The text-encoder quantization step's gate (``TextEncoderQuantConfig``): an encoder is
    quantized only if every output it returns keeps at least this SQNR on the calibration prompts
    (30 dB: a 3% RMS error; what the schemes cost on the embedded model is in docs/memory.md)."""
    eval_prompts: tuple[str, ...] = ("a photo of a cat",)
    """Held-out prompts for the quality report."""
    calibration_prompts: tuple[str, ...] = ("a photo of a dog",)
    metrics: Callable[[Any, list[str]], dict[str, float]] | None = None
    """Model-specific metrics from generated images [N,H,W,C] in [0,1] and their prompts."""
    smooth_folds: tuple[SmoothFold, ...] = ()
    """Where SmoothQuant folds its factor into the model; every other smoothed layer keeps an input multiplier."""
    attention: tuple[AttentionSite, ...] = ()
    """Where the transformer's attention runs, for the attention seam; empty: not routable."""
    text_arg: str = "encoder_hidden_states"
    """The transformer's forward argument that holds the text tokens (its length is the text count)."""
    parallel_plan: ParallelPlan | None = None
    """Where the sequence is split and gathered for Ulysses and ring attention with replicated text;
    None: the family runs CFG-parallel only. Split text uses the diffusers class's own ``_cp_plan``."""
    token_grid: TokenGrid | None = None
    """Where the image tokens sit, for block-sparse attention; None: the family has no sparse attention."""
    sparse_block_size: int = 64
    """Tokens per block of block-sparse attention at the variant's usual resolution (64 or 128 for
    thousands of tokens; fewer for a small test model, so that it has blocks to choose from)."""
    variants: tuple[Variant, ...] = ()
    """The models of the family sdkiln recognises, told apart by transformer width (``detect``)."""
    variant: str = ""
    """The variant this spec is resolved to: its call defaults, guidance argument and block size are the spec's."""
    image_arg: str | None = None
    """The pipeline argument that takes a conditioning image (image-to-video, image editing); None: the
    family conditions on text alone. Offline calibration and evaluation pass ``condition``'s image there;
    ``sdkiln run --image`` passes the user's."""
    condition_kwargs: dict[str, Any] = field(default_factory=dict)
    """Pipeline arguments that go with ``condition``'s image offline (FLUX.1-Kontext's
    ``_auto_resize=False``: calibrate at the call's size, not at the nearest trained resolution)."""
    image_required: bool = False
    """Whether the pipeline refuses to run without its conditioning image (Wan image-to-video), rather
    than generating from text alone (FLUX.1-Kontext)."""
    image_per_prompt: bool = False
    """Whether a call of several prompts takes one conditioning image per prompt, as a list
    (QwenImageEditPipeline's processor pairs each prompt with a picture): ``condition`` then gives the
    picture in a list, once per prompt."""
    refusals: dict[str, str] = field(default_factory=dict)
    """Capabilities (``CAPABILITIES``) this family refuses, each with its reason: asking for one is the
    one-line ``ModelError`` of ``refuse``, raised where the capability starts."""
    compile_regional: str = ""
    """Why the whole transformer does not compile as one graph, where it does not (HunyuanVideo-1.5's
    forward branches on its data before the blocks): ``sdkiln.load`` then compiles the blocks regionally
    (``CompileConfig.regional``), each block kind one graph, and logs that it did."""
    unsupported_layout: dict[str, str] = field(default_factory=dict)
    """model_index.json entries that, set, mean a layout sdkiln does not run yet, each with the reason."""
    experts: tuple[str, ...] = ()
    """The pipeline's other transformers besides ``transformer_attr`` (Wan2.2-A14B's low-noise
    ``transformer_2``), each its own model: calibrated on the steps it runs, quantized, cache-searched
    and packaged on its own (``transformer_attrs``)."""
    layout: tuple[str, ...] = ()
    """model_index.json entries every directory of this family sets (Wan2.2-A14B: ``transformer_2``
    and ``boundary_ratio``): a pipeline of the class that sets them all is this family's, ahead of a
    family of the same pipeline class that names fewer (``matches_layout``)."""

    def __post_init__(self) -> None:
        if not set(self.experts) <= set(self.layout):
            raise ValueError(
                f"{self.family}: every expert must be in layout (the entries its directories set)"
            )
        unknown = set(self.refusals) - set(CAPABILITIES)
        if unknown:
            raise ValueError(
                f"{self.family}: refusals name unknown capabilities {sorted(unknown)} ({CAPABILITIES})"
            )

    def refuse(self, capability: str) -> None:
        """The one-line ModelError for a capability this family refuses; nothing for one it has."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r} ({', '.join(CAPABILITIES)})")
        if capability in self.refusals:
            raise ModelError(f"{self.name} ({self.family}) cannot {capability}: {self.refusals[capability]}")

    def resolve(self, variant: str) -> ModelSpec:
        """This family's spec for its variant ``variant``."""
        for v in self.variants:
            if v.name == variant:
                return replace(
                    self,
                    variant=v.name,
                    call_defaults=dict(v.call_defaults),
                    guidance_arg=v.guidance_arg,
                    sparse_block_size=v.sparse_block_size,
                    variant_size_multiple=v.size_multiple,
                )
        raise ModelError(
            f"model family {self.family!r} has no variant {variant!r} ({', '.join(self.variant_names())})"
        )

    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    @property
    def transformer_attrs(self) -> tuple[str, ...]:
        """Every transformer the pipeline holds and ``optimize`` optimizes, the first one first."""
        return (self.transformer_attr, *self.experts)

    @property
    def several_transformers(self) -> bool:
        """Whether the pipeline holds transformers besides this spec's (which may be an expert's:
        ``TransformContext.for_transformer``)."""
        return bool(self.experts) or self.transformer_attr in self.layout

    def matches_layout(self, index: Mapping[str, Any]) -> bool:
        """Whether the pipeline config ``index`` (model_index.json) sets every ``layout`` entry."""
        return all(_plain(index.get(key)) not in (None, [None, None]) for key in self.layout)

    def refuse_layout(self, index: Mapping[str, Any], where: str) -> None:
        """ModelError when the pipeline config ``index`` (model_index.json) sets an ``unsupported_layout`` entry."""
        for key, reason in self.unsupported_layout.items():
            if _plain(index.get(key)) not in (None, [None, None]):
                raise ModelError(f"{where}: {reason}")

    def detect(self, config: Mapping[str, Any], where: str) -> ModelSpec:
        """This family's spec for the model whose transformer config is ``config`` (every key: the
        class's defaults for those its config.json leaves out): the one variant whose ``match`` holds.
        ModelError, naming the width found, when no variant has it."""
        found = [v.name for v in self.variants if v.matches(config)]
        if len(found) == 1:
            return self.resolve(found[0])
        keys = dict.fromkeys(key for v in self.variants for key in v.match)
        values = ", ".join(f"{key}={_plain(config.get(key))!r}" for key in keys)
        what = (
            f"matches several {self.family} variants ({', '.join(found)})"
            if found
            else f"is no known {self.family} variant ({', '.join(self.variant_names())})"
        )
        raise ModelError(
            f"{where}: {self.pipeline_class.split(':')[-1]} with transformer config {values} {what}"
        )

    @property
    def size_step(self) -> int:
        """The multiple the resolved variant's height and width must be."""
        return self.variant_size_multiple or self.size_multiple

    def condition(self, call: Mapping[str, Any], prompts: int = 1) -> dict[str, Any]:
        """The inputs besides the call's (never saved in a package) that offline calibration and
        evaluation give the pipeline for a call of ``prompts`` prompts: a fixed synthetic conditioning
        image at the call's size under ``image_arg`` (a list of it, one per prompt, where
        ``image_per_prompt``); nothing for a text-only family."""
        if self.image_arg is None:
            return {}
        image = calibration_image(int(call["height"]), int(call["width"]))
        return {
            self.image_arg: [image] * prompts if self.image_per_prompt else image,
            **self.condition_kwargs,
        }

    def attention_site(self, name: str) -> AttentionSite | None:
        """The first attention site whose pattern matches module ``name``; None: not an attention site."""
        return next((s for s in self.attention if fnmatch.fnmatchcase(name, s.modules)), None)

    def is_float_layer(self, name: str, weight_only: bool = False) -> bool:
        """Whether a step keeps layer ``name`` in float; ``weight_only``: the step quantizes weights only."""
        patterns = self.float_layers if weight_only else (*self.float_layers, *self.weight_only_layers)
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    def block_prefixes(self) -> tuple[str, ...]:
        return tuple(f"{bl.attr}." for bl in self.block_lists)

    def call_kwargs(
        self, num_inference_steps: int | None = None, guidance: float | None = None, **overrides: Any
    ) -> dict[str, Any]:
        """Pipeline call arguments with this family's defaults, the guidance under its own name;
        None leaves a default."""
        kwargs = dict(self.call_defaults)
        if num_inference_steps is not None:
            kwargs["num_inference_steps"] = num_inference_steps
        if guidance is not None:
            kwargs[self.guidance_arg or no_guidance_arg(self.pipeline_class)] = guidance
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return with_area(kwargs)
