"""Write a diffusers model directory with a real model's published configs and random weights.

    python tools/random_model.py flux-dev --out build/flux-dev-d2 --depth 2
    python tools/random_model.py wan2.1-t2v-14b --out /data/wan14b --dtype bf16 --seed 1 --force

Nothing is downloaded. The configs are copies of the published ones, kept in
``tools/model_configs/<variant>/`` (one JSON per component, laid out as in the Hugging Face repository,
with a SOURCE.md naming where each came from and what could not be verified). The weights are random
(normal with std 0.02, norms 1, biases 0), so the directory has the real shapes, dtypes, shard layout and
loading path of the original but generates noise: it is for measuring speed and memory and for testing
loaders, never for judging quality. A ``sdkiln_random_model.json`` at its root says so and records how it
was made.

Variants (``VARIANTS``): flux-dev, flux-schnell, flux.1-kontext-dev, flux2-dev, qwen-image,
qwen-image-edit, hunyuan-video, hunyuan-video-1.5-480p, hunyuan-video-1.5-720p, sd3.5-large, sd3.5-medium,
wan2.1-t2v-14b, wan2.1-t2v-1.3b, wan2.1-i2v-14b-480p, wan2.2-ti2v-5b, wan2.2-t2v-a14b and
wan2.2-i2v-a14b (two experts each). ``sdkiln.model_zoo.detect`` resolves each directory to its family
and variant.

``--depth N`` keeps the width and cuts the depth: N transformer blocks (two-stream models -- FLUX.1,
FLUX.2, HunyuanVideo -- N double-stream blocks and as many single-stream blocks per double one as the
original: 2N, 6N, 2N; SD3.5: N joint blocks, dual-attention blocks among the first N only; Qwen-Image,
HunyuanVideo-1.5 (its 2 token-refiner blocks kept), Wan: N blocks), min(N, real) layers in every text
encoder and vision tower, and never fewer than a pipeline reads an inner hidden state of
(``Variant.min_layers``: FLUX.2's Mistral keeps 30 of its 40 layers, HunyuanVideo's LLaMA and
HunyuanVideo-1.5's Qwen 3, Wan I2V's CLIP vision tower 2, whatever N). The written configs are the
cut ones, so ``DiffusionPipeline.from_pretrained`` loads the directory as it is. ``--dtype`` stores
every component in one dtype instead of the dtype its original ships in (``Weights.dtype`` in
``VARIANTS``).

Each component is built with its parameters on the meta device, given storage in its target dtype and
random values, saved in safetensors shards (about as many files as the original, so at least two for
every transformer and T5 encoder whatever the depth) and freed before the next one: peak memory is
about the largest component (FLUX.2-dev's text encoder, 30 Mistral layers at any depth, is 35 GB in
bf16). The directory is written under a temporary name beside ``--out`` and renamed when complete. The
tokenizers (``random_tokenizers.py``) are built in memory with the real vocabulary sizes and
special-token ids, in the spirit of ``sdkiln/model_zoo/tiny_text.py``; FLUX.2's is written as the
``PixtralProcessor`` folder its model_index.json names and Qwen-Image-Edit's as its ``Qwen2VLProcessor``
folder, which load where torchvision is installed.
Components stored as plain published files (Wan I2V's ``image_processor``, HunyuanVideo-1.5's
``guider``) are copied as they are.

Bench scripts can import it: ``sys.path.insert(0, "tools")``, then ``random_model.build(variant, out,
depth=2)``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import init_empty_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's sdkiln, for the tokenizers
from random_tokenizers import (  # noqa: E402
    ByT5Glyph,
    ClipBpe,
    Llama3Bpe,
    Qwen2Bpe,
    Qwen2ChatBpe,
    Qwen2EditBpe,
    Qwen2VLProcessorFiles,
    T5Unigram,
    TekkenBpe,
)

TOOL_VERSION = 1
CONFIGS = Path(__file__).resolve().parent / "model_configs"
MARKER = "sdkiln_random_model.json"
"""Written at the root of every directory this tool makes; --force replaces only such a directory."""
INIT_STD = 0.02
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Weights:
    """How a model component's weights are stored in the original repository."""

    dtype: torch.dtype
    shards: int = 1
    """safetensors files; the shard size is the component's size over this, so a cut model is split
    about as finely (diffusers and transformers shard greedily, tensor by tensor)"""


