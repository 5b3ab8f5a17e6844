"""bench/cache.py's core on the embedded model: 2 samples, 4 denoising steps, one knob per method.

Tolerance: block-evaluation counts are integers and compared exactly; so is a schedule's measured
ratio against ``CacheSchedule.block_evaluations_ratio()``. JSON must be standard (no NaN or infinity).
"""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from sdkiln.optimizer.cache.search import fixed_interval

_PATH = Path(__file__).resolve().parents[2] / "bench" / "cache.py"
_spec = importlib.util.spec_from_file_location("bench_cache", _PATH)
bench = sys.modules["bench_cache"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

STEPS = 4
OURS = ["full", "skip", "partial:1:1", "full"]
"""A known schedule run as ours: (6 + 0 + 2 + 6) of 24 block evaluations."""
FIXED = [str(a) for a in fixed_interval(STEPS, 1, 2)]


def _tiny(methods, knobs, **kw):
    return bench.run(
        "fmnist-flux",
        methods,
        num_samples=2,
        steps=(STEPS,),
        batch_size=2,
        calib_samples=1,
        timing_repeats=0,
        knobs=knobs,
        **kw,
    )


@pytest.fixture(scope="module")
def report():
    return _tiny(
        ("sdkiln-cache-auto", "fixed-interval", "diffusers-fbc", "diffusers-magcache"),
        {
            "sdkiln-cache-auto": [{"point": 0, "actions": OURS}],
            "fixed-interval": [{"first": 1, "every": 2, "actions": FIXED}],
            "diffusers-fbc": [{"threshold": 0.3}],
            "diffusers-magcache": [{"threshold": 0.5}],
        },
    )


def _rows(report):
    return {r["method"]: r for r in report["methods"]}


def test_uncached_count_is_blocks_x_steps_x_calls(report):
    json.dumps(report, allow_nan=False)
    ref = report["steps"][str(STEPS)]["uncached"]
    assert ref["num_blocks"] == 6  # 2 double-stream + 4 single-stream blocks
    assert ref["transformer_calls"] == 2 * STEPS  # one batch, one call per CFG branch
    assert ref["block_evaluations"] == 6 * 2 * STEPS
    assert ref["block_rows"] == 6 * 2 * STEPS * 2  # 2 calls of 2 samples per step
    assert ref["attention_rows"] == ref["block_rows"]


def test_a_schedule_counts_exactly_its_block_evaluations(report):
    rows = _rows(report)
    ours, fixed = rows["sdkiln-cache-auto"], rows["fixed-interval"]
    assert ours["schedule_block_evaluations_ratio"] == 14 / 24
    assert fixed["schedule_block_evaluations_ratio"] == 18 / 24  # full, skip, full, full
    for row in (ours, fixed):
        assert row["status"] == "ok", row
        assert row["block_evaluations_ratio"] == row["schedule_block_evaluations_ratio"]
        assert row["attention_evaluations_ratio"] == row["block_evaluations_ratio"]
        assert row["actions"] in (OURS, FIXED)


def test_every_row_is_measured_and_scored(report):
    for row in report["methods"]:
        assert row["status"] in ("ok", "no reuse"), row
        assert row["steps"] == STEPS
        assert 0 < row["block_evaluations_ratio"] <= 1
        assert 0 < row["psnr_min"] <= row["psnr"] <= bench.PSNR_CAP_DB
        assert 0 <= row["class_accuracy"] <= 1
        assert row["seconds"] > 0 and row["wall_speedup"] > 0
    assert "class_accuracy" in report["steps"][str(STEPS)]["uncached"]


def test_magcache_ratios_come_from_its_calibration_log(report):
    calibration = report["steps"][str(STEPS)]["magcache_calibration"]
    assert len(calibration["mag_ratios"]) == STEPS
    assert calibration["mag_ratios"][0] == 1.0  # MagCache's neutral first entry
    assert calibration["seeds"] == [0]  # the calibration loop's seeds, not the held-out ones


def test_lines_without_their_inputs_say_not_measured(report):
    budget, target, speedup = report["acceptance"]
    assert budget["line"].startswith(f"{STEPS} steps: at every block-evaluation budget")
    assert budget["result"] in ("pass", "FAIL")  # ours and two block-level peers were measured
    assert target["line"].startswith("28 steps: ours <= 0.40x")
    assert target["result"] == "not measured"  # no 28-step run here
    assert speedup["line"].startswith("wall-clock speedup")
    assert speedup["result"] == "not measured"  # timing_repeats=0


def test_markdown_and_chart(report, tmp_path):
    text = bench.markdown(report)
    assert "| sdkiln-cache-auto | point=0 |" in text
    assert "**not measured**" in text
    pytest.importorskip("matplotlib", reason="matplotlib is in the bench extra")
    path = bench.chart(report, tmp_path / "cache.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(method, by, ratio, psnr, reuses="blocks", **extra):
    return {"method": method, "by": by, "reuses": reuses, "steps": 28, "status": "ok", "knob": {}} | {
        "block_evaluations_ratio": ratio,
        "psnr": psnr,
        **extra,
    }


def test_budget_line_compares_points_within_the_tolerance():
    ours = [_row("sdkiln-cache-auto", "sdkiln", 0.40, 31.0), _row("sdkiln-cache-auto", "sdkiln", 0.60, 35.0)]
    below = _row("diffusers-fbc", "diffusers", 0.39, 30.5)  # ours at 0.40 is within 5% above it
    cheaper = _row("diffusers-fbc", "diffusers", 0.20, 20.0)  # no point of ours that cheap
    attention = _row("diffusers-pab", "diffusers", 1.0, 45.0, reuses="attention")
    line = bench._budget_line(28, [*ours, below, cheaper, attention])
    assert line["result"] == "pass"
    assert "1 peer points compared" in line["value"] and "1 peer points cheaper" in line["value"]
    assert "diffusers-pab" in line["value"]
    above = _row("cache-dit-dbcache", "cache-dit", 0.58, 35.5)
    line = bench._budget_line(28, [*ours, below, above])
    assert line["result"] == "FAIL" and "worst margin -0.50 dB (cache-dit-dbcache" in line["value"]
    assert bench._budget_line(28, ours)["result"] == "not measured"


def test_target_line_needs_every_condition():
    per_steps = {"28": {"uncached": {"class_accuracy": 0.90}}}
    good = _row("sdkiln-cache-auto", "sdkiln", 0.39, 30.5, psnr_p5=26.0, class_accuracy=0.90)
    assert bench._target_line(per_steps, [good])["result"] == "pass"
    accuracy = good | {"class_accuracy": 0.875}  # 2.5 points below uncached
    assert bench._target_line(per_steps, [accuracy])["result"] == "FAIL"
    p5 = good | {"psnr_p5": 24.0}
    assert bench._target_line(per_steps, [p5])["result"] == "FAIL"
    assert bench._target_line({}, [good])["result"] == "not measured"


def test_failing_and_missing_peers_are_recorded(monkeypatch):
    @contextlib.contextmanager
    def broken(b, knob):
        raise RuntimeError("no such hook")
        yield

    @contextlib.contextmanager
    def missing(b, knob):
        raise ImportError("No module named 'cache_dit'")
        yield

    monkeypatch.setitem(bench.METHODS, "diffusers-fbc", bench.Method("diffusers", lambda b: [{}], broken))
    monkeypatch.setitem(
        bench.METHODS,
        "cache-dit-dbcache",
        bench.Method("cache-dit", lambda b: [{}], missing, package="cache-dit"),
    )
    rows = _rows(_tiny(("diffusers-fbc", "cache-dit-dbcache"), None))
    assert rows["diffusers-fbc"]["status"] == "failed"
    assert rows["diffusers-fbc"]["error"] == "RuntimeError: no such hook"
    assert rows["cache-dit-dbcache"]["status"] == "not installed"
    assert "pip install cache-dit" in rows["cache-dit-dbcache"]["error"]


def test_peer_rows_can_be_reused_from_a_run_of_the_same_plan(report, tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(report))
    ours_only = {"sdkiln-cache-auto": [{"point": 0, "actions": OURS}]}
    again = _tiny(("sdkiln-cache-auto",), ours_only, peers_from=earlier)
    reused = [r for r in again["methods"] if r.get("reused_from")]
    assert sorted(r["method"] for r in reused) == ["diffusers-fbc", "diffusers-magcache", "fixed-interval"]
    (ours,) = [r for r in again["methods"] if r["by"] == "sdkiln"]  # measured again here, not reused
    assert "reused_from" not in ours and ours["psnr"] == _rows(report)["sdkiln-cache-auto"]["psnr"]
    assert (
        again["steps"][str(STEPS)]["magcache_calibration"]
        == report["steps"][str(STEPS)]["magcache_calibration"]
    )
    other = json.loads(earlier.read_text())
    other["settings"]["seeds"] = "1..2"
    earlier.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="not a run of this benchmark's plan: seeds"):
        _tiny(("sdkiln-cache-auto",), ours_only, peers_from=earlier)
