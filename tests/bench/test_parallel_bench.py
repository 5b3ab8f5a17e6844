"""bench/parallel.py on CPU at its smallest setting, in-process: one model, one 2-rank layout.

What is checked: the JSON is standard and names the device and the thread count; the world-size-1
overhead is the ratio of the medians of the rounds it records (two, alternating which run goes
first), and the hook's cost per call is the difference of two positive timings (its sign is not
asserted: at world size 1 it is within the timer's noise, and a timed assertion fails on a busy
machine); the layout's figures come from a run of both ranks, which raised nothing.
"""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_parallel", Path(__file__).resolve().parents[2] / "bench" / "parallel.py"
)
pbench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pbench)


def test_parallel_bench_reports_the_world_one_overhead_and_a_two_rank_layout(tmp_path):
    out = tmp_path / "parallel.json"
    report = pbench.main(["--quick", "--models", "wan-tiny", "--layouts", "ulysses2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, allow_nan=False))
    assert report["device"]["kind"] == "cpu" and report["device"]["torch_threads"] >= 1
    [row] = report["rows"]
    assert (row["model"], row["steps"]) == ("wan-tiny", 4)
    plain, world1 = row["rounds_ms"]["plain"], row["rounds_ms"]["world1"]
    assert len(plain) == len(world1) == 2 and min(plain + world1) > 0
    assert row["world1_overhead"] == pytest.approx(statistics.median(world1) / statistics.median(plain) - 1)
    hook = report["hook_us_per_call"]
    assert min(hook["bare"], hook["hooked"]) > 0 and hook["overhead"] == hook["hooked"] - hook["bare"]
    layout = row["layouts"]["ulysses2"]
    assert "error" not in layout, layout
    assert layout["speedup"] == pytest.approx(row["plain_ms_per_step"] / layout["ms_per_step"])
