"""cache_auto: segment measurements, the DP, the package file, and the loaded package following it."""

import json
import math
import re

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.calibrate.cache_profile import HEATMAP_FILE, PROFILE_FILE
from sdkiln.calibrate.trajectories import Trajectories
from sdkiln.cli import main
from sdkiln.configs import CacheAutoConfig, Deployment, RecipeConfig
from sdkiln.errors import PackageError
from sdkiln.export.summary import summarize
from sdkiln.optimizer.cache.plan import ErrorModel, Segment, fill_gaps
from sdkiln.optimizer.cache.search import confirmation_bound, fixed_interval, pareto
from sdkiln.optimizer.evaluate import compare, generate
from sdkiln.runtime.cache import FULL, SCHEDULE_FILE, Action, cache_runner
from sdkiln.runtime.cache import restore as cache_restore
from sdkiln.runtime.package import open_package

STEPS = 6


def test_partial_runs_replay_the_reference_exactly(flux_tiny):
    spec, pipe = flux_tiny
    traj = Trajectories(
        pipe,
        spec,
        ["a photo of a dog", "a photo of a cat"],
        [0, 1],
        spec.call_kwargs(num_inference_steps=STEPS),
    )
    reference = traj.reference()
    assert len(reference) == STEPS + 1 and reference[0] is None
    full = traj.run()
    assert len(full) == STEPS and torch.equal(full[-1], reference[-1])
    part = traj.run(start=3, stop=4)  # steps 0-2 replayed by the stub, 3 and 4 computed
    assert len(part) == 2
    assert torch.equal(part[0], reference[4]) and torch.equal(part[1], reference[5])


def _model(errors, gain=None, steps=STEPS, blocks=4, max_reuse=2, min_full=1):
    model = ErrorModel(steps, blocks, min_full, max_reuse, local=dict(errors))
    model.gain = gain or [1.0] * steps
    return model


SKIP, PART = Action.parse("skip"), Action.parse("partial:1:1")


def test_dp_finds_the_least_predicted_error_within_each_budget():
    segs = [Segment(s, L, a) for s in range(STEPS - 2) for L in (1, 2) for a in (SKIP, PART)]
    model = _model({k: (1.0 if k.start == 0 else 0.01) for k in segs})
    n = model.num_blocks
    assert model.budgets(1) == [3 * n]  # three full steps: full, reuse x2, full, reuse, full
    cheapest = model.solve(3 * n)
    assert cheapest[0] == FULL and cheapest[-1] == FULL and model.cost(cheapest) == 3 * n
    assert all(run <= 2 for run in _non_full_runs(cheapest))
    assert model.solve(3 * n - 1) is None  # nothing within the constraints is cheaper
    assert model.solve(STEPS * n) == [FULL] * STEPS  # enough budget: no error at all
    one_skip = model.solve(5 * n)  # one step may reuse: never right after step 0 (error 1.0)
    assert model.cost(one_skip) <= 5 * n and one_skip[1] == FULL
    assert model.predict(one_skip) == pytest.approx(0.01)
    budgets = model.budgets(4)
    assert budgets[0] == 3 * n and budgets[-1] == STEPS * n and budgets == sorted(budgets)


def test_gain_weights_late_errors_more():
    """Equal local errors everywhere; errors after early steps are damped by the later ones (gain
    0.01), so the one reuse a budget allows lands early."""
    segs = {Segment(s, 1, SKIP): 0.1 for s in range(STEPS - 2)}
    gain = [0.01 if j <= 2 else 1.0 for j in range(STEPS)]
    model = _model(segs, gain, max_reuse=1)
    actions = model.solve(5 * model.num_blocks)
    assert sum(a != FULL for a in actions) == 1 and actions.index(SKIP) in (1, 2)
    assert model.predict(actions) == pytest.approx(0.001)


