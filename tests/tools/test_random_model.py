"""tools/random_model.py: every variant's stored configs build their diffusers and transformers classes
on the meta device, at full size (the published parameter counts) and cut by --depth (text and image
encoders never below the layer their pipeline reads); a directory of the cut configs is detected as
its family and variant; the tokenizers have the real lengths and special ids and split the pipelines'
prompt templates where the pipelines cut them; bad arguments and existing directories are refused, and
a failed or repeated write leaves no debris. Slow tests write flux-dev and each variant added after the
first six at depth 1 for real, load them with their diffusers pipelines and generate."""

import importlib
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import random_model as rm  # noqa: E402

from sdkiln.model_zoo import detect, stored_dtype  # noqa: E402

PUBLISHED_PARAMS = {
    "flux-dev": {"transformer": 11_901.4, "text_encoder": 123.1, "text_encoder_2": 4_762.3, "vae": 83.8},
    "flux-schnell": {"transformer": 11_891.2, "text_encoder": 123.1, "text_encoder_2": 4_762.3, "vae": 83.8},
    "sd3.5-large": {
        "transformer": 8_056.6,
        "text_encoder": 123.7,
        "text_encoder_2": 694.7,
        "text_encoder_3": 4_762.3,
        "vae": 83.8,
    },
    "sd3.5-medium": {
        "transformer": 2_243.2,
        "text_encoder": 123.7,
        "text_encoder_2": 694.7,
        "text_encoder_3": 4_762.3,
        "vae": 83.8,
    },
    "wan2.1-t2v-14b": {"transformer": 14_288.5, "text_encoder": 5_680.9, "vae": 126.9},
    "wan2.1-t2v-1.3b": {"transformer": 1_419.0, "text_encoder": 5_680.9, "vae": 126.9},
    "flux.1-kontext-dev": {
        "transformer": 11_901.4,
        "text_encoder": 123.1,
        "text_encoder_2": 4_762.3,
        "vae": 83.8,
    },
    "flux2-dev": {"transformer": 32_223.3, "text_encoder": 23_340.3, "vae": 84.0},
    "qwen-image": {"transformer": 20_430.4, "text_encoder": 8_292.2, "vae": 126.9},
    "qwen-image-edit": {"transformer": 20_430.4, "text_encoder": 8_292.2, "vae": 126.9},
    "hunyuan-video": {
        "transformer": 12_821.0,
        "text_encoder": 7_505.2,
        "text_encoder_2": 123.1,
        "vae": 246.5,
    },
    "hunyuan-video-1.5-480p": {
        "transformer": 8_326.6,
        "text_encoder": 7_070.6,
        "text_encoder_2": 219.3,
        "vae": 1_260.6,
    },
    "hunyuan-video-1.5-720p": {
        "transformer": 8_326.6,
        "text_encoder": 7_070.6,
        "text_encoder_2": 219.3,
        "vae": 1_260.6,
    },
    "wan2.1-i2v-14b-480p": {
        "transformer": 16_394.9,
        "text_encoder": 5_680.9,
        "vae": 126.9,
        "image_encoder": 632.1,
    },
    "wan2.2-ti2v-5b": {"transformer": 4_999.8, "text_encoder": 5_680.9, "vae": 704.7},
    "wan2.2-t2v-a14b": {
        "transformer": 14_288.5,
        "transformer_2": 14_288.5,
        "text_encoder": 5_680.9,
        "vae": 126.9,
    },
    "wan2.2-i2v-a14b": {
        "transformer": 14_288.9,
        "transformer_2": 14_288.9,
        "text_encoder": 5_680.9,
        "vae": 126.9,
    },
}
"""Millions of parameters of the full-size components: FLUX.1's 11.9B transformer (guidance embedder on
dev only), T5 v1.1 XXL's 4.76B encoder (9.5 GB in bf16), SD3.5 Large's 8.1B and Medium's 2.2B (2.5B with
its saved 384^2 positional table), Wan2.1's 14.3B and 1.42B (5.7 GB in fp32) and UMT5-XXL's 5.68B
encoder (21 GB in fp32); FLUX.2-dev's 32.2B transformer and Mistral-Small's 24.0B, here 23.3B:
transformers 5's Mistral3Config ties the 671M-parameter output head to the embedding (its
``tie_word_embeddings`` defaults to true and the stored config sets none); Qwen-Image's 20.4B and
Qwen2.5-VL-7B's 8.29B (Qwen-Image-Edit's the same);
HunyuanVideo's 12.8B and LLaMA-3-8B's 7.5B without its head; HunyuanVideo-1.5's 8.3B (both
resolutions), Qwen2.5-VL-7B's language model alone (7.07B, no vision tower, no head), ByT5-small's
encoder with its embedding resized to the 1510 glyph-extended ids (219M) and a 1.26B VAE (counted from
the configs: no published count); Wan2.1-I2V's 16.4B and CLIP ViT-H/14's 632M
vision tower; Wan2.2-TI2V's 5.0B and its 705M VAE; Wan2.2-T2V-A14B's two experts of Wan2.1-14B's 14.3B,
and Wan2.2-I2V-A14B's, 0.4M more each for the patch embedding of 36 channels (counted from the configs:
no published per-expert count)."""

