"""The attention plan in MindIE SD's form: ``export-ascend`` writes the layers an ``attn-fp8-ascend`` plan
(``layout="mindie"``) quantizes at every step as ``FP8_DYNAMIC`` FA quantization with their rotations, and
what MindIE SD's ``FP8RotateQuantFA`` computes from them (``mindie_emulation.mindie_fa``) is checked per
layer against our runtime's ``sdkiln::fp8_block_attention`` on the embedded model's own attention inputs.

Both quantize the same FP8 blocks (Q per 128 tokens, K and V per 256, by 128 channels, no smoothing) and
differ in the softmax's precision before one rounding to the deployment dtype. Tolerance, stated once:
the relative L2 error of a layer's output, by deployment dtype, at the linears' bounds
(``test_mindie_fidelity.LAYER_REL_ERR``). A SageAttention-layout plan's attention stays float in the export.
"""

import json

import pytest
import torch

import sdkiln
from sdkiln import kernels as K
from sdkiln.configs import AttentionQuantConfig, Deployment, RecipeConfig, W8A8DynamicConfig
from sdkiln.errors import RecipeError
from sdkiln.export import export_ascend
from sdkiln.kernels.ops.quantized_attention import hadamard
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.attention.quantized import PLAN_FILE

from . import mindie_emulation as mindie
from .ascend_rules import read_ascend_dir
from .test_mindie_fidelity import LAYER_REL_ERR

STEPS = 4


def _package(tmp_path, qk: str, layout: str = "sage"):
    # a low floor, so that layers pass at every step: the check is of the export, not of the floor
    config = AttentionQuantConfig(
        qk=qk, pv="fp8", layout=layout, sqnr_floor_db=20.0, psnr_floor_db=20.0, calib_samples=1
    )
    recipe = RecipeConfig(
        f"attn-{qk}-{layout}", [W8A8DynamicConfig(), config], Deployment(num_inference_steps=STEPS)
    )
    path = tmp_path / f"{qk}-{layout}"
    sdkiln.optimize("fmnist-flux", recipe, path, eval_samples=0)
    return path, json.loads((path / PLAN_FILE).read_text())


def test_a_mindie_layout_plan_exports_as_fa_quantization_and_matches_mindie_per_layer(tmp_path, monkeypatch):
    path, plan = _package(tmp_path, "fp8", "mindie")
    assert plan["layout"] == "mindie"
    export = export_ascend(path, tmp_path / "ascend")
    view = read_ascend_dir(tmp_path / "ascend")
    every = {n for n, e in plan["layers"].items() if all(e["steps"])}
    assert every and set(view.fa_layers) == every
    assert export.attention["layers"] == len(every) and export.attention["plan_layers"] == len(plan["layers"])
    for name, (q_rot, k_rot) in view.fa_layers.items():
        want = hadamard(32) if plan["layers"][name]["rotate"] else torch.eye(32)
        assert torch.equal(q_rot, want) and torch.equal(k_rot, want)
        assert view.description[f"{name}.quant_type"] == "FP8_DYNAMIC"
    # the embedded model's own attention inputs, one call per exported layer at the first step
    seen, real = {}, K.fp8_block_attention

    def capture(q, k, v, mask, scale, rotate):
        import inspect

        call = inspect.currentframe().f_back.f_locals["call"]
        seen.setdefault(call.name, (q, k, v, rotate))
        return real(q, k, v, mask, scale, rotate)

    monkeypatch.setattr(K, "fp8_block_attention", capture)
    pipe = sdkiln.load(path, device="cpu")
    pipe(prompt="a sneaker", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0))
    assert every <= set(seen)
    for name in sorted(every):
        q, k, v, rotate = seen[name]
        q, k, v = q[:1], k[:1], v[:1]  # MindIE SD's block quantization takes one batch row
        ref, _ = K.attention(q, k, v)
        for dtype, bound in LAYER_REL_ERR.items():
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))  # as deployed on Ascend
            ours = real(qd, kd, vd, None, None, rotate).float()
            theirs = mindie.mindie_fa(qd, kd, vd, *view.fa_layers[name], out_dtype=dtype).float()
            rel = float((ours - theirs).norm() / theirs.norm())
            print(
                f"{name} {dtype}: relative error {rel:.1e} (bound {bound:g}); SQNR vs float {sqnr_db(ref, ours):.1f} dB"
            )
            assert rel <= bound, (name, dtype, rel)


@pytest.mark.parametrize("qk", ["int8", "fp8"])
def test_a_sage_layout_plan_exports_its_linears_and_says_why_its_attention_stays_float(tmp_path, capsys, qk):
    from sdkiln.cli import main

    path, plan = _package(tmp_path, qk)
    assert main(["export-ascend", str(path), "--out", str(tmp_path / "ascend")]) == 0
    assert read_ascend_dir(tmp_path / "ascend").fa_layers == {}
    printed = capsys.readouterr().out
    assert f"attention ({qk}/fp8): 0 of the plan's {len(plan['layers'])} layers" in printed
    assert "calibrated in SageAttention's layout" in printed and "attn-fp8-ascend" in printed


def test_optimize_for_ascend_refuses_a_sage_layout_attention_step_before_calibrating(tmp_path):
    with pytest.raises(RecipeError, match="attn-fp8-ascend"):
        sdkiln.optimize(
            "fmnist-flux", "w8a8-dynamic+attn-fp8", tmp_path / "pkg", eval_samples=0, format="ascend"
        )
    assert not (tmp_path / "pkg").exists()