@dataclass(frozen=True)
class Variant:
    repo: str
    """the Hugging Face repository whose configs ``tools/model_configs/<variant>/`` holds"""
    weights: dict[str, Weights]
    """per model component (the folders with a config.json)"""
    tokenizers: dict[str, ClipBpe | T5Unigram | Qwen2Bpe | Llama3Bpe | TekkenBpe | ByT5Glyph]
    """per tokenizer or processor component (a processor's folder: its tokenizer and configs)"""
    min_layers: dict[str, int] = field(default_factory=dict)
    """per text or image encoder that the pipeline reads an inner hidden state of: the fewest layers
    ``--depth`` leaves it, so that the state the pipeline reads is still a layer's output"""


_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
_FLUX_TEXT = {"text_encoder": Weights(_BF16), "text_encoder_2": Weights(_BF16, 2), "vae": Weights(_BF16)}
_FLUX_TOKENIZERS = {"tokenizer": ClipBpe(), "tokenizer_2": T5Unigram(32000, 100)}
_SD3_TEXT = {
    "text_encoder": Weights(_FP16),
    "text_encoder_2": Weights(_FP16),
    "text_encoder_3": Weights(_FP16, 2),
    "vae": Weights(_BF16),
}
_SD3_TOKENIZERS = {
    "tokenizer": ClipBpe(),
    "tokenizer_2": ClipBpe(pad_token="!"),
    "tokenizer_3": T5Unigram(32000, 100),
}
_WAN_TEXT = {"text_encoder": Weights(_FP32, 5)}
# The converter saves the pipeline with each library's default shard size (diffusers 10 GB: the 16.7 GB
# transformer in 2 files; transformers 4.x 5 GB: Qwen2.5-7B's 14.1 GB language model in 3), the ByT5
# encoder as google/byt5-small loads (fp32) and the VAE in the dtype of the original checkpoint, assumed
# fp32 as HunyuanVideo's; none of it checked against the repositories (SOURCE.md).
_HV15_WEIGHTS = {
    "transformer": Weights(_BF16, 2),
    "text_encoder": Weights(_BF16, 3),
    "text_encoder_2": Weights(_FP32),
    "vae": Weights(_FP32),
}
_HV15_TOKENIZERS = {"tokenizer": Qwen2ChatBpe(), "tokenizer_2": ByT5Glyph()}
_WAN_TOKENIZERS = {"tokenizer": T5Unigram(256000, 300)}

