"""A family is not its test build: a diffusers directory is recognised as the variant its transformer's
width says, from its JSON alone, and gets that variant's published call defaults.

The real variants are written as directories of JSON only (model_index.json and the transformer's
config.json, its published values with the depth cut to one block, no weights): detection must not
need weights, and anything that tried to load some would fail on these directories.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest

from sdkiln.cli import main
from sdkiln.configs import Deployment, RecipeConfig
from sdkiln.errors import ModelError, PackageError, RecipeError
from sdkiln.model_zoo import detect, get_spec, load_model, spec_for_pipeline
from sdkiln.optimizer.registry import TransformContext
from sdkiln.runtime.manifest_schema import check_manifest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"

_FLUX = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 1,
    "num_single_layers": 1,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
_SD3 = {
    "_class_name": "SD3Transformer2DModel",
    "attention_head_dim": 64,
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_layers": 1,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "sample_size": 128,
}
_WAN = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_layers": 1,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
PIPELINES = {
    "flux": ("FluxPipeline", "FluxTransformer2DModel"),
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel"),
    "wan": ("WanPipeline", "WanTransformer3DModel"),
}
# variant -> (family, its published transformer config at cut depth, the defaults its model card or
# diffusers' pipeline publish). SD3-medium's config.json predates qk_norm and dual attention: the
# class's defaults stand in for the keys it leaves out.
REAL = {
    "FLUX.1-dev": (
        "flux",
        {**_FLUX, "guidance_embeds": True},
        {
            "num_inference_steps": 28,
            "guidance_scale": 3.5,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 512,
        },
    ),
    "FLUX.1-schnell": (
        "flux",
        {**_FLUX, "guidance_embeds": False},
        {
            "num_inference_steps": 4,
            "guidance_scale": 0.0,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 256,
        },
    ),
    "SD3-medium": (
        "sd3",
        {**_SD3, "caption_projection_dim": 1536, "num_attention_heads": 24, "pos_embed_max_size": 192},
        {
            "num_inference_steps": 28,
            "guidance_scale": 7.0,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 256,
        },
    ),
    "SD3.5-medium": (
        "sd3",
        {
            **_SD3,
            "caption_projection_dim": 1536,
            "dual_attention_layers": [0],
            "num_attention_heads": 24,
            "pos_embed_max_size": 384,
            "qk_norm": "rms_norm",
        },
        {
            "num_inference_steps": 40,
            "guidance_scale": 4.5,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 256,
        },
    ),
    "SD3.5-large": (
        "sd3",
        {
            **_SD3,
            "caption_projection_dim": 2432,
            "num_attention_heads": 38,
            "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
        },
        {
            "num_inference_steps": 28,
            "guidance_scale": 3.5,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 256,
        },
    ),
    "Wan2.1-T2V-1.3B": (
        "wan",
        {**_WAN, "ffn_dim": 8960, "num_attention_heads": 12},
        {
            "num_inference_steps": 50,
            "guidance_scale": 5.0,
            "height": 480,
            "width": 832,
            "num_frames": 81,
            "max_sequence_length": 512,
        },
    ),
    "Wan2.1-T2V-14B": (
        "wan",
        {**_WAN, "ffn_dim": 13824, "num_attention_heads": 40},
        {
            "num_inference_steps": 50,
            "guidance_scale": 5.0,
            "height": 720,
            "width": 1280,
            "num_frames": 81,
            "max_sequence_length": 512,
        },
    ),
}
TINY_DEFAULTS = {
    "flux-tiny": {
        "num_inference_steps": 4,
        "true_cfg_scale": 2.0,
        "negative_prompt": "",
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "output_type": "np",
    },
    "sd3-tiny": {
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "output_type": "np",
    },
    "wan-tiny": {
        "num_inference_steps": 4,
        "guidance_scale": 5.0,
        "height": 64,
        "width": 64,
        "num_frames": 5,
        "max_sequence_length": 16,
        "output_type": "np",
    },
    "qwen-image-edit-tiny": {
        "num_inference_steps": 4,
        "true_cfg_scale": 4.0,
        "negative_prompt": " ",
        "height": 256,
        "width": 256,
        "output_type": "np",
    },
}


def json_directory(root: Path, family: str, config: dict, **index) -> Path:
    """A diffusers directory of JSON only: model_index.json and transformer/config.json."""
    pipeline, transformer = PIPELINES[family]
    (root / "transformer").mkdir(parents=True)
    index = {"_class_name": pipeline, "transformer": ["diffusers", transformer], **index}
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("variant", list(REAL))
def test_a_real_width_directory_is_its_variant_with_the_published_defaults(tmp_path, variant):
    family, config, published = REAL[variant]
    spec = detect(json_directory(tmp_path, family, config))
    assert (spec.family, spec.variant) == (family, variant)
    assert spec.call_defaults == {**published, "output_type": "np"}
    assert spec.guidance_arg == "guidance_scale"
    assert spec == get_spec(family, variant)


def test_flux_dev_guidance_is_distilled_not_true_cfg():
    """The guidance of a deployment goes to FLUX.1-dev's guidance_scale: one pass per step, no
    negative prompt; the tiny build keeps true CFG."""
    recipe = RecipeConfig("none", deployment=Deployment(guidance=2.0, num_frames=5))
    ctx = TransformContext(None, get_spec("flux", "FLUX.1-dev"), None, recipe)
    call = ctx.call_kwargs()
    assert call["guidance_scale"] == 2.0
    assert "true_cfg_scale" not in call and "negative_prompt" not in call
    with pytest.raises(RecipeError, match="without num_frames"):
        ctx.check_deployment()
    tiny = TransformContext(
        None, get_spec("flux"), None, RecipeConfig("none", deployment=Deployment(guidance=2.5))
    )
    assert tiny.call_kwargs()["true_cfg_scale"] == 2.5


@pytest.mark.parametrize("name", list(TINY_DEFAULTS))
def test_a_saved_tiny_build_is_tiny_with_todays_defaults(tmp_path, name):
    pipe = get_spec(name).build()
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    spec = detect(tmp_path)
    assert (spec.name, spec.variant) == (name, "tiny")
    assert spec.call_defaults == TINY_DEFAULTS[name]
    assert spec == get_spec(name)
    assert spec_for_pipeline(pipe) == spec


def test_the_embedded_model_is_its_one_variant():
    spec = get_spec("fmnist-flux")
    assert (spec.family, spec.variant) == ("fmnist-flux", "embedded")
    assert spec_for_pipeline(spec.build()) == spec


@pytest.mark.parametrize("family", ["fmnist-flux", "flux", "sd3", "wan"])
def test_each_variant_is_told_apart_from_the_others(family):
    """Every variant's width, over its transformer class's defaults, is that variant and no other."""
    import diffusers

    spec = get_spec(family)
    cls = getattr(diffusers, type(spec.build().transformer).__name__)
    defaults = {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    for variant in spec.variants:
        assert spec.detect({**defaults, **variant.match}, "x").variant == variant.name
        assert not any(key.startswith("num_layers") or key == "num_single_layers" for key in variant.match)


def test_an_unknown_width_is_one_line_naming_what_was_found(tmp_path):
    config = {**_FLUX, "attention_head_dim": 64, "num_attention_heads": 8, "joint_attention_dim": 256}
    directory = json_directory(tmp_path, "flux", {**config, "guidance_embeds": True})
    with pytest.raises(ModelError) as err:
        load_model(str(directory))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{directory}: FluxPipeline with transformer config ")
    for found in (
        "attention_head_dim=64",
        "num_attention_heads=8",
        "joint_attention_dim=256",
        "guidance_embeds=True",
    ):
        assert found in message
    assert message.endswith("is no known flux variant (FLUX.1-dev, FLUX.1-schnell, tiny)")


def test_wan22_two_experts_are_their_own_family_before_any_weights(tmp_path):
    """Wan2.2-T2V-A14B has Wan2.1-14B's width: only its model_index.json (both experts and the
    boundary) tells it apart, and it is the wan2.2-a14b family's."""
    directory = json_directory(
        tmp_path,
        "wan",
        {**_WAN, "ffn_dim": 13824, "num_attention_heads": 40},
        transformer_2=["diffusers", "WanTransformer3DModel"],
        boundary_ratio=0.875,
    )
    spec = detect(directory)
    assert (spec.family, spec.variant, spec.experts) == ("wan2.2-a14b", "Wan2.2-T2V-A14B", ("transformer_2",))


