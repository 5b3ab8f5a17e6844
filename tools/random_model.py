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

Variants (``VARIANTS``): flux-dev, flux-schnell, sd3.5-large, sd3.5-medium, wan2.1-t2v-14b,
wan2.1-t2v-1.3b.

``--depth N`` keeps the width and cuts the depth: N transformer blocks (FLUX: N double-stream and 2N
single-stream blocks; SD3.5: N joint blocks, dual-attention blocks among the first N only; Wan: N
blocks) and min(N, real) layers in every text encoder. The written configs are the cut ones, so
``DiffusionPipeline.from_pretrained`` loads the directory as it is. ``--dtype`` stores every component
in one dtype instead of the dtype its original ships in (``Weights.dtype`` in ``VARIANTS``).

Each component is built with its parameters on the meta device, given storage in its target dtype and
random values, saved in safetensors shards (about as many files as the original, so at least two for
every transformer and T5 encoder whatever the depth) and freed before the next one: peak memory is
about the largest component. The directory is written under a temporary
name beside ``--out`` and renamed when complete. The tokenizers are built in memory with the real
vocabulary sizes and special-token ids, in the spirit of ``sdkiln/model_zoo/tiny_text.py``.

Bench scripts can import it: ``sys.path.insert(0, "tools")``, then ``random_model.build(variant, out,
depth=2)``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import math
import shutil
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, T5Tokenizer

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


_BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
"""The 256 symbols of a byte-level BPE, in the order of CLIP's vocabulary ("!" = 0)."""