DETECTED = {
    "flux-dev": ("flux", "FLUX.1-dev"),
    "flux-schnell": ("flux", "FLUX.1-schnell"),
    "flux.1-kontext-dev": ("flux-kontext", "FLUX.1-Kontext-dev"),
    "flux2-dev": ("flux2", "FLUX.2-dev"),
    "qwen-image": ("qwen-image", "Qwen-Image"),
    "qwen-image-edit": ("qwen-image-edit", "Qwen-Image-Edit"),
    "hunyuan-video": ("hunyuan-video", "HunyuanVideo"),
    "hunyuan-video-1.5-480p": ("hunyuan-video-1.5", "HunyuanVideo-1.5-480p_t2v"),
    "hunyuan-video-1.5-720p": ("hunyuan-video-1.5", "HunyuanVideo-1.5-720p_t2v"),
    "sd3.5-large": ("sd3", "SD3.5-large"),
    "sd3.5-medium": ("sd3", "SD3.5-medium"),
    "wan2.1-t2v-14b": ("wan", "Wan2.1-T2V-14B"),
    "wan2.1-t2v-1.3b": ("wan", "Wan2.1-T2V-1.3B"),
    "wan2.1-i2v-14b-480p": ("wan-i2v", "Wan2.1-I2V-14B"),
    "wan2.2-ti2v-5b": ("wan", "Wan2.2-TI2V-5B"),
    "wan2.2-t2v-a14b": ("wan2.2-a14b", "Wan2.2-T2V-A14B"),
    "wan2.2-i2v-a14b": ("wan2.2-a14b-i2v", "Wan2.2-I2V-A14B"),
}
"""What ``sdkiln.model_zoo.detect`` resolves each variant's directory to (family, variant)."""


def _blocks(model) -> dict[str, int]:
    return {
        name: len(child) for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)
    }


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_stored_configs_name_every_component(variant):
    spec = rm.VARIANTS[variant]
    components = rm.components(variant)
    assert set(components) == {*spec.weights, *spec.tokenizers, "scheduler", *rm.copied(variant)}
    for name, (library, class_name) in components.items():
        assert hasattr(importlib.import_module(library), class_name), f"{variant}/{name}: {class_name}"
    for name in rm.copied(variant):  # one config file, the one its class reads
        library, class_name = components[name]
        cls = getattr(importlib.import_module(library), class_name)
        file = "preprocessor_config.json" if library == "transformers" else cls.config_name
        assert [p.name for p in (rm.CONFIGS / variant / name).iterdir()] == [file]
    assert (rm.CONFIGS / variant / "SOURCE.md").is_file()


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_full_size_matches_the_published_checkpoints(variant):
    counts = rm.parameter_counts(variant)
    assert {name: round(n / 1e6, 1) for name, n in counts.items()} == PUBLISHED_PARAMS[variant]


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
    return out