@pytest.mark.parametrize(
    "index",
    [
        {"transformer_2": [None, None], "boundary_ratio": 0.875},
        {"transformer_2": ["diffusers", "WanTransformer3DModel"]},
    ],
    ids=["boundary-ratio-only", "second-expert-only"],
)
def test_half_a_two_expert_layout_is_refused_before_any_weights(tmp_path, index):
    directory = json_directory(
        tmp_path, "wan", {**_WAN, "ffn_dim": 13824, "num_attention_heads": 40}, **index
    )
    with pytest.raises(ModelError, match="sets transformer_2 or boundary_ratio but not both") as err:
        load_model(str(directory))
    assert "\n" not in str(err.value)


def test_a_saved_wan21_index_with_empty_second_expert_is_accepted(tmp_path):
    """diffusers writes ``transformer_2: [null, null]`` and ``boundary_ratio: null`` for Wan2.1."""
    directory = json_directory(
        tmp_path,
        "wan",
        {**_WAN, "ffn_dim": 8960, "num_attention_heads": 12},
        transformer_2=[None, None],
        boundary_ratio=None,
    )
    assert detect(directory).variant == "Wan2.1-T2V-1.3B"


def test_family_and_zoo_names_both_resolve():
    assert get_spec("flux") is get_spec("flux-tiny")
    assert get_spec("flux").name == "flux-tiny" and get_spec("flux").variant == "tiny"
    assert get_spec("wan-tiny", "Wan2.1-T2V-14B") == get_spec("wan", "Wan2.1-T2V-14B")
    assert get_spec("flux", "FLUX.1-dev").resolve("tiny") == get_spec("flux-tiny")
    with pytest.raises(ModelError, match=r"no variant 'FLUX.1-pro' \(FLUX.1-dev, FLUX.1-schnell, tiny\)"):
        get_spec("flux", "FLUX.1-pro")
    with pytest.raises(ModelError, match="unknown model 'flux3'"):
        get_spec("flux3")


