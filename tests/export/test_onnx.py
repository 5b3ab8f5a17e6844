"""ONNX export (``sdkiln export-onnx``): W8A8_DYNAMIC, W8A8 and float packages of flux-tiny, sd3-tiny
and the embedded model run in onnxruntime and match sdkiln's runtime; quantized graphs hold
QuantizeLinear / DequantizeLinear with int8 weights; the axes are dynamic; what has no ONNX form is
refused before anything is written.

The tolerances are the exporter's own, ``FLOAT_REL`` and ``QUANT_REL`` (their docstrings say why);
the tests check the reported errors and, for another resolution, recompute one.
"""

import json

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.cli import main
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.export.onnx import (
    FLOAT_REL,
    MODEL_FILE,
    QUANT_REL,
    REPORT_FILE,
    _check_package,
    capture_inputs,
    export_onnx,
)
from sdkiln.extras import require

onnx = pytest.importorskip("onnx", reason="the [onnx] extra (make test installs it)")
ort = pytest.importorskip("onnxruntime", reason="the [onnx] extra (make test installs it)")

FAST = [("flux-tiny", "w8a8-dynamic")]  # and sd3-tiny w8a8-static below; flux-tiny at opset 23 is slow
SLOW = [
    (model, recipe)
    for model in ("flux-tiny", "sd3-tiny", None)
    for recipe in ("w8a8-dynamic", "w8a8-static", "none")
    if (model, recipe) not in FAST and (model, recipe) != ("sd3-tiny", "w8a8-static")
]  # the embedded model's float export among them (54 s on 2 cores: the CI budget)


def _export(tmp_path, model, recipe, opset):
    result = sdkiln.optimize(model, recipe, tmp_path / "pkg", eval_samples=0)
    out = tmp_path / "onnx"
    extra = [] if opset is None else ["--opset", str(opset)]
    assert main(["export-onnx", str(result.package), "--out", str(out), *extra]) == 0
    return result, out, json.loads((out / REPORT_FILE).read_text())


def _check(tmp_path, model, recipe, opset=None):
    result, out, report = _export(tmp_path, model, recipe, opset)
    layers = len(result.manifest["modules"])
    bound = QUANT_REL if layers else FLOAT_REL
    assert report["max_rel_error"] <= bound, report
    assert report["max_rel_error_batch1"] <= bound, report
    graph = onnx.load(str(out / MODEL_FILE)).graph
    ops = [n.op_type for n in graph.node]
    int8_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    if layers:
        # every quantized layer's weight is an int8 initializer read by its own DequantizeLinear;
        # activations are quantized once per distinct input (to_q, to_k and to_v share one)
        names = {i.name for i in int8_weights}
        weight_dq = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in names]
        assert len(int8_weights) == layers and len(weight_dq) == layers
        quantize = [n for n in graph.node if n.op_type == "QuantizeLinear"]
        assert 0 < len(quantize) <= layers
        (scheme,) = set(m["scheme"] for m in result.manifest["modules"].values())
        per_token = [n for n in quantize if any(a.name == "block_size" and a.i > 0 for a in n.attribute)]
        assert len(per_token) == (len(quantize) if scheme == "W8A8_DYNAMIC" else 0)
        assert report["opset"] == (opset or 21)
    else:
        assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops and not int8_weights
        assert report["opset"] == (opset or 18)
    # the batch axis of every input but the token ids is dynamic
    for name, axes in report["inputs"].items():
        if not name.endswith("_ids"):
            assert isinstance(axes[0], str), (name, axes)
    return result, out


@pytest.mark.parametrize("model,recipe", FAST)
def test_export_runs_in_onnxruntime_and_matches_the_runtime(tmp_path, model, recipe):
    _check(tmp_path, model, recipe)


@pytest.mark.slow
@pytest.mark.parametrize("model,recipe", SLOW)  # the rest of the 3 x 3 matrix
def test_export_matrix(tmp_path, model, recipe):
    _check(tmp_path, model, recipe)


def test_external_data_and_a_check_above_its_bound(tmp_path, monkeypatch):
    """sd3-tiny w8a8-static with its weights in external data (the >2 GB path, forced), then the
    same export again with a bound it cannot meet: refused, and the first export is kept whole."""
    from sdkiln.export import onnx as onnx_module

    monkeypatch.setattr(onnx_module, "EXTERNAL_DATA_BYTES", 0)
    result, out = _check(tmp_path, "sd3-tiny", "w8a8-static")
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["external_data"] and (out / f"{MODEL_FILE}.data").stat().st_size > 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(onnx_module, "QUANT_REL", 0.0)
    with pytest.raises(SdkilnError, match="above the bound 0; nothing was written"):
        export_onnx(result.package, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow  # 44 s on 2 cores; the default opset's export runs in make test
def test_opset_23_and_the_token_axis(tmp_path):
    """At opset 23 the exporter emits ONNX's own Attention and RMSNormalization, which onnxruntime
    runs; the export, run at another resolution than it was traced at, still matches."""
    result, out = _check(tmp_path, "flux-tiny", "w8a8-dynamic", opset=23)
    ops = {n.op_type for n in onnx.load(str(out / MODEL_FILE)).graph.node}
    assert {"Attention", "RMSNormalization"} <= ops
    pipe = sdkiln.load(result.package, "cpu")
    inputs = capture_inputs(pipe, 64, 48)
    traced = json.loads((out / REPORT_FILE).read_text())["inputs"]["hidden_states"]
    assert inputs["hidden_states"].shape[1] != 16 and isinstance(traced[1], str)
    with torch.inference_mode():
        ours = pipe.transformer(**inputs, return_dict=False)[0]
    session = ort.InferenceSession(str(out / MODEL_FILE), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    assert float(np.abs(theirs - ours.numpy()).max() / ours.abs().max()) <= QUANT_REL


def test_refusals_write_nothing(tmp_path):
    result = sdkiln.optimize("flux-tiny", "w8a8-dynamic", tmp_path / "pkg", eval_samples=0)
    out = tmp_path / "onnx"
    with pytest.raises(SdkilnError, match="opset 21"):
        export_onnx(result.package, out, opset=18)
    assert not out.exists()
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(PackageError, match="already exists"):
        export_onnx(result.package, out)
    with pytest.raises(PackageError, match="not an sdkiln ONNX export"):
        export_onnx(result.package, out, force=True)
    assert (out / "mine.txt").read_text() == "keep"
    with pytest.raises(SdkilnError, match="block-sparse"):
        _check_package({"sparse_attention": {"file": "x"}, "modules": {}})
    with pytest.raises(SdkilnError, match="3 W4A16"):
        _check_package({"modules": {f"l{i}": {"scheme": "W4A16"} for i in range(3)}})


def test_a_missing_extra_names_it():
    with pytest.raises(SdkilnError, match=r"pip install 'sdkiln\[onnx\]'"):
        require("onnx", "no_such_module_sdkiln", extra="onnx", what="ONNX export")
