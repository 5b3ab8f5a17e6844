"""bench/serve.py at its smallest setting: a fast package, two batch settings, 8 requests.

What is checked: the JSON is standard and names the machine; every setting's throughput and latencies
are positive and its calls account for every request; the ratio is to the unbatched setting; with two
images per call allowed and 4 clients at once, calls carried more than one image (batching happened)."""

import importlib.util
import json
from pathlib import Path

import pytest

import sdkiln
from sdkiln.configs import CacheAutoConfig, Deployment, RecipeConfig, W8A8DynamicConfig

pytest.importorskip("fastapi", reason="the serve extra brings fastapi")
pytest.importorskip("httpx", reason="the test extra brings httpx")

_spec = importlib.util.spec_from_file_location(
    "bench_serve", Path(__file__).resolve().parents[2] / "bench" / "serve.py"
)
sbench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbench)


def test_serve_bench_measures_each_batch_setting_against_the_unbatched_one(tmp_path):
    package = tmp_path / "pkg"
    cache = CacheAutoConfig(
        psnr_floor_db=20.0, psnr_p5_floor_db=15.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    recipe = RecipeConfig("serve", [W8A8DynamicConfig(), cache], Deployment(num_inference_steps=4))
    sdkiln.optimize("fmnist-flux", recipe, package, eval_samples=0)
    out = tmp_path / "serve.json"
    args = [
        "--package",
        str(package),
        "--max-batch",
        "1",
        "2",
        "--clients",
        "4",
        "--requests",
        "8",
        "--out",
        str(out),
    ]
    report = sbench.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, allow_nan=False))
    assert report["machine"]["cpu"] and report["requests"] == 8
    one, two = report["rows"]
    for row in (one, two):
        assert min(row["images_per_s"], row["latency_p50_s"], row["latency_p95_s"]) > 0
        assert row["images_per_call"] * row["calls"] == pytest.approx(8)
    assert one["calls"] == 8 and one["throughput_vs_unbatched"] == 1.0
    assert two["throughput_vs_unbatched"] == pytest.approx(two["images_per_s"] / one["images_per_s"])
    assert two["calls"] < 8  # batches of two formed