def test_manifest_variant_is_an_optional_bounded_string():
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    check_manifest(manifest)  # made before variants: family "flux-tiny", no variant
    manifest["model"].update(family="flux", variant="tiny")
    check_manifest(manifest)
    manifest["model"]["variant"] = "x" * 201
    with pytest.raises(PackageError, match="model.variant"):
        check_manifest(manifest)


def test_eval_and_inspect_resolve_family_and_variant_from_the_manifest(tmp_path, capsys):
    root = Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"].update(family="flux", variant="tiny")
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(root)]) == 0
    assert "(flux tiny; diffusers:FluxPipeline, float32)" in capsys.readouterr().out
    assert main(["eval", str(root), "--num-samples", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 1


PUBLISHED_CONFIGS = {  # tools/model_configs/<dir> (published JSON, SOURCE.md) -> (family, variant)
    "flux2-dev": ("flux2", "FLUX.2-dev"),
    "hunyuan-video": ("hunyuan-video", "HunyuanVideo"),
    "qwen-image": ("qwen-image", "Qwen-Image"),
    "wan2.1-i2v-14b-480p": ("wan-i2v", "Wan2.1-I2V-14B"),
    "wan2.2-ti2v-5b": ("wan", "Wan2.2-TI2V-5B"),
}


@pytest.mark.parametrize("directory", list(PUBLISHED_CONFIGS))
def test_a_published_config_directory_is_detected_as_its_variant(tmp_path, directory):
    """The published configs of the families added for issue 33, read as a directory of them is read
    (model_index.json and the transformer's config.json, no weights)."""
    source = Path(__file__).resolve().parents[2] / "tools" / "model_configs" / directory
    (tmp_path / "transformer").mkdir()
    shutil.copy(source / "model_index.json", tmp_path / "model_index.json")
    shutil.copy(source / "transformer" / "config.json", tmp_path / "transformer" / "config.json")
    spec = detect(tmp_path)
    assert (spec.family, spec.variant) == PUBLISHED_CONFIGS[directory]


def test_qwen_image_edit_is_told_from_qwen_image_by_its_pipeline_class(tmp_path):
    """Qwen-Image-Edit's transformer is Qwen-Image's, width for width (the published config in
    tools/model_configs/qwen-image): model_index.json's QwenImageEditPipeline makes it the edit family,
    with QwenImageEditPipeline's published defaults at a square picture's output size."""
    source = Path(__file__).resolve().parents[2] / "tools" / "model_configs" / "qwen-image"
    (tmp_path / "transformer").mkdir()
    shutil.copy(source / "transformer" / "config.json", tmp_path / "transformer" / "config.json")
    index = json.loads((source / "model_index.json").read_text())
    index.update(_class_name="QwenImageEditPipeline", processor=["transformers", "Qwen2VLProcessor"])
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    spec = detect(tmp_path)
    assert (spec.family, spec.variant) == ("qwen-image-edit", "Qwen-Image-Edit")
    assert spec.call_defaults == {
        "num_inference_steps": 50,
        "true_cfg_scale": 4.0,
        "negative_prompt": " ",
        "height": 1024,
        "width": 1024,
        "output_type": "np",
    }
    assert spec.guidance_arg == "true_cfg_scale" and spec.image_required and spec.image_per_prompt
