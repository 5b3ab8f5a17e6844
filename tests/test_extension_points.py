"""The seams docs/architecture.md promises, used the way a contributor would: a new quantization
scheme and a new package section, each added in the few places the map names and nowhere else.
(A kernel for an existing op: tests/kernels/test_ops.py; an attention backend:
tests/runtime/test_attention.py.)"""

import json
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import sdkiln
from sdkiln import kernels
from sdkiln.configs import (
    RECIPE_STEPS,
    QuantAutoConfig,
    QuantStep,
    RecipeConfig,
    quant_auto_schemes,
    register_step,
)
from sdkiln.errors import PackageError
from sdkiln.optimizer import registry as transforms
from sdkiln.optimizer.evaluate import generate
from sdkiln.optimizer.quant.weights import apply_weight_scheme
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.runtime import quant as runtime_quant
from sdkiln.runtime import restore
from sdkiln.runtime.quant import QuantLinear

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "schema1_flux_tiny" / "package"


@pytest.fixture
def new_scheme():
    """W8A16 with one weight scale per tensor: a runtime class (file 1: runtime/quant/), its recipe
    config (file 2: configs/quant.py) and its transform (file 3: one more config class in
    optimizer/quant/weights.py's registration); everything else derives from them."""

    class W8A16TensorLinear(QuantLinear):
        scheme = "W8A16_TENSOR"
        recipe_kind = "w8a16_tensor"
        weight_range = (-128, 127)
        ascend_refusal = "a demonstration scheme"

        def __init__(self, in_features, out_features, bias, dtype=torch.float32, device=None):
            super().__init__()
            self.register_buffer(
                "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
            )
            self.register_buffer(
                "weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device)
            )
            self._init_linear(in_features, out_features, bias, dtype, device)

        @classmethod
        def from_linear(cls, linear: nn.Linear, ranges=None):
            w = linear.weight.detach().float()
            mod = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
            scale = (w.abs().max() / 127.5).clamp_min(1e-12)
            mod.weight.copy_(torch.round(w / scale).clamp(-128, 127))
            mod.weight_scale.fill_(scale)
            if linear.bias is not None:
                mod.bias.copy_(linear.bias.detach())
            return mod

        def set_values(self, values):
            self.weight.copy_(values.to(torch.int8))

        def forward(self, x):
            return kernels.weight_only_linear(x, self.weight, self.weight_scale, self.bias, 0)

    @register_step
    @dataclass
    class W8A16TensorConfig(QuantStep):
        kind: ClassVar[str] = "w8a16_tensor"
        transform_module: ClassVar[str] = "sdkiln.optimizer.quant.weights"

    transforms.register_transform(W8A16TensorConfig)(apply_weight_scheme)
    try:
        yield W8A16TensorLinear, W8A16TensorConfig
    finally:
        runtime_quant._REGISTRY.pop("W8A16_TENSOR")
        RECIPE_STEPS.pop("w8a16_tensor")
        transforms._TRANSFORMS.pop(W8A16TensorConfig)


def test_a_new_scheme_is_named_mixed_packaged_and_loaded(new_scheme, tmp_path):
    cls, config_cls = new_scheme
    recipe = resolve_recipe("w8a16-tensor")  # its name comes from the registered config
    assert recipe.steps == [config_cls()] and "w8a16_tensor" in quant_auto_schemes()
    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=1)
    assert {m["scheme"] for m in result.manifest["modules"].values()} == {"W8A16_TENSOR"}
    assert result.quality["psnr"] > 25
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    assert sum(isinstance(m, cls) for m in loaded.transformer.modules()) == len(result.manifest["modules"])
    call = result.spec.call_kwargs()
    assert torch.equal(
        generate(loaded, call, ["a cat"], [1])[1], generate(result.pipeline, call, ["a cat"], [1])[1]
    )
    # quant_auto takes it as a candidate (its builder and range needs come from the class)
    mixed = RecipeConfig("mix", [QuantAutoConfig(scheme="w8a16_tensor", fallbacks=(), sqnr_floor_db=0.0, calib_samples=1,
                                                 sensitivity_samples=1)])  # fmt: skip
    plan = sdkiln.optimize("flux-tiny", mixed, eval_samples=0).manifest["recipe"]["steps"][0]["result"]
    assert set(plan["counts"]) == {"w8a16_tensor", "float"} and plan["counts"]["w8a16_tensor"] > 0


def test_a_new_section_is_restored_by_its_handler(tmp_path, monkeypatch):
    """One module with a ``SECTION`` and one line in ``SECTION_MODULES``; without the registration
    the same package is refused."""
    package = Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["watermark"] = {"text": "made by sdkiln"}
    (package / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="unknown section 'watermark'"):
        sdkiln.load(package, device="cpu")

    module = types.ModuleType("watermark_section")
    module.SECTION = restore.Section(
        name="watermark",
        present=lambda m: "watermark" in m,
        attach=lambda ctx: setattr(ctx.pipeline, "watermark", ctx.manifest["watermark"]["text"]),
    )
    monkeypatch.setitem(sys.modules, "watermark_section", module)
    monkeypatch.setattr(restore, "SECTION_MODULES", (*restore.SECTION_MODULES, "watermark_section"))
    assert sdkiln.load(package, device="cpu").watermark == "made by sdkiln"
