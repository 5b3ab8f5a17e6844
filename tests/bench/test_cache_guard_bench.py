"""bench/cache_guard.py's core on the embedded model at a smoke size: 2 samples (one batch), 6 steps,
a small search.

Block-evaluation counts are integers: the unguarded run's ratio is the schedule's own, the guard
checks once per planned reuse step, and a forced step adds the blocks its action would have skipped.
JSON must be standard (no NaN or infinity).
"""

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "cache_guard.py"
_spec = importlib.util.spec_from_file_location("bench_cache_guard", _PATH)
bench = sys.modules["bench_cache_guard"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

STEPS, BLOCKS = 6, 6  # fmnist-flux: 2 double-stream + 4 single-stream blocks


def blocks(action: str) -> int:
    if action == "full":
        return BLOCKS
    if action.startswith("partial"):
        _, first, last = action.split(":")
        return int(first) + int(last)
    return 0


def test_guard_bench_reports_every_condition_and_counts_exactly():
    search = {"calib_samples": 1, "eval_samples": 1, "budgets": 4, "refine": 0}
    report = bench.run(2, STEPS, 20_000, [8.0], 2, search=search)
    json.dumps(report, allow_nan=False)
    rows = report["rows"]
    assert [(r["condition"], r["variant"]) for r in rows] == [
        (c, v) for c in ("usual", "guidance=8", "other prompts") for v in ("schedule", "schedule+guard")
    ]
    (actions,) = report["schedule"]["actions"].values()  # one list serves both CFG branches
    reuse = [a for a in actions if a != "full"]
    thresholds = report["schedule"]["guards"]["thresholds"]
    assert sorted(thresholds) == ["cond", "uncond"]  # fmnist-flux calls the transformer once per branch
    for branch in thresholds.values():
        assert [t is not None for t in branch] == [a != "full" for a in actions]
    planned = sum(blocks(a) for a in actions) / (STEPS * BLOCKS)
    most_extra = max((BLOCKS - blocks(a) for a in reuse), default=0) / (STEPS * BLOCKS)
    for plain, guarded in zip(rows[::2], rows[1::2], strict=True):
        assert plain["block_evaluations_ratio"] == planned
        assert plain["guard_checks"] == 0 and plain["guard_forced"] == 0
        assert guarded["guard_checks"] == 2 * len(reuse)  # one check per branch
        extra = guarded["block_evaluations_ratio"] - planned
        assert (extra > 0) == (guarded["guard_forced"] > 0)
        assert extra <= guarded["guard_forced"] * most_extra + 1e-12
        for r in (plain, guarded):
            assert 0 < r["psnr_p5"] <= r["psnr"] <= bench.PSNR_CAP_DB