def test_model_prices_only_what_it_measured():
    model = _model({Segment(0, 2, SKIP): 0.2, Segment(3, 1, PART): 0.05}, gain=[1, 1, 2, 1, 0.5, 1])
    sched = [FULL, SKIP, SKIP, FULL, PART, FULL]
    assert model.segments(sched) == [Segment(0, 2, SKIP), Segment(3, 1, PART)]
    assert model.predict(sched) == pytest.approx(0.2 * 2 + 0.05 * 0.5)
    assert model.predict([FULL, SKIP, PART, FULL, FULL, FULL]) == math.inf  # a run mixing actions
    assert model.predict([FULL, FULL, SKIP, FULL, FULL, FULL]) == math.inf  # never measured
    assert model.cost(sched) == 4 * 3 + 2 * 1
    extrap = Action.parse("skip~")
    assert not model.allowed([FULL, extrap, FULL, FULL, FULL, FULL])  # one full step before it
    assert model.allowed([FULL, FULL, extrap, FULL, FULL, FULL])
    assert not model.allowed([FULL, SKIP, SKIP, SKIP, FULL, FULL])  # max_reuse 2
    assert fill_gaps({2: 5.0, 4: 7.0}, 6) == [5.0, 5.0, 5.0, 5.0, 7.0, 7.0]


def test_cheaper_neighbours_are_cheaper_allowed_and_ranked_by_prediction():
    segs = [Segment(s, L, a) for s in range(STEPS - 2) for L in (1, 2) for a in (SKIP, PART)]
    model = _model({k: 0.01 * (1 + k.start) * k.length * (2 if k.action == SKIP else 1) for k in segs})
    start = [FULL, PART, FULL, FULL, FULL, FULL]
    out = model.cheaper_neighbours(start, [SKIP, PART])
    assert out and all(model.allowed(c) and model.cost(c) < model.cost(start) for c in out)
    assert [FULL, SKIP, FULL, FULL, FULL, FULL] in out  # the segment's action made cheaper
    assert [FULL, PART, PART, FULL, FULL, FULL] in out  # a full step joined to the segment
    predicted = [model.predict(c) for c in out]
    assert predicted == sorted(predicted)


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
                calib_samples=2,
                eval_samples=2,
                budgets=4,
                refine=2,
                psnr_floor_db=0.0,
                psnr_p5_floor_db=0.0,
            )
        ],
        deployment=Deployment(num_inference_steps=STEPS),
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
    call = {**spec.call_kwargs(num_inference_steps=STEPS), "output_type": "latent"}
    with torch.inference_mode():
        a = loaded(prompt="a photo of a dog", generator=torch.Generator().manual_seed(5), **call).images
        b = result.pipeline(
            prompt="a photo of a dog", generator=torch.Generator().manual_seed(5), **call
        ).images
    assert torch.equal(a, b)

    summary = summarize(open_package(tmp_path / "pkg"))
    assert summary["cache"]["actions"] == record["actions"] and summary["cache"]["guard"] is None

    report, _, _ = compare(pipe, result.pipeline, spec, 2, spec.call_kwargs(num_inference_steps=STEPS))
    assert report["block_evaluations_ratio"] == pytest.approx(record["block_evaluations_ratio"])

    monkeypatch.setattr(cache_restore, "fingerprint", lambda t: {"config_hash": "x", "weights_hash": "y"})
    with pytest.raises(PackageError, match="another model"):
        sdkiln.load(tmp_path / "pkg", device="cpu")


def test_fixed_interval_baseline():
    acts = [str(a) for a in fixed_interval(10, first=3, every=3)]
    assert acts == ["full"] * 4 + ["skip", "skip", "full", "skip", "skip", "full"]
    # counted back from the last step: 9, 6, 3 after the first three (the TaylorSeer phase)
    acts = [str(a) for a in fixed_interval(11, first=3, every=3, from_end=True)]
    assert acts == ["full"] * 3 + ["skip", "full", "skip", "skip", "full", "skip", "skip", "full"]


def test_pareto_keeps_the_points_nothing_beats():
    pts = [
        {"block_evaluations_ratio": r, "psnr_mean": p}
        for r, p in [(0.3, 20), (0.5, 25), (0.4, 30), (1.0, 100)]
    ]
    assert [(p["block_evaluations_ratio"], p["psnr_mean"]) for p in pareto(pts)] == [
        (0.3, 20),
        (0.4, 30),
        (1.0, 100),
    ]


