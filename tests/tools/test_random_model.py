"""tools/random_model.py: every variant's stored configs build their diffusers and transformers classes
on the meta device, at full size (the published parameter counts) and cut by --depth; the tokenizers
have the real lengths and special ids; bad arguments and existing directories are refused, and a
failed or repeated write leaves no debris. One slow test writes flux-dev at depth 1 for real, loads it
with FluxPipeline and generates."""

import importlib
import importlib.util
import json
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("random_model", ROOT / "tools" / "random_model.py")
rm = sys.modules["random_model"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rm)

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
}
"""Millions of parameters of the full-size components: FLUX.1's 11.9B transformer (guidance embedder on
dev only), T5 v1.1 XXL's 4.76B encoder (9.5 GB in bf16), SD3.5 Large's 8.1B and Medium's 2.2B (2.5B with
its saved 384^2 positional table), Wan2.1's 14.3B and 1.42B (5.7 GB in fp32) and UMT5-XXL's 5.68B
encoder (21 GB in fp32)."""

TOKENIZER_LENGTHS = {"CLIPTokenizer": 49408, "T5TokenizerFast": {32128: 32100, 256384: 256300}}
"""What the real tokenizers report as ``len``: CLIP's full vocabulary; T5 32000 pieces + 100 sentinels
under a 32128-row embedding, UMT5 256000 + 300 under 256384."""


def _blocks(model) -> dict[str, int]:
    return {
        name: len(child) for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)
    }


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_stored_configs_name_every_component(variant):
    spec = rm.VARIANTS[variant]
    index = rm.model_index(variant)
    assert {k for k in index if not k.startswith("_")} == {*spec.weights, *spec.tokenizers, "scheduler"}
    for name, (library, class_name) in ((k, v) for k, v in index.items() if not k.startswith("_")):
        assert hasattr(importlib.import_module(library), class_name), f"{variant}/{name}: {class_name}"
    assert (rm.CONFIGS / variant / "SOURCE.md").is_file()


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_full_size_matches_the_published_checkpoints(variant):
    counts = rm.parameter_counts(variant)
    assert {name: round(n / 1e6, 1) for name, n in counts.items()} == PUBLISHED_PARAMS[variant]


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_depth_cuts_blocks_and_encoder_layers_and_keeps_width(variant):
    full = rm.component_configs(variant)
    cut = rm.component_configs(variant, depth=2)
    library, class_name, config = cut["transformer"]
    transformer = rm.empty_model(library, class_name, config, buffers=False)
    expected = {
        "FluxTransformer2DModel": {"transformer_blocks": 2, "single_transformer_blocks": 4},
        "SD3Transformer2DModel": {"transformer_blocks": 2},
        "WanTransformer3DModel": {"blocks": 2},
    }[class_name]
    assert _blocks(transformer) == expected
    if class_name == "SD3Transformer2DModel":
        dual = [i for i, block in enumerate(transformer.transformer_blocks) if block.attn2 is not None]
        assert dual == [i for i in full["transformer"][2].get("dual_attention_layers", []) if i < 2]
    for name, (_, class_name, config) in cut.items():
        depth_keys = {"num_layers", "num_hidden_layers", "num_single_layers", "dual_attention_layers"}
        unchanged = {k: v for k, v in config.items() if k not in depth_keys}
        assert unchanged == {k: v for k, v in full[name][2].items() if k not in depth_keys}, name
        if "TextModel" in class_name:
            assert config["num_hidden_layers"] == 2
        if "T5EncoderModel" in class_name:
            assert config["num_layers"] == 2


def test_depth_counts_at_depth_2():
    """The cut that matters most: FLUX at --depth 2 is 2 double + 4 single blocks at full width."""
    counts = rm.parameter_counts("flux-dev", depth=2)
    assert round(counts["transformer"] / 1e6, 1) == 1_310.2
    assert round(counts["text_encoder_2"] / 1e6, 1) == 517.5


@cache
def _round_trip(tokenizer_spec, class_name: str, root: Path):
    """The tokenizer built, saved and loaded back by the class model_index.json names; once per spec."""
    path = root / f"tokenizer-{abs(hash(tokenizer_spec))}"
    tokenizer_spec.save(tokenizer_spec.build(), path)
    return path, getattr(importlib.import_module("transformers"), class_name).from_pretrained(path)


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_tokenizers_have_the_real_length_and_ids_inside_the_embedding(variant, tmp_path_factory):
    spec = rm.VARIANTS[variant]
    index, configs = rm.model_index(variant), rm.component_configs(variant)
    for name, tokenizer_spec in spec.tokenizers.items():
        class_name = index[name][1]
        path, tokenizer = _round_trip(tokenizer_spec, class_name, tmp_path_factory.getbasetemp())
        encoder = configs[name.replace("tokenizer", "text_encoder")][2]
        expected = TOKENIZER_LENGTHS[class_name]
        assert len(tokenizer) == (expected if isinstance(expected, int) else expected[encoder["vocab_size"]])
        ids = tokenizer("A photo of a cat, 4K; <extra_id_0> ünïcode 猫").input_ids
        assert max(ids) < encoder["vocab_size"]
        if class_name == "CLIPTokenizer":
            assert (ids[0], ids[-1]) == (49406, 49407) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
            assert len(json.loads((path / "vocab.json").read_text())) == 49408
        else:
            assert (tokenizer.pad_token_id, tokenizer.eos_token_id, ids[-1]) == (0, 1, 1)
            assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == len(tokenizer) - 1


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