_DEPTH_KEYS = {
    "num_layers", "num_hidden_layers", "num_single_layers", "dual_attention_layers", "layer_types", "depth",
    "fullatt_block_indexes",
}  # fmt: skip
_LAYERS = {
    "CLIPTextModel": "num_hidden_layers",
    "CLIPTextModelWithProjection": "num_hidden_layers",
    "CLIPVisionModelWithProjection": "num_hidden_layers",
    "LlamaModel": "num_hidden_layers",
    "Qwen2_5_VLTextModel": "num_hidden_layers",
    "T5EncoderModel": "num_layers",
    "UMT5EncoderModel": "num_layers",
    "Qwen2_5_VLForConditionalGeneration": "text_config.num_hidden_layers",
    "Mistral3ForConditionalGeneration": "text_config.num_hidden_layers",
}
"""Where each encoder class keeps its layer count (flattened config key)."""


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_depth_cuts_blocks_and_encoder_layers_and_keeps_width(variant):
    full = rm.component_configs(variant)
    cut = rm.component_configs(variant, depth=2)
    library, class_name, config = cut["transformer"]
    transformer = rm.empty_model(library, class_name, config, buffers=False)
    expected = {
        "FluxTransformer2DModel": {"transformer_blocks": 2, "single_transformer_blocks": 4},
        "Flux2Transformer2DModel": {"transformer_blocks": 2, "single_transformer_blocks": 12},
        "HunyuanVideoTransformer3DModel": {"transformer_blocks": 2, "single_transformer_blocks": 4},
        "HunyuanVideo15Transformer3DModel": {"transformer_blocks": 2},
        "QwenImageTransformer2DModel": {"transformer_blocks": 2},
        "SD3Transformer2DModel": {"transformer_blocks": 2},
        "WanTransformer3DModel": {"blocks": 2},
    }[class_name]
    assert _blocks(transformer) == expected
    if class_name == "HunyuanVideo15Transformer3DModel":  # the token refiner is not cut
        refiner = transformer.context_embedder.token_refiner.refiner_blocks
        assert len(refiner) == full["transformer"][2]["num_refiner_layers"] == 2
    if class_name == "SD3Transformer2DModel":
        dual = [i for i, block in enumerate(transformer.transformer_blocks) if block.attn2 is not None]
        assert dual == [i for i in full["transformer"][2].get("dual_attention_layers", []) if i < 2]
    spec = rm.VARIANTS[variant]
    for name, (_, class_name, config) in cut.items():
        flat, flat_full = _flat(config), _flat(full[name][2])
        unchanged = {k: v for k, v in flat.items() if k.split(".")[-1] not in _DEPTH_KEYS}
        assert unchanged == {k: v for k, v in flat_full.items() if k.split(".")[-1] not in _DEPTH_KEYS}, name
        if class_name in _LAYERS:
            assert flat[_LAYERS[class_name]] == max(2, spec.min_layers.get(name, 1)), name
        if "text_config.layer_types" in flat:  # Qwen2.5-VL, whose text fields are also at the top level
            assert len(flat["text_config.layer_types"]) == flat["text_config.num_hidden_layers"]
            assert flat["num_hidden_layers"] == flat["text_config.num_hidden_layers"]
        if "vision_config.depth" in flat:  # Qwen2.5-VL's vision blocks, the full-attention ones among them
            assert (flat["vision_config.depth"], flat["vision_config.fullatt_block_indexes"]) == (2, [])
        if "vision_config.num_hidden_layers" in flat:  # Pixtral
            assert flat["vision_config.num_hidden_layers"] == 2


def test_depth_counts_at_depth_2():
    """The cut that matters most: FLUX at --depth 2 is 2 double + 4 single blocks at full width."""
    counts = rm.parameter_counts("flux-dev", depth=2)
    assert round(counts["transformer"] / 1e6, 1) == 1_310.2
    assert round(counts["text_encoder_2"] / 1e6, 1) == 517.5