def test_cache_auto_guard_ships_thresholds_for_the_reuse_steps(flux_tiny, tmp_path, capsys):
    spec, pipe = flux_tiny
    config = CacheAutoConfig(
        calib_samples=2, eval_samples=2, budgets=2, refine=0, guard=True,
        psnr_floor_db=0.0, psnr_p5_floor_db=0.0,
    )  # fmt: skip
    recipe = RecipeConfig(name="guarded", steps=[config], deployment=Deployment(num_inference_steps=STEPS))
    sdkiln.optimize(pipe, recipe, out_dir=tmp_path / "pkg", eval_samples=0)
    data = json.loads((tmp_path / "pkg" / SCHEDULE_FILE).read_text())
    guards, actions = data["guards"], data["actions"]["batched"]
    assert guards["indicator"] == "input_change" and (guards["quantile"], guards["margin"]) == (1.0, 1.5)
    assert set(guards["thresholds"]) == {"cond", "uncond"}  # FLUX's true CFG: one list per branch
    for thresholds in guards["thresholds"].values():
        assert [t is not None for t in thresholds] == [a != "full" for a in actions]
    reuse = sum(a != "full" for a in actions)
    assert data["expected"]["guard"]["checks"] == 2 * reuse  # held-out: one batch, one call per branch
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    runner = cache_runner(loaded.transformer)
    assert runner.guard is not None and runner.guard.thresholds == guards["thresholds"]
    summary = summarize(open_package(tmp_path / "pkg"))["cache"]["guard"]
    assert (
        summary["indicator"] == "input_change" and summary["forced_on_held_out"] == data["expected"]["guard"]
    )
    assert main(["inspect", str(tmp_path / "pkg")]) == 0
    assert f"of {2 * reuse} reuse checks forced" in capsys.readouterr().out


def test_cache_auto_runs_end_to_end_at_most_what_it_announces(flux_tiny, monkeypatch, capsys):
    """Every source of end-to-end runs in one small search (a budget, the fixed-interval family, which
    dominates at 10 steps, all-full, refine, guard, held-out): the runs counted stay within the bound
    the search prints before them. One calibration sample and two held-out ones tell the runs apart."""
    _, pipe = flux_tiny
    runs = []

    def counted(*args, **kwargs):
        runs.append(len(args[2]))
        return generate(*args, **kwargs)

    monkeypatch.setattr("sdkiln.optimizer.cache.search.generate", counted)
    config = CacheAutoConfig(
        calib_samples=1, eval_samples=2, budgets=1, refine=1, max_reuse=4, guard=True,
        psnr_floor_db=0.0, psnr_p5_floor_db=0.0,
    )  # fmt: skip
    recipe = RecipeConfig(name="bounded", steps=[config], deployment=Deployment(num_inference_steps=10))
    result = sdkiln.optimize(pipe, recipe, out_dir=None, eval_samples=0)
    announced = re.search(
        r"up to (\d+) end-to-end runs of 10 steps of the calibration batch .* and up to (\d+) of 2 held-out",
        capsys.readouterr().out,
    )
    assert announced, "the search did not announce its end-to-end runs"
    calibration, held_out = int(announced[1]), int(announced[2])
    assert runs.count(1) <= calibration and runs.count(2) == 2 <= held_out  # floor 0: met at the first try
    confirmed = result.files[SCHEDULE_FILE]["search"]["confirmed"]
    # the calibration batch's runs less the uncached one and the guard's are the confirmations
    tries = 1 + config.held_out_retries  # the guard's calibrations, one per held-out try at most
    assert (
        confirmed == runs.count(1) - 2 and confirmed <= confirmation_bound(config) == calibration - 1 - tries
    )