@dataclass(frozen=True)
class ClipBpe:
    """CLIP's byte-level BPE at its real size: the 256 byte symbols, the same with ``</w>``, byte-pair
    merges up to 49406 entries, then ``<|startoftext|>`` = 49406 and ``<|endoftext|>`` = 49407, the
    ids of the real vocabulary (CLIP pools at the largest id when its config's ``eos_token_id`` is 2)."""

    pad_token: str = "<|endoftext|>"
    vocab_size: int = 49408
    model_max_length: int = 77

    def merges(self) -> list[tuple[str, str]]:
        symbols = [*_BYTES, *(c + "</w>" for c in _BYTES)]
        pairs = ((a, b) for a in _BYTES for b in symbols)
        return list(itertools.islice(pairs, self.vocab_size - 2 - len(symbols)))

    def build(self) -> CLIPTokenizer:
        merges = self.merges()
        vocab = [*_BYTES, *(c + "</w>" for c in _BYTES), *(a + b for a, b in merges)]
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        return CLIPTokenizer(
            vocab={token: i for i, token in enumerate(vocab)},
            merges=merges,
            pad_token=self.pad_token,
            model_max_length=self.model_max_length,
        )

    def save(self, tokenizer: CLIPTokenizer, path: Path) -> None:
        """``save_pretrained`` writes tokenizer.json; vocab.json and merges.txt are the real repos' files."""
        tokenizer.save_pretrained(path)
        vocab = dict(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
        (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        merges = "".join(f"{a} {b}\n" for a, b in self.merges())
        (path / "merges.txt").write_text("#version: 0.2\n" + merges)


def _words():
    for n in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            word = "".join(letters)
            yield ("\u2581" + word, -1.0 - n)
            yield (word, -2.0 - n)


@dataclass(frozen=True)
class T5Unigram:
    """A Unigram in T5's SentencePiece layout: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, printable
    characters and lowercase words up to ``pieces``, then the sentinels with ``<extra_id_0>`` last: the
    real tokenizer's length, below the encoder's padded vocabulary."""

    pieces: int
    extra_ids: int
    model_max_length: int = 512

    def build(self) -> T5Tokenizer:
        chars = [c for c in string.printable if not c.isspace()]
        head = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
        head += [(c, -5.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
        vocab = list(itertools.islice(itertools.chain(head, _words()), self.pieces))
        vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(self.extra_ids))]
        return T5Tokenizer(vocab=vocab, extra_ids=self.extra_ids, model_max_length=self.model_max_length)

    def save(self, tokenizer: T5Tokenizer, path: Path) -> None:
        tokenizer.save_pretrained(path)


@dataclass(frozen=True)
class Variant:
    repo: str
    """the Hugging Face repository whose configs ``tools/model_configs/<variant>/`` holds"""
    weights: dict[str, Weights]
    """per model component (the folders with a config.json)"""
    tokenizers: dict[str, ClipBpe | T5Unigram]


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
_WAN_TEXT = {"text_encoder": Weights(_FP32, 5), "vae": Weights(_FP32)}
_WAN_TOKENIZERS = {"tokenizer": T5Unigram(256000, 300)}

VARIANTS: dict[str, Variant] = {
    "flux-dev": Variant(
        "black-forest-labs/FLUX.1-dev", {"transformer": Weights(_BF16, 3), **_FLUX_TEXT}, _FLUX_TOKENIZERS
    ),
    "flux-schnell": Variant(
        "black-forest-labs/FLUX.1-schnell", {"transformer": Weights(_BF16, 3), **_FLUX_TEXT}, _FLUX_TOKENIZERS
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
        "Wan-AI/Wan2.1-T2V-14B-Diffusers", {"transformer": Weights(_FP32, 12), **_WAN_TEXT}, _WAN_TOKENIZERS
    ),
    "wan2.1-t2v-1.3b": Variant(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", {"transformer": Weights(_FP32, 2), **_WAN_TEXT}, _WAN_TOKENIZERS
    ),
}


def _cut_flux(config: dict, depth: int) -> dict:
    return {"num_layers": depth, "num_single_layers": min(2 * depth, config["num_single_layers"])}


def _cut_sd3(config: dict, depth: int) -> dict:
    cut = {"num_layers": depth}
    if "dual_attention_layers" in config:
        cut["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < depth]
    return cut


def _cut_key(key: str):
    return lambda config, depth: {key: min(depth, config[key])}


DEPTH_CUTS = {
    "FluxTransformer2DModel": _cut_flux,
    "SD3Transformer2DModel": _cut_sd3,
    "WanTransformer3DModel": _cut_key("num_layers"),
    "CLIPTextModel": _cut_key("num_hidden_layers"),
    "CLIPTextModelWithProjection": _cut_key("num_hidden_layers"),
    "T5EncoderModel": _cut_key("num_layers"),
    "UMT5EncoderModel": _cut_key("num_layers"),
}
"""What ``--depth N`` changes in a config, by model class; a class not listed (the VAEs) is not cut."""


def variant_spec(variant: str) -> Variant:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def model_index(variant: str) -> dict:
    """The published model_index.json: component name -> [library, class name]."""
    variant_spec(variant)
    return json.loads((CONFIGS / variant / "model_index.json").read_text())


def max_depth(variant: str) -> int:
    """The transformer's block count, the largest ``--depth`` (FLUX: its double-stream blocks)."""
    return json.loads((CONFIGS / variant / "transformer" / "config.json").read_text())["num_layers"]


def component_configs(variant: str, depth: int | None = None) -> dict[str, tuple[str, str, dict]]:
    """``{name: (library, class name, config)}`` for the model components and the scheduler, cut to
    ``depth``; tokenizers are not listed (they have no published config here)."""
    spec = variant_spec(variant)
    if depth is not None and not 1 <= depth <= max_depth(variant):
        raise ValueError(f"--depth must be between 1 and {max_depth(variant)} for {variant}, got {depth}")
    out = {}
    for name, entry in model_index(variant).items():
        if name.startswith("_") or name in spec.tokenizers:
            continue
        library, class_name = entry
        file = "config.json" if name in spec.weights else "scheduler_config.json"
        config = json.loads((CONFIGS / variant / name / file).read_text())
        if depth is not None and class_name in DEPTH_CUTS:
            config |= DEPTH_CUTS[class_name](config, depth)
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
        f"{name:<15} {what:<28} {amount:>18} {nbytes / 2**30:9.3f} GiB {time.perf_counter() - start:7.1f} s",
        flush=True,
    )
    return nbytes


def _write(
    variant: str, spec: Variant, root: Path, depth: int | None, dtype: torch.dtype | None, seed: int
) -> dict:
    """Each component under ``root``, one line printed per component; what ``MARKER`` records of them.
    Every model draws from its own generator, so its values do not depend on the other components."""
    components = {}
    for index, (name, (library, class_name, config)) in enumerate(component_configs(variant, depth).items()):
        start = time.perf_counter()
        path = root / name
        if name not in spec.weights:  # the scheduler
            getattr(importlib.import_module(library), class_name).from_config(config).save_pretrained(path)
            components[name] = {"class": class_name, "bytes": _report(name, class_name, "-", path, start)}
            continue
        weights = spec.weights[name]
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
        components[name] = {
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
        components[name] = {
            "class": cls,
            "tokens": len(tokenizer),
            "bytes": _report(name, cls, f"{len(tokenizer):,} tokens", root / name, start),
        }
    return components


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
        components = _write(variant, spec, tmp, depth, dtype, seed)
        record = {
            "tool": "tools/random_model.py",
            "tool_version": TOOL_VERSION,
            "weights": f"random: normal(0, {INIT_STD}), norm scales 1, biases 0; not the published model",
            "variant": variant,
            "source": spec.repo,
            "depth": depth,
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "seed": seed,
            "components": components,
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
    parser.add_argument("--depth", type=int, help="transformer blocks to keep (FLUX: N double + 2N single)")
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