VARIANTS: dict[str, Variant] = {
    "flux-dev": Variant(
        "black-forest-labs/FLUX.1-dev", {"transformer": Weights(_BF16, 3), **_FLUX_TEXT}, _FLUX_TOKENIZERS
    ),
    "flux-schnell": Variant(
        "black-forest-labs/FLUX.1-schnell", {"transformer": Weights(_BF16, 3), **_FLUX_TEXT}, _FLUX_TOKENIZERS
    ),
    "flux.1-kontext-dev": Variant(
        "black-forest-labs/FLUX.1-Kontext-dev",
        {"transformer": Weights(_BF16, 3), **_FLUX_TEXT},
        _FLUX_TOKENIZERS,
    ),
    # Flux2Pipeline stacks hidden states 10, 20 and 30 of Mistral-Small (text_encoder_out_layers).
    "flux2-dev": Variant(
        "black-forest-labs/FLUX.2-dev",
        {"transformer": Weights(_BF16, 7), "text_encoder": Weights(_BF16, 10), "vae": Weights(_BF16)},
        {"tokenizer": TekkenBpe()},
        min_layers={"text_encoder": 30},
    ),
    "qwen-image": Variant(
        "Qwen/Qwen-Image",
        {"transformer": Weights(_BF16, 9), "text_encoder": Weights(_BF16, 4), "vae": Weights(_BF16)},
        {"tokenizer": Qwen2Bpe()},
    ),
    "qwen-image-edit": Variant(
        "Qwen/Qwen-Image-Edit",
        {"transformer": Weights(_BF16, 9), "text_encoder": Weights(_BF16, 4), "vae": Weights(_BF16)},
        {"tokenizer": Qwen2EditBpe(), "processor": Qwen2VLProcessorFiles()},
    ),
    # HunyuanVideoPipeline reads LLaMA's hidden_states[-3] (num_hidden_layers_to_skip 2).
    "hunyuan-video": Variant(
        "hunyuanvideo-community/HunyuanVideo",
        {
            "transformer": Weights(_BF16, 6),
            "text_encoder": Weights(_FP16, 4),
            "text_encoder_2": Weights(_FP16),
            "vae": Weights(_FP32),
        },
        {"tokenizer": Llama3Bpe(), "tokenizer_2": ClipBpe()},
        min_layers={"text_encoder": 3},
    ),
    # HunyuanVideo15Pipeline reads Qwen's hidden_states[-3] (num_hidden_layers_to_skip 2); the guider
    # (guider_config.json alone) is copied.
    "hunyuan-video-1.5-480p": Variant(
        "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
        _HV15_WEIGHTS,
        _HV15_TOKENIZERS,
        min_layers={"text_encoder": 3},
    ),
    "hunyuan-video-1.5-720p": Variant(
        "hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v",
        _HV15_WEIGHTS,
        _HV15_TOKENIZERS,
        min_layers={"text_encoder": 3},
    ),
    "sd3.5-large": Variant(
        "stabilityai/stable-diffusion-3.5-large",
        {"transformer": Weights(_BF16, 2), **_SD3_TEXT},
        _SD3_TOKENIZERS,
    ),
    # Published as one transformer file; two here so that every variant's transformer loads from shards.
    "sd3.5-medium": Variant(
        "stabilityai/stable-diffusion-3.5-medium",
        {"transformer": Weights(_BF16, 2), **_SD3_TEXT},
        _SD3_TOKENIZERS,
    ),
    "wan2.1-t2v-14b": Variant(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        {"transformer": Weights(_FP32, 12), **_WAN_TEXT, "vae": Weights(_FP32)},
        _WAN_TOKENIZERS,
    ),
    "wan2.1-t2v-1.3b": Variant(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        {"transformer": Weights(_FP32, 2), **_WAN_TEXT, "vae": Weights(_FP32)},
        _WAN_TOKENIZERS,
    ),
    # WanImageToVideoPipeline reads the CLIP vision tower's hidden_states[-2]; the conversion script
    # loads that tower in bf16 (its config's torch_dtype says float32: SOURCE.md).
    "wan2.1-i2v-14b-480p": Variant(
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        {
            "transformer": Weights(_FP32, 14),
            **_WAN_TEXT,
            "vae": Weights(_FP32),
            "image_encoder": Weights(_BF16),
        },
        _WAN_TOKENIZERS,
        min_layers={"image_encoder": 2},
    ),
    "wan2.2-t2v-a14b": Variant(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        {
            "transformer": Weights(_FP32, 12),
            "transformer_2": Weights(_FP32, 12),
            **_WAN_TEXT,
            "vae": Weights(_FP32),
        },
        _WAN_TOKENIZERS,
    ),
    # No image encoder: the picture enters only through the experts' 36 latent channels.
    "wan2.2-i2v-a14b": Variant(
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        {
            "transformer": Weights(_FP32, 12),
            "transformer_2": Weights(_FP32, 12),
            **_WAN_TEXT,
            "vae": Weights(_FP32),
        },
        _WAN_TOKENIZERS,
    ),
    "wan2.2-ti2v-5b": Variant(
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        {"transformer": Weights(_FP32, 4), **_WAN_TEXT, "vae": Weights(_FP32)},
        _WAN_TOKENIZERS,
    ),
}