@pytest.mark.parametrize("mean, se", [(-1.0, 0.0), (0.5, 1.0)], ids=["mean", "mean-less-se"])
def test_a_schedule_that_misses_the_floor_on_held_out_samples_gives_way_to_a_safer_one(
    flux_tiny, monkeypatch, capsys, mean, se
):
    """The first held-out measurement is made to miss the (0 dB) floor, by its mean or by its mean less
    one standard error (``held_out_margin_se``): the search measures the front's next safer schedule
    there and chooses it; ``search.held_out`` keeps both tries."""
    from sdkiln.optimizer.cache.search import EVAL_SEED, Search

    _, pipe = flux_tiny
    real, calls = Search.confirm, []

    def confirm(self, actions, prompts, seeds, *args, **kwargs):
        out = real(self, actions, prompts, seeds, *args, **kwargs)
        if seeds[0] >= EVAL_SEED:
            calls.append([str(a) for a in actions])
            if len(calls) == 1:
                out["psnr_mean"], out["psnr_se"] = mean, se
        return out

    monkeypatch.setattr(Search, "confirm", confirm)
    config = CacheAutoConfig(
        calib_samples=1, eval_samples=2, budgets=3, refine=0, psnr_floor_db=0.0, psnr_p5_floor_db=0.0
    )
    recipe = RecipeConfig(name="held-out", steps=[config], deployment=Deployment(num_inference_steps=STEPS))
    result = sdkiln.optimize(pipe, recipe, out_dir=None, eval_samples=0)
    data = result.files[SCHEDULE_FILE]
    front = data["search"]["front"]
    cheapest = min(front, key=lambda p: p["block_evaluations_ratio"])
    safer = min(
        (p for p in front if p["block_evaluations_ratio"] > cheapest["block_evaluations_ratio"]),
        key=lambda p: p["block_evaluations_ratio"],
    )
    assert calls == [cheapest["actions"], safer["actions"]]
    assert data["actions"]["batched"] == safer["actions"]
    assert [(t["psnr_mean"], t["psnr_se"]) for t in data["search"]["held_out"]][0] == (mean, se)
    assert len(data["search"]["held_out"]) == 2
    printed = capsys.readouterr().out
    assert f"less 1 x its standard error {se:.2f}" in printed
    assert "misses the floor (0 / 0); measuring the front's next safer schedule" in printed


def test_a_narrow_held_out_result_is_measured_again_on_more_samples(flux_tiny, monkeypatch, capsys):
    """The first held-out measurement is made to meet the (0 dB) floor by its mean less one standard
    error but not less two: the same schedule is measured again on ``held_out_extend`` more samples (its
    first ones included), judged on all of them, and the package's ``expected`` names every sample."""
    from sdkiln.optimizer.cache.search import EVAL_SEED, Search

    _, pipe = flux_tiny
    real, calls = Search.confirm, []

    def confirm(self, actions, prompts, seeds, *args, **kwargs):
        out = real(self, actions, prompts, seeds, *args, **kwargs)
        if seeds[0] >= EVAL_SEED:
            calls.append(([str(a) for a in actions], list(seeds)))
            if len(calls) == 1:
                out["psnr_mean"], out["psnr_se"] = 0.5, 0.4
        return out

    monkeypatch.setattr(Search, "confirm", confirm)
    config = CacheAutoConfig(
        calib_samples=1, eval_samples=2, held_out_extend=3, budgets=3, refine=0, psnr_floor_db=0.0,
        psnr_p5_floor_db=0.0,
    )  # fmt: skip
    recipe = RecipeConfig(name="held-out", steps=[config], deployment=Deployment(num_inference_steps=STEPS))
    data = sdkiln.optimize(pipe, recipe, out_dir=None, eval_samples=0).files[SCHEDULE_FILE]
    seeds = [EVAL_SEED + i for i in range(5)]
    assert [c[1] for c in calls] == [seeds[:2], seeds] and calls[0][0] == calls[1][0]
    assert data["actions"]["batched"] == calls[0][0]
    assert [t["samples"] for t in data["search"]["held_out"]] == [5]
    assert data["expected"]["seeds"] == seeds and len(data["expected"]["prompts"]) == 5
    assert "meets the floor narrowly; measuring it on 3 more held-out samples" in capsys.readouterr().out
    with pytest.raises(ValueError, match="held_out_extend"):
        CacheAutoConfig(held_out_extend=-1)


def test_the_held_out_check_asks_the_mean_less_its_standard_error_to_meet_the_floor():
    """Eight samples at 31 dB +- 4 dB (standard error 1.41) meet a 30 dB floor by their mean alone, not
    by the mean less one standard error; the margin is a setting (0: the mean alone)."""
    from sdkiln.optimizer.cache.search import _feasible_held_out

    psnr = np.array([27.0, 35.0] * 4)
    point = {"psnr_mean": 31.0, "psnr_se": float(psnr.std(ddof=1) / np.sqrt(8)), "psnr_p5": 27.0}
    assert point["psnr_se"] == pytest.approx(1.512, abs=1e-3)
    assert not _feasible_held_out(point, CacheAutoConfig())
    assert _feasible_held_out(point, CacheAutoConfig(held_out_margin_se=0.0))
    assert _feasible_held_out(point | {"psnr_mean": 32.6}, CacheAutoConfig())
    with pytest.raises(ValueError, match="held_out_margin_se"):
        CacheAutoConfig(held_out_margin_se=-1.0)