def test_encoders_keep_the_layers_their_pipelines_read():
    """FLUX.2 stacks Mistral's hidden states 10, 20 and 30; HunyuanVideo reads LLaMA's and
    HunyuanVideo-1.5 Qwen's hidden_states[-(num_hidden_layers_to_skip + 1)]; Wan I2V reads the CLIP
    tower's hidden_states[-2]: the cut keeps at least as many layers whatever --depth says."""
    from diffusers import Flux2Pipeline, HunyuanVideo15Pipeline, HunyuanVideoPipeline, WanImageToVideoPipeline

    read = max(inspect.signature(Flux2Pipeline.__call__).parameters["text_encoder_out_layers"].default)
    skip = inspect.signature(HunyuanVideoPipeline._get_llama_prompt_embeds).parameters[
        "num_hidden_layers_to_skip"
    ]
    skip_15 = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters[
        "num_hidden_layers_to_skip"
    ]
    assert "hidden_states[-2]" in inspect.getsource(WanImageToVideoPipeline.encode_image)
    for variant, name, least in [
        ("flux2-dev", "text_encoder", read),
        ("hunyuan-video", "text_encoder", skip.default + 1),
        ("hunyuan-video-1.5-480p", "text_encoder", skip_15.default + 1),
        ("hunyuan-video-1.5-720p", "text_encoder", skip_15.default + 1),
        ("wan2.1-i2v-14b-480p", "image_encoder", 2),
    ]:
        assert rm.VARIANTS[variant].min_layers[name] == least
        flat = _flat(rm.component_configs(variant, depth=1)[name][2])
        assert flat[_LAYERS[rm.components(variant)[name][1]]] == least


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_a_directory_of_the_cut_configs_is_detected_as_the_variant(variant, tmp_path):
    """What ``detect`` reads of a written directory (model_index.json and the transformer's config.json),
    at depth 1; ``load_model`` resolves a directory so before loading anything."""
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps(rm.model_index(variant)))
    config = rm.component_configs(variant, depth=1)["transformer"][2]
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    spec = detect(tmp_path)
    assert (spec.family, spec.variant) == DETECTED[variant]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "flux-pro"}, "unknown variant 'flux-pro'"),
        ({"depth": 0}, "--depth must be between 1 and 19"),
        ({"depth": 20}, "--depth must be between 1 and 19"),
        ({"dtype": "int8"}, "--dtype must be one of"),
    ],
)
def test_bad_arguments_are_refused_before_writing(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        rm.build(**{"variant": "flux-dev", "out": tmp_path / "out", **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rm.main(["sdxl", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown variant 'sdxl'; choose one of: flux-dev, flux-schnell" in err


def test_a_directory_this_tool_did_not_write_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    for force in (False, True):
        with pytest.raises(FileExistsError, match="not written by random_model.py"):
            rm.build("flux-dev", out, depth=1, force=force)
    assert (out / "precious.txt").read_text() == "keep"


def test_force_replaces_only_its_own_output_and_failures_leave_nothing(tmp_path, monkeypatch):
    """The write goes to a temporary sibling renamed at the end (the components are stubbed out here)."""
    monkeypatch.setattr(rm, "_write", lambda *args: {})
    out = tmp_path / "model"
    rm.build("wan2.1-t2v-1.3b", out, depth=1)
    record = json.loads((out / rm.MARKER).read_text())
    assert record["variant"] == "wan2.1-t2v-1.3b" and record["depth"] == 1 and record["dtype"] is None
    assert record["source"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    (out / "stale.txt").write_text("from the first run")
    with pytest.raises(FileExistsError, match="pass --force"):
        rm.build("wan2.1-t2v-1.3b", out)
    rm.build("flux-dev", out, dtype="fp16", seed=3, force=True)
    record = json.loads((out / rm.MARKER).read_text())
    assert (record["variant"], record["dtype"], record["seed"]) == ("flux-dev", "float16", 3)
    assert not (out / "stale.txt").exists()

    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(rm, "_write", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        rm.build("flux-dev", out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert json.loads((out / rm.MARKER).read_text())["variant"] == "flux-dev"


@pytest.mark.slow
def test_flux_dev_depth_1_writes_sharded_and_generates(tmp_path):
    """About 2.1 GiB on disk, a minute on 2 cores, 6 GB of memory at its peak (the fp32 pipeline)."""
    from diffusers import FluxPipeline
    from safetensors import safe_open

    out = rm.build("flux-dev", tmp_path / "flux", depth=1, dtype="bf16")
    record = json.loads((out / rm.MARKER).read_text())
    assert round(record["components"]["transformer"]["params"] / 1e6, 1) == 687.1
    for name, index in [
        ("transformer", "diffusion_pytorch_model.safetensors.index.json"),
        ("text_encoder_2", "model.safetensors.index.json"),
    ]:
        shards = set(json.loads((out / name / index).read_text())["weight_map"].values())
        assert len(shards) >= 2 and all((out / name / shard).is_file() for shard in shards)
        with safe_open(out / name / sorted(shards)[0], "pt") as f:
            assert f.get_slice(next(iter(f.keys()))).get_dtype() == "BF16"
    assert not list(out.rglob("*.bin"))

    pipe = FluxPipeline.from_pretrained(out, dtype=torch.float32)
    assert (pipe.transformer.config.num_layers, pipe.transformer.config.num_single_layers) == (1, 2)
    assert pipe.transformer.config.guidance_embeds and pipe.scheduler.config.shift == 3.0
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a cat",
        height=128,
        width=128,
        num_inference_steps=1,
        max_sequence_length=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 128, 128, 3) and torch.from_numpy(image).isfinite().all()


SLOW_CALLS = {
    # FluxKontextPipeline scales its image to about a megapixel unless told not to.
    "flux.1-kontext-dev": {
        "image": True,
        "max_area": 64 * 64,
        "_auto_resize": False,
        "max_sequence_length": 64,
    },
    "flux2-dev": {"max_sequence_length": 64, "text_encoder_out_layers": (1, 1, 1)},
    # Qwen-Image's scheduler (shift_terminal 0.02) makes NaN timesteps for a one-step call.
    "qwen-image": {"num_inference_steps": 2},
    "qwen-image-edit": {"image": True, "num_inference_steps": 2},
    "hunyuan-video": {"num_frames": 5, "max_sequence_length": 32},
    # A quoted text in the prompt: the only way the ByT5 glyph encoder runs.
    "hunyuan-video-1.5-480p": {"prompt": 'a sign that reads "OPEN"', "num_frames": 5},
    "hunyuan-video-1.5-720p": {"prompt": 'a sign that reads "OPEN"', "num_frames": 5},
    "wan2.1-i2v-14b-480p": {"image": True, "num_frames": 5},
    "wan2.2-ti2v-5b": {"num_frames": 5},
    "wan2.2-t2v-a14b": {"num_frames": 5, "num_inference_steps": 2},  # one step for each expert
    "wan2.2-i2v-a14b": {"image": True, "num_frames": 5, "num_inference_steps": 2},  # timesteps 999, 833
}
"""One small call per variant written by the slow test below (besides a 64x64 size and one step)."""


NEEDS_TORCHVISION = {
    "flux2-dev": {"tokenizer": ["transformers", "TokenizersBackend"]},
    "qwen-image-edit": {"processor": ["sdkiln.model_zoo.qwen_vl_processor", "Qwen2VLImageTextProcessor"]},
}
"""The processors whose class builds a torchvision part (PixtralProcessor's image processor,
Qwen2VLProcessor's video processor), and what model_index.json names instead where torchvision is
absent: the processor's own tokenizer, or sdkiln's Qwen2-VL processor without the video part."""


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(SLOW_CALLS))
def test_a_variant_at_depth_1_is_stored_as_published_loads_and_generates(variant, tmp_path, monkeypatch):
    """2 to 8.5 GiB on disk; 20 to 90 s each to write, load and generate on 2 cores (OMP_NUM_THREADS=2).
    FLUX.2-dev is written with one Mistral layer and one single-stream block: the 30 layers its pipeline
    reads are 33 GB, more than this machine's memory; the call reads hidden state 1 instead. Without
    torchvision, a processor is loaded as :data:`NEEDS_TORCHVISION` says."""
    import dataclasses
    import importlib.util

    from diffusers import DiffusionPipeline
    from PIL import Image

    spec = rm.VARIANTS[variant]
    if variant == "flux2-dev":
        monkeypatch.setitem(rm.VARIANTS, variant, dataclasses.replace(spec, min_layers={}))
        monkeypatch.setitem(
            rm.DEPTH_CUTS,
            "Flux2Transformer2DModel",
            lambda config, depth, floor: {"num_layers": depth, "num_single_layers": depth},
        )
    out = rm.build(variant, tmp_path / variant, depth=1)
    record = json.loads((out / rm.MARKER).read_text())
    for name, weights in spec.weights.items():
        assert stored_dtype(out, name) == weights.dtype, name
        assert record["components"][name]["dtype"] == str(weights.dtype).removeprefix("torch."), name
        assert (len(list((out / name).glob("*.safetensors"))) > 1) == (weights.shards > 1), name
    for name in rm.copied(variant):
        for file in (rm.CONFIGS / variant / name).iterdir():
            assert (out / name / file.name).read_text() == file.read_text(), file
    found = detect(out)
    assert (found.family, found.variant) == DETECTED[variant]
    if variant in NEEDS_TORCHVISION and importlib.util.find_spec("torchvision") is None:
        index = json.loads((out / "model_index.json").read_text())
        (out / "model_index.json").write_text(json.dumps(index | NEEDS_TORCHVISION[variant]))
        for library, _ in NEEDS_TORCHVISION[variant].values():
            importlib.import_module(library)  # diffusers loads components only from imported libraries

    pipe = DiffusionPipeline.from_pretrained(out, dtype=torch.bfloat16)
    assert type(pipe).__name__ == rm.model_index(variant)["_class_name"]
    pipe.set_progress_bar_config(disable=True)
    call = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 1, **SLOW_CALLS[variant]}
    if call.pop("image", False):
        call["image"] = Image.fromarray(
            np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        )
    result = pipe(output_type="np", generator=torch.Generator().manual_seed(0), **call)
    frames = np.asarray(result.frames if hasattr(result, "frames") else result.images)
    assert frames.shape[-3:] == (64, 64, 3) and np.isfinite(frames).all()
