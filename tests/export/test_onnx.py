"""ONNX export (``sdkiln export-onnx``): W8A8_DYNAMIC, W8A8 and float packages of flux-tiny, sd3-tiny
and the embedded model run in onnxruntime and match sdkiln's runtime; quantized graphs hold
QuantizeLinear / DequantizeLinear with int8 weights; the axes are dynamic; what has no ONNX form is
refused before anything is written.

Tolerances, as max |onnxruntime - runtime| / max |runtime| of the transformer's output:
``FLOAT_REL`` for float packages (the same float ops in another order) and ``QUANT_REL`` for
quantized ones: the runtime's int8 product is exact in int32 while the QDQ graph multiplies
dequantized fp32 values, and QuantizeLinear adds a static zero point after rounding where sdkiln
adds it before, so a token on a rounding tie moves by one int8 step (measured: 3e-4 to 6e-3).
"""

import json

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.cli import main
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.export.onnx import MODEL_FILE, REPORT_FILE, _check_package, capture_inputs, export_onnx
from sdkiln.extras import require

onnx = pytest.importorskip("onnx", reason="the [onnx] extra (make test installs it)")
ort = pytest.importorskip("onnxruntime", reason="the [onnx] extra (make test installs it)")

FLOAT_REL = 1e-5
QUANT_REL = 1e-2
FAST = [("flux-tiny", "w8a8-dynamic"), ("sd3-tiny", "w8a8-static"), (None, "none")]
SLOW = [
    (model, recipe)
    for model in ("flux-tiny", "sd3-tiny", None)
    for recipe in ("w8a8-dynamic", "w8a8-static", "none")
    if (model, recipe) not in FAST
]


def _export(tmp_path, model, recipe):
    result = sdkiln.optimize(model, recipe, tmp_path / "pkg", eval_samples=0)
    out = tmp_path / "onnx"
    assert main(["export-onnx", str(result.package), "--out", str(out)]) == 0
    return result, out, json.loads((out / REPORT_FILE).read_text())


def _check(tmp_path, model, recipe):
    result, out, report = _export(tmp_path, model, recipe)
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
        assert report["opset"] == 21
    else:
        assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops and not int8_weights
        assert report["opset"] == 18
    # the batch axis of every input but the token ids is dynamic
    for name, axes in report["inputs"].items():
        if not name.endswith("_ids"):
            assert isinstance(axes[0], str), (name, axes)
    return result, out


@pytest.mark.parametrize("model,recipe", FAST)
def test_export_runs_in_onnxruntime_and_matches_the_runtime(tmp_path, model, recipe):
    _check(tmp_path, model, recipe)


@pytest.mark.slow
@pytest.mark.parametrize("model,recipe", SLOW)
def test_export_matrix(tmp_path, model, recipe):
    _check(tmp_path, model, recipe)


def test_token_axis_is_dynamic(tmp_path):
    """The flux-tiny export, run at another resolution than it was traced at, still matches."""
    result, out = _check(tmp_path, "flux-tiny", "w8a8-dynamic")
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
