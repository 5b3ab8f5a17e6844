"""The attention plan in MindIE SD's form: ``export-ascend`` writes the layers an FP8 plan quantizes at
every step as ``FP8_DYNAMIC`` FA quantization with their rotations, and what MindIE SD's
``FP8RotateQuantFA`` computes from them (``mindie_emulation.mindie_fa``) is checked per layer against
our ``sdkiln::quantized_attention`` on the embedded model's own attention inputs.

The two are not the same arithmetic, so they are compared by SQNR, not by the linears' bounds: MindIE
SD quantizes Q per block of 128 tokens and K, V per 256 (by 128 channels), without K smoothing, and
the hardware's rounding of P is not documented (the emulation keeps P exact); ours quantizes Q per
token, K per 64 keys after smoothing, V per channel and P per key block. Tolerance, stated once:
each against float attention, and the two against each other, at ``FA_MIN_SQNR_DB`` or more.
"""

import json

import torch

import sdkiln
from sdkiln import kernels as K
from sdkiln.configs import AttentionQuantConfig, Deployment, RecipeConfig, W8A8DynamicConfig
from sdkiln.export import export_ascend
from sdkiln.kernels.ops.quantized_attention import hadamard
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.attention.quantized import PLAN_FILE

from . import mindie_emulation as mindie
from .ascend_rules import read_ascend_dir

FA_MIN_SQNR_DB = 20.0
STEPS = 4


def _package(tmp_path, qk: str):
    # a low floor, so that layers pass at every step: the check is of the export, not of the floor
    config = AttentionQuantConfig(qk=qk, pv="fp8", sqnr_floor_db=20.0, psnr_floor_db=20.0, calib_samples=1)
    recipe = RecipeConfig(f"attn-{qk}", [W8A8DynamicConfig(), config], Deployment(num_inference_steps=STEPS))
    path = tmp_path / qk
    sdkiln.optimize("fmnist-flux", recipe, path, eval_samples=0)
    return path, json.loads((path / PLAN_FILE).read_text())


def test_an_fp8_plan_exports_as_mindie_fa_quantization_and_matches_per_layer(tmp_path, monkeypatch):
    path, plan = _package(tmp_path, "fp8")
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
    seen, real = {}, K.quantized_attention

    def capture(q, k, v, mask, scale, qk, pv, rotate):
        import inspect

        call = inspect.currentframe().f_back.f_locals["call"]
        seen.setdefault(call.name, (q, k, v, rotate))
        return real(q, k, v, mask, scale, qk, pv, rotate)

    monkeypatch.setattr(K, "quantized_attention", capture)
    pipe = sdkiln.load(path, device="cpu")
    pipe(prompt="a sneaker", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0))
    assert every <= set(seen)
    for name in sorted(every):
        q, k, v, rotate = seen[name]
        q, k, v = q[:1], k[:1], v[:1]  # MindIE SD's block quantization takes one batch row
        ours, _ = real(q, k, v, None, None, "fp8", "fp8", rotate)
        ref, _ = K.attention(q, k, v)
        rot = view.fa_layers[name][0]
        theirs = mindie.mindie_fa(q, k, v, rot, view.fa_layers[name][1], out_dtype=torch.bfloat16).float()
        got = {"ours": sqnr_db(ref, ours), "mindie": sqnr_db(ref, theirs), "between": sqnr_db(ours, theirs)}
        print(
            f"{name}: SQNR vs float ours {got['ours']:.1f}, MindIE {got['mindie']:.1f}; between {got['between']:.1f} dB"
        )
        assert min(got.values()) >= FA_MIN_SQNR_DB, (name, got)


def test_an_int8_plan_exports_its_linears_and_says_why_its_attention_stays_float(tmp_path, capsys):
    from sdkiln.cli import main

    path, plan = _package(tmp_path, "int8")
    assert main(["export-ascend", str(path), "--out", str(tmp_path / "ascend")]) == 0
    assert read_ascend_dir(tmp_path / "ascend").fa_layers == {}
    printed = capsys.readouterr().out
    assert f"attention (int8/fp8): 0 of the plan's {len(plan['layers'])} layers" in printed
    assert "MindIE SD quantizes attention in FP8 throughout" in printed
