"""cache_auto: segment measurements, the DP, the package file, and the loaded package following it."""

import json

import pytest
import torch

import sdkiln
from sdkiln.calibrate.cache_profile import HEATMAP_FILE, PROFILE_FILE
from sdkiln.calibrate.trajectories import Trajectories
from sdkiln.configs import CacheAutoConfig, RecipeConfig
from sdkiln.errors import PackageError
from sdkiln.optimizer.cache_search import Search, Segment, fixed_interval
from sdkiln.optimizer.evaluate import compare
from sdkiln.optimizer.registry import StepContext
from sdkiln.runtime import loader
from sdkiln.runtime.cache import FULL, SCHEDULE_FILE, Action, cache_runner
from sdkiln.runtime.package import open_package
from sdkiln.runtime.summary import summarize

STEPS = 6


def test_partial_runs_replay_the_reference_exactly(flux_tiny):
    spec, pipe = flux_tiny
    traj = Trajectories(pipe, spec, ["a photo of a dog", "a photo of a cat"], [0, 1], STEPS)
    reference = traj.reference()
    assert len(reference) == STEPS + 1 and reference[0] is None
    full = traj.run()
    assert len(full) == STEPS and torch.equal(full[-1], reference[-1])
    part = traj.run(start=3, stop=4)  # steps 0-2 replayed by the stub, 3 and 4 computed
    assert len(part) == 2
    assert torch.equal(part[0], reference[4]) and torch.equal(part[1], reference[5])


def test_dp_picks_the_cheapest_schedule_under_the_error_price(flux_tiny):
    spec, pipe = flux_tiny
    config = CacheAutoConfig(steps=STEPS, calib_samples=2, max_reuse=2)
    search = Search(StepContext(pipe, spec, None), config, ["a", "b"], [0, 1])
    n = search.num_blocks
    skip, part = Action.parse("skip"), Action.parse("partial:1:1")
    search.errors = {Segment(s, L, a): 0.0 for s in range(STEPS - 2) for L in (1, 2) for a in (skip, part)}
    search.errors = {k: (1.0 if k.start == 0 else 0.01) for k in search.errors}
    free = search.solve(lam=1.0)  # error nearly free: skip as much as the constraints allow
    assert free[0] == FULL and free[-1] == FULL
    assert all(run <= 2 for run in _non_full_runs(free))
    assert sum(a != FULL for a in free) == 3  # full, skip, skip, full, skip, full: 6 steps
    strict = search.solve(lam=1e9)  # error priceless: everything full
    assert strict == [FULL] * STEPS
    costly_start = search.solve(lam=float(n) * 10)  # the segment from step 0 costs 10 blocks of error
    assert costly_start[1] == FULL


def _non_full_runs(actions):
    runs, run = [], 0
    for a in actions:
        run = run + 1 if a != FULL else 0
        runs.append(run)
    return runs


def test_cache_auto_writes_a_schedule_the_loaded_package_follows(flux_tiny, tmp_path, monkeypatch):
    spec, pipe = flux_tiny
    recipe = RecipeConfig(
        name="cache-auto",
        steps=[
            CacheAutoConfig(
                steps=STEPS,
                calib_samples=2,
                eval_samples=2,
                lambdas=4,
                psnr_floor_db=0.0,
                psnr_p5_floor_db=0.0,
            )
        ],
    )
    result = sdkiln.optimize(pipe, recipe, out_dir=tmp_path / "pkg", eval_samples=0)
    data = json.loads((tmp_path / "pkg" / SCHEDULE_FILE).read_text())
    record = result.manifest["recipe"]["steps"][0]["result"]
    assert data["actions"]["batched"] == record["actions"]
    assert len(data["sigmas"]) == STEPS and data["fingerprint"]["weights_hash"]
    assert data["expected"]["block_evaluations_ratio"] == pytest.approx(record["block_evaluations_ratio"])
    front = data["search"]["front"]
    assert any(p["actions"] == ["full"] * STEPS for p in front)
    n = sum(b["count"] for b in data["blocks"])
    for point in front:  # the runner counted what the actions say: 2 CFG calls a step, each per its action
        expected = 2 * sum(Action.parse(a).block_evaluations(n) for a in point["actions"])
        assert point["measured_block_evaluations"] == expected
    with_floor_zero = min(front, key=lambda p: p["block_evaluations_ratio"])
    assert record["actions"] == with_floor_zero["actions"]  # a 0 dB floor takes the cheapest point

    prof = json.loads((tmp_path / "pkg" / PROFILE_FILE).read_text())
    assert set(prof["branches"]) == {"call0", "call1"}  # FLUX's true CFG: two calls a step
    rows = prof["branches"]["call0"]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(len(r["blocks"]) == n for r in rows)
    assert "rel_l1" not in rows[0]["blocks"][0] and 0 < rows[1]["blocks"][0]["rel_l1"]
    assert rows[1]["first_block_change"] == rows[1]["blocks"][0]["rel_l1"]
    assert (tmp_path / "pkg" / HEATMAP_FILE).read_bytes().startswith(b"\x89PNG")

    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    assert cache_runner(loaded.transformer) is not None
    call = {**spec.call_kwargs(steps=STEPS), "output_type": "latent"}
    with torch.inference_mode():
        a = loaded(prompt="a photo of a dog", generator=torch.Generator().manual_seed(5), **call).images
        b = result.pipeline(
            prompt="a photo of a dog", generator=torch.Generator().manual_seed(5), **call
        ).images
    assert torch.equal(a, b)

    summary = summarize(open_package(tmp_path / "pkg"))
    assert summary["cache"]["actions"] == record["actions"]

    report, _, _ = compare(pipe, result.pipeline, spec, 2, steps=STEPS)
    assert report["block_evaluations_ratio"] == pytest.approx(record["block_evaluations_ratio"])

    monkeypatch.setattr(loader, "fingerprint", lambda t: {"config_hash": "x", "weights_hash": "y"})
    with pytest.raises(PackageError, match="another model"):
        sdkiln.load(tmp_path / "pkg", device="cpu")


def test_fixed_interval_baseline():
    acts = [str(a) for a in fixed_interval(10, first=3, every=3)]
    assert acts == ["full"] * 4 + ["skip", "skip", "full", "skip", "skip", "full"]
