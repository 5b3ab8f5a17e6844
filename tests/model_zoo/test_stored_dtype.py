"""Issue 31's crash case: a diffusers directory stored in 16 bits (transformer, VAE and text encoders,
as FLUX.1-dev and SD3.5 ship) loads every component in one dtype, optimizes and runs, and the CLI
shows no traceback."""

import json
import struct

import pytest
import torch

from sdkiln.cli import main
from sdkiln.errors import ModelError
from sdkiln.model_zoo import get_spec, load_model, stored_dtype
from sdkiln.optimizer import optimize


def saved(tmp_path_factory, name: str, dtype: torch.dtype):
    out = tmp_path_factory.mktemp(f"{name}-{str(dtype).removeprefix('torch.')}")
    pipe = get_spec(name).build()
    pipe.to(dtype)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def flux_bf16(tmp_path_factory):
    return saved(tmp_path_factory, "flux-tiny", torch.bfloat16)


@pytest.fixture(scope="module")
def sd3_fp16(tmp_path_factory):
    return saved(tmp_path_factory, "sd3-tiny", torch.float16)


def dtypes(pipe) -> set[torch.dtype]:
    return {
        p.dtype
        for name in pipe.components
        if isinstance(getattr(pipe, name), torch.nn.Module)
        for p in getattr(pipe, name).parameters()
    }


def test_every_component_loads_in_one_dtype(flux_bf16):
    assert stored_dtype(flux_bf16, "transformer") == torch.bfloat16
    pipe, spec, _ = load_model(str(flux_bf16))
    assert dtypes(pipe) == {torch.bfloat16}
    pipe, _, _ = load_model(str(flux_bf16), torch.float32)  # optimize --dtype float32
    assert dtypes(pipe) == {torch.float32}


@pytest.mark.parametrize("model, recipe", [("flux_bf16", "w8a8-dynamic"), ("sd3_fp16", "default")])
def test_16bit_directory_optimizes_runs_and_evaluates(request, tmp_path, capsys, model, recipe):
    directory = request.getfixturevalue(model)
    dtype = "bfloat16" if model == "flux_bf16" else "float16"
    out = tmp_path / "pkg"
    assert (
        main(["optimize", str(directory), "--recipe", recipe, "--out", str(out), "--eval-samples", "1"]) == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["dtype"] == dtype
    assert main(["run", str(out), "--prompt", "a cat", "--out", str(tmp_path / "a.png")]) == 0
    assert main(["eval", str(out), "--num-samples", "1"]) == 0  # the base reloads in the package's dtype
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    if recipe == "default":  # sd3-tiny's 2 blocks leave partial:1:1 nothing to reuse: left out, not a crash
        schedule = json.loads((out / "schedules" / "cache_schedule.json").read_text())
        assert schedule["search"]["actions_left_out"] == ["partial:1:1"]


def test_a_damaged_safetensors_header_is_one_error(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "a.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        stored_dtype(tmp_path, "transformer")
    assert stored_dtype(tmp_path, "vae") is None  # no weights: the caller's default


def test_dtype_is_for_models_given_by_name_or_directory():
    pipe = get_spec("flux-tiny").build()
    with pytest.raises(ValueError, match="give the model by name or directory"):
        optimize(pipe, "none", dtype=torch.bfloat16)
