"""bench/quant.py's core on flux-tiny: 2 samples, 2 denoising steps, two methods per run.

Tolerance: a quantized layer against its float layer is compared by SQNR in dB, with the usual
int8 floor of 20 dB (STYLE.md habit 12); JSON must be standard (no NaN or infinity).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import sdkiln
from sdkiln.configs import Deployment, RecipeConfig, SmoothQuantConfig, W8A8StaticConfig
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.evaluate import PSNR_CAP_DB
from sdkiln.optimizer.layers import select_layers
from sdkiln.optimizer.registry import TransformContext

INT8_SQNR_FLOOR_DB = 20.0
_PATH = Path(__file__).resolve().parents[2] / "bench" / "quant.py"
_spec = importlib.util.spec_from_file_location("bench_quant", _PATH)
bench = sys.modules["bench_quant"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _tiny(methods, **kw):
    return bench.run("flux-tiny", methods, num_samples=2, steps=2, sqnr_samples=1, sqnr_stride=1, **kw)


@pytest.fixture(scope="module")
def report():
    return _tiny(("w8a8-static", "w8a8-timestep"))


def test_rows_measure_every_column(report):
    json.dumps(report, allow_nan=False)
    names = report["settings"]["layers"]["quantized"]
    assert report["settings"]["sqnr"]["steps"] == [0, 1]
    for row in report["methods"]:
        assert row["status"] == "ok", row
        assert row["quantized_layers"] == len(names)
        assert set(row["sqnr_per_layer_db"]) == set(names)
        assert row["sqnr_min_db"] > INT8_SQNR_FLOOR_DB, row["sqnr_worst_layer"]
        assert row["sqnr_min_db"] <= row["sqnr_median_db"]
        assert row["transformer_bytes"] < report["float"]["transformer_bytes"]
        assert 0 < row["psnr_min"] <= row["psnr"] <= PSNR_CAP_DB
        assert row["seconds_per_batch"] > 0
    timestep = report["methods"][1]
    assert timestep["applied"]["schemes"] == ["W8A8_TIMESTEP"]
    assert timestep["applied"]["recipe"]["deployment"]["num_inference_steps"] == 2


def test_acceptance_line_is_computed_from_the_rows(report):
    lines = {a["line"]: a for a in report["acceptance"]}
    line = lines["w8a8-timestep PSNR >= w8a8-static PSNR + 1 dB"]
    diff = report["methods"][1]["psnr"] - report["methods"][0]["psnr"]
    assert line["value"] == f"{diff:+.2f} dB"
    assert line["result"] == ("pass" if diff >= 1.0 else "FAIL")
    low, high = line["paired_ci95_db"]
    assert low <= round(diff, 3) <= high
    # flux-tiny has no class metric: those lines say so instead of passing
    assert lines["w4a16 keeps class accuracy within 5 points of float"]["result"] == "not measured"


def test_acceptance_accuracy_drop_in_points():
    ref = {"class_accuracy": 0.80}
    rows = [
        {"method": "w8a8-dynamic", "status": "ok", "class_accuracy": 0.78},
        {"method": "w8a8-dynamic+smoothquant", "status": "ok", "class_accuracy": 0.81},
        {"method": "w8a8-dynamic-gptq", "status": "ok", "class_accuracy": 0.79},
        {"method": "w8a8-timestep", "status": "ok", "class_accuracy": 0.77},
        {"method": "w4a16", "status": "failed"},
    ]
    result = {
        a["line"].split()[0]: a["result"] for a in bench.acceptance(ref, rows) if "accuracy" in a["line"]
    }
    assert result == {
        "w8a8-dynamic": "pass",
        "w8a8-dynamic+smoothquant": "pass",
        "w8a8-dynamic-gptq": "pass",
        "w8a8-timestep": "FAIL",
        "w4a16": "not measured",
    }


def test_folded_smoothquant_layers_read_their_smoothed_input():
    """A layer whose 1/s was folded into its modulation must be scored on x / s, not x."""
    spec = get_spec("flux-tiny")
    base = spec.build()
    recipe = RecipeConfig(
        "sq",
        [
            SmoothQuantConfig(alphas=(0.5,), calib_samples=1),
            W8A8StaticConfig(calib_samples=1),
        ],
        Deployment(num_inference_steps=2),
    )
    result = sdkiln.optimize(base, recipe, eval_samples=0)
    folded = result.manifest["recipe"]["steps"][0]["result"]["folded"]
    assert folded, "precondition: the smoothquant search folded no layer on flux-tiny"
    call = spec.call_kwargs(num_inference_steps=2)
    names = [t.layer for t in select_layers(TransformContext(base, spec, None))[0]]
    captured = bench.capture_layer_inputs(base, spec, names, call, ["a photo of a cat"], [0], stride=1)
    sqnr = bench.layer_sqnr(base.transformer, bench.our_layers(result, spec, 2), captured)
    assert min(sqnr[n] for n in folded) > INT8_SQNR_FLOOR_DB


def test_missing_and_failing_peers_are_recorded(monkeypatch):
    def missing(transformer, names):
        raise ImportError("No module named 'optimum'")

    def broken(transformer, names):
        raise RuntimeError("no CPU kernel")

    monkeypatch.setitem(bench.PEERS, "quanto-qint8-weight-only", missing)
    monkeypatch.setitem(bench.PEERS, "torchao-int8-weight-only", broken)
    rows = {
        r["method"]: r for r in _tiny(("quanto-qint8-weight-only", "torchao-int8-weight-only"))["methods"]
    }
    assert rows["quanto-qint8-weight-only"]["status"] == "not installed"
    assert "pip install optimum-quanto" in rows["quanto-qint8-weight-only"]["error"]
    assert rows["torchao-int8-weight-only"] == {
        "method": "torchao-int8-weight-only",
        "by": "peer",
        "status": "failed",
        "error": "RuntimeError: no CPU kernel",
    }


def test_torchao_peer_on_the_same_layers():
    pytest.importorskip("torchao", reason="torchao is not in the test extra; `make bench-quant` installs it")
    report = _tiny(("w8a8-dynamic", "torchao-int8-dynamic"))
    ours, theirs = report["methods"]
    assert theirs["status"] == "ok", theirs
    assert theirs["quantized_layers"] == ours["quantized_layers"]
    assert theirs["sqnr_min_db"] > INT8_SQNR_FLOOR_DB
    # the int8 subclass is counted by its int8 data and scales, well under the float bytes it wraps
    float_bytes = report["float"]["transformer_bytes"]
    assert theirs["transformer_bytes"] < float_bytes
    assert abs(theirs["transformer_bytes"] - ours["transformer_bytes"]) < 0.02 * float_bytes
    line = next(a for a in report["acceptance"] if "torchao" in a["line"])
    assert line["result"] in ("pass", "FAIL")