def _cut_two_streams(config: dict, depth: int, floor: int) -> dict:
    """N double-stream blocks and as many single-stream blocks per double one as the real model has
    (FLUX.1 and HunyuanVideo 2N, FLUX.2 6N)."""
    per_double = config["num_single_layers"] // config["num_layers"]
    return {"num_layers": depth, "num_single_layers": min(per_double * depth, config["num_single_layers"])}


def _cut_sd3(config: dict, depth: int, floor: int) -> dict:
    cut = {"num_layers": depth}
    if "dual_attention_layers" in config:
        cut["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < depth]
    return cut


def _cut_key(key: str):
    return lambda config, depth, floor: {key: min(max(depth, floor), config[key])}


def _cut_qwen2_5_vl(config: dict, depth: int, floor: int) -> dict:
    """Text layers (the top-level copy of the text fields too, as transformers 4.53 wrote them) and
    vision blocks, keeping the full-attention ones among those left."""
    text, vision = config["text_config"], config["vision_config"]
    layers = min(max(depth, floor), text["num_hidden_layers"])
    blocks = min(depth, vision["depth"])
    return {
        "num_hidden_layers": layers,
        "text_config": text | {"num_hidden_layers": layers, "layer_types": text["layer_types"][:layers]},
        "vision_config": vision
        | {
            "depth": blocks,
            "fullatt_block_indexes": [i for i in vision["fullatt_block_indexes"] if i < blocks],
        },
    }


def _cut_mistral3(config: dict, depth: int, floor: int) -> dict:
    text, vision = config["text_config"], config["vision_config"]
    return {
        "text_config": text | {"num_hidden_layers": min(max(depth, floor), text["num_hidden_layers"])},
        "vision_config": vision | {"num_hidden_layers": min(depth, vision["num_hidden_layers"])},
    }


DEPTH_CUTS = {
    "FluxTransformer2DModel": _cut_two_streams,
    "Flux2Transformer2DModel": _cut_two_streams,
    "HunyuanVideoTransformer3DModel": _cut_two_streams,
    "HunyuanVideo15Transformer3DModel": _cut_key("num_layers"),
    "SD3Transformer2DModel": _cut_sd3,
    "QwenImageTransformer2DModel": _cut_key("num_layers"),
    "WanTransformer3DModel": _cut_key("num_layers"),
    "CLIPTextModel": _cut_key("num_hidden_layers"),
    "CLIPTextModelWithProjection": _cut_key("num_hidden_layers"),
    "CLIPVisionModelWithProjection": _cut_key("num_hidden_layers"),
    "LlamaModel": _cut_key("num_hidden_layers"),
    "Qwen2_5_VLTextModel": _cut_key("num_hidden_layers"),
    "T5EncoderModel": _cut_key("num_layers"),
    "UMT5EncoderModel": _cut_key("num_layers"),
    "Qwen2_5_VLForConditionalGeneration": _cut_qwen2_5_vl,
    "Mistral3ForConditionalGeneration": _cut_mistral3,
}
"""What ``--depth N`` changes in a config, by model class, given the component's ``min_layers`` (1
when it has none); a class not listed (the VAEs) is not cut."""


def variant_spec(variant: str) -> Variant:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def model_index(variant: str) -> dict:
    """The published model_index.json: component name -> [library, class name], and the pipeline's
    registered settings (Wan2.2's ``expand_timesteps``)."""
    variant_spec(variant)
    return json.loads((CONFIGS / variant / "model_index.json").read_text())


def components(variant: str) -> dict[str, tuple[str, str]]:
    """The components model_index.json names with a class: not the settings, not the optional
    components saved empty (Wan2.2-TI2V's ``transformer_2`` is [null, null])."""
    return {
        name: tuple(entry)
        for name, entry in model_index(variant).items()
        if not name.startswith("_") and isinstance(entry, list) and None not in entry
    }


def copied(variant: str) -> list[str]:
    """Components stored as their published files and copied as they are (Wan I2V's image processor,
    HunyuanVideo-1.5's guider): neither weights, tokenizers nor the scheduler."""
    spec = variant_spec(variant)
    return [
        name
        for name in components(variant)
        if name not in spec.weights and name not in spec.tokenizers and name != "scheduler"
    ]


def max_depth(variant: str) -> int:
    """The transformer's block count, the largest ``--depth`` (two-stream models: their double-stream
    blocks)."""
    return json.loads((CONFIGS / variant / "transformer" / "config.json").read_text())["num_layers"]


def component_configs(variant: str, depth: int | None = None) -> dict[str, tuple[str, str, dict]]:
    """``{name: (library, class name, config)}`` for the model components and the scheduler, cut to
    ``depth``; tokenizers and copied components are not listed."""
    spec = variant_spec(variant)
    if depth is not None and not 1 <= depth <= max_depth(variant):
        raise ValueError(f"--depth must be between 1 and {max_depth(variant)} for {variant}, got {depth}")
    out = {}
    for name, (library, class_name) in components(variant).items():
        if name in spec.tokenizers or name in copied(variant):
            continue
        file = "config.json" if name in spec.weights else "scheduler_config.json"
        config = json.loads((CONFIGS / variant / name / file).read_text())
        if depth is not None and class_name in DEPTH_CUTS:
            config |= DEPTH_CUTS[class_name](config, depth, spec.min_layers.get(name, 1))
        out[name] = (library, class_name, config)
    return out


def empty_model(library: str, class_name: str, config: dict, buffers: bool = True) -> torch.nn.Module:
    """The model with its parameters on the meta device. Buffers are computed on the CPU (SD3's
    positional table is saved with the weights) unless ``buffers=False``, which puts them on meta too:
    enough to count and check shapes, and much faster."""
    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights() if buffers else torch.device("meta"):
        model = cls.from_config(config) if library == "diffusers" else cls(cls.config_class.from_dict(config))
    if library == "transformers":
        model.tie_weights()  # init_empty_weights registers every parameter anew, which unties them
    return model


def randomize(model: torch.nn.Module, dtype: torch.dtype, generator: torch.Generator) -> None:
    """Give each meta parameter storage in ``dtype``: normal(0, INIT_STD), norm scales 1, biases 0.
    Tied parameters stay tied; floating buffers are cast to ``dtype``."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                data = torch.empty(param.shape, dtype=dtype)
                if "bias" in name:
                    data.zero_()
                elif is_norm:
                    data.fill_(1.0)
                else:
                    data.normal_(0.0, INIT_STD, generator=generator)
                done[id(param)] = torch.nn.Parameter(data, requires_grad=False)
            module._parameters[name] = done[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


def parameter_counts(variant: str, depth: int | None = None) -> dict[str, int]:
    """Parameters of each model component (tied ones once), counted on the meta device."""
    spec = variant_spec(variant)
    counts = {}
    for name, (library, class_name, config) in component_configs(variant, depth).items():
        if name in spec.weights:
            model = empty_model(library, class_name, config, buffers=False)
            counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def check_out(out: Path, force: bool) -> None:
    """Refuse to replace anything but a directory this tool wrote, and that only with ``force``."""
    if not out.exists():
        return
    if not (out / MARKER).is_file():
        raise FileExistsError(
            f"{out} exists and was not written by random_model.py (no {MARKER}); not replacing it"
        )
    if not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _report(name: str, what: str, amount: str, path: Path, start: float) -> int:
    nbytes = _size(path)
    print(
        f"{name:<15} {what:<32} {amount:>18} {nbytes / 2**30:9.3f} GiB {time.perf_counter() - start:7.1f} s",
        flush=True,
    )
    return nbytes


def _write(
    variant: str, spec: Variant, root: Path, depth: int | None, dtype: torch.dtype | None, seed: int
) -> dict:
    """Each component under ``root``, one line printed per component; what ``MARKER`` records of them.
    Every model draws from its own generator, so its values do not depend on the other components."""
    record = {}
    for index, (name, (library, class_name, config)) in enumerate(component_configs(variant, depth).items()):
        start = time.perf_counter()
        path = root / name
        if name not in spec.weights:  # the scheduler
            getattr(importlib.import_module(library), class_name).from_config(config).save_pretrained(path)
            record[name] = {"class": class_name, "bytes": _report(name, class_name, "-", path, start)}
            continue
        weights = spec.weights[name]
        if depth is not None and spec.min_layers.get(name, 1) > depth:
            print(
                f"{name}: {spec.min_layers[name]} layers at least, the pipeline reads a hidden state that deep"
            )
        model = empty_model(library, class_name, config)
        target = dtype or weights.dtype
        randomize(model, target, torch.Generator().manual_seed(seed * 1000 + index))
        params = sum(p.numel() for p in model.parameters())
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(
            path, max_shard_size=math.ceil(total / weights.shards) if weights.shards > 1 else total + 1
        )
        del model
        gc.collect()
        nbytes = _report(name, class_name, f"{params / 1e6:,.1f}M params", path, start)
        record[name] = {
            "class": class_name,
            "dtype": str(target).removeprefix("torch."),
            "params": params,
            "bytes": nbytes,
        }
    for name, tokenizer_spec in spec.tokenizers.items():
        start = time.perf_counter()
        tokenizer = tokenizer_spec.build()
        tokenizer_spec.save(tokenizer, root / name)
        cls = type(tokenizer).__name__
        record[name] = {
            "class": cls,
            "tokens": len(tokenizer),
            "bytes": _report(name, cls, f"{len(tokenizer):,} tokens", root / name, start),
        }
    for name in copied(variant):
        start = time.perf_counter()
        shutil.copytree(CONFIGS / variant / name, root / name)
        cls = components(variant)[name][1]
        record[name] = {"class": cls, "bytes": _report(name, cls, "published files", root / name, start)}
    return record


def build(
    variant: str,
    out: str | Path,
    depth: int | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write ``variant`` with random weights to ``out`` (see the module docstring) and return its path."""
    spec = variant_spec(variant)
    component_configs(variant, depth)
    if dtype is not None and dtype not in DTYPES.values():
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    out = Path(out)
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "model_index.json").write_text((CONFIGS / variant / "model_index.json").read_text())
        written = _write(variant, spec, tmp, depth, dtype, seed)
        record = {
            "tool": "tools/random_model.py",
            "tool_version": TOOL_VERSION,
            "weights": f"random: normal(0, {INIT_STD}), norm scales 1, biases 0; not the published model",
            "variant": variant,
            "source": spec.repo,
            "depth": depth,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "seed": seed,
            "components": written,
        }
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        check_out(out, force)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="random_model.py",
        description="Write a diffusers model directory with a real model's configs and random weights.",
    )
    parser.add_argument("variant", help=f"one of: {', '.join(VARIANTS)}")
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument(
        "--depth", type=int, help="transformer blocks to keep (two-stream models: N double-stream blocks)"
    )
    parser.add_argument("--dtype", choices=DTYPES, help="store every component in this dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace --out if this tool wrote it")
    args = parser.parse_args(argv)
    try:
        out = build(
            args.variant, args.out, depth=args.depth, dtype=args.dtype, seed=args.seed, force=args.force
        )
    except (ValueError, FileExistsError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"wrote {out} ({_size(out) / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
