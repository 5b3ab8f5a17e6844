"""LoRA from the command line and offline: ``sdkiln run --lora FILE[:STRENGTH]`` (a runtime branch on the
package) and ``sdkiln optimize --lora FILE[:STRENGTH]`` (fused into the float weights before any recipe
step, recorded in the manifest). A package made without a recipe step holds the float weights, so the
fused LoRA and the branch compute the same model: ``FP32_TOL`` on the images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import sdkiln
from sdkiln.cli import main
from sdkiln.configs import LoraFile
from sdkiln.errors import SdkilnError

sys.path.insert(0, str(Path(__file__).parent))
from lora_helpers import tiny_images  # noqa: E402  (tests/runtime/lora_helpers.py)

FP32_TOL = 1e-5
PNG_TOL = 1  # 8-bit pixels: one step of rounding


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    """A diffusers-format LoRA on flux-tiny's attention projections and modulations, rank 4."""
    from sdkiln.model_zoo import get_spec

    transformer = get_spec("flux-tiny").build().transformer
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, module in transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_out.0", "norm1.linear", "proj_mlp")):
            k, n = module.in_features, module.out_features
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, k, generator=g) / k**0.5
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(n, 4, generator=g)
    path = tmp_path_factory.mktemp("lora") / "style.safetensors"
    save_file(state, path)
    return path


def test_optimize_lora_fuses_what_the_runtime_branch_adds(lora_file, tmp_path, capsys):
    fused = sdkiln.optimize(
        "flux-tiny",
        "none",
        tmp_path / "fused",
        eval_samples=0,
        progress=False,
        lora=[LoraFile(str(lora_file), 0.6)],
    ).package
    plain = sdkiln.optimize("flux-tiny", "none", tmp_path / "plain", eval_samples=0, progress=False).package
    manifest = json.loads((fused / "manifest.json").read_text())
    (record,) = manifest["model"]["fused_loras"]
    assert (
        record["file"] == "style.safetensors"
        and record["strength"] == 0.6
        and record["layers"] == len(load_file(lora_file)) // 2
    )
    assert len(record["sha256"]) == 64
    assert (
        manifest["model"]["weights_hash"]
        != json.loads((plain / "manifest.json").read_text())["model"]["weights_hash"]
    )
    assert main(["inspect", str(fused)]) == 0
    printed = capsys.readouterr().out
    assert "fused LoRA: style.safetensors at strength 0.6 on" in printed
    from sdkiln.export.summary import summarize
    from sdkiln.runtime.package import open_package

    counts = summarize(open_package(plain))["lora_layers"]
    runner = sdkiln.load(plain, device="cpu").sdkiln_lora
    targets = [n for n, m in runner.transformer.named_modules() if runner._is_target(n, m)]
    assert counts == {"quantized": 0, "float": len(targets)}
    assert f"LoRA: a runtime LoRA may target {len(targets)} layers (0 quantized" in printed
    branch = sdkiln.load(plain, device="cpu")
    branch.load_lora_weights(lora_file, adapter_name="style")
    branch.set_adapters("style", 0.6)
    np.testing.assert_allclose(
        tiny_images(sdkiln.load(fused, device="cpu")), tiny_images(branch), atol=FP32_TOL, rtol=0
    )


def test_run_lora_is_the_branch_at_the_strength(lora_file, tmp_path, capsys):
    package = sdkiln.optimize(
        "flux-tiny", "w8a8-dynamic", tmp_path / "pkg", eval_samples=0, progress=False
    ).package
    outs = {}
    for flags in ([], ["--lora", f"{lora_file}:0.5"]):
        png = tmp_path / f"out{len(flags)}.png"
        assert (
            main(["run", str(package), "--prompt", "a cat", "--steps", "2", "--out", str(png), *flags]) == 0
        )
        outs[len(flags)] = np.asarray(Image.open(png)).astype(int)
    pipe = sdkiln.load(package, device="cpu")
    from sdkiln.export.summary import summarize
    from sdkiln.runtime.package import open_package

    counts = summarize(open_package(package))["lora_layers"]
    runner = pipe.sdkiln_lora
    targets = [n for n, m in runner.transformer.named_modules() if runner._is_target(n, m)]
    assert counts["quantized"] == len(pipe.sdkiln_manifest["modules"]) > 0
    assert counts["quantized"] + counts["float"] == len(targets)
    call = dict(pipe.sdkiln_manifest["call"]["defaults"]) | {"num_inference_steps": 2, "output_type": "np"}
    pipe.load_lora_weights(lora_file)
    pipe.set_adapters("default_0", 0.5)
    want = pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **call).images[0]
    assert np.abs(outs[2] - np.round(want * 255)).max() <= PNG_TOL
    assert np.abs(outs[2] - outs[0]).max() > 2  # the LoRA shows


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("style.bin", "a LoRA is read from a .safetensors file"),
        ("style.safetensors:nan", "the strength must be a finite number"),
    ],
)
def test_bad_lora_arguments_are_one_line(text, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", str(tmp_path), "--prompt", "a", "--lora", text])
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    with pytest.raises(SdkilnError, match=message):
        LoraFile.parse(text)


def test_a_strength_after_the_last_colon():
    assert LoraFile.parse("a:b.safetensors:0.25") == LoraFile("a:b.safetensors", 0.25)
    assert LoraFile.parse("x.safetensors") == LoraFile("x.safetensors", 1.0)
