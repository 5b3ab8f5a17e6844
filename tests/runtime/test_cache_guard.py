"""The cache guard: silent on the inputs it was calibrated on, forcing a compute on an unusual one,
mapped with the schedule, validated on load, and agreed across ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdkiln.errors import PackageError
from sdkiln.optimizer.cache.layout import block_layout, run_sigmas
from sdkiln.runtime.cache import BATCHED, Action, CacheSchedule, attach_cache, detach_cache
from sdkiln.runtime.cache.guard import Guard, agree, calibrate, input_change

STEPS = 6
ACTIONS = ["full", "skip", "skip", "full", "skip~", "full"]
PROMPT = "a photo of a dog"


def run(pipe, spec, callback=None, seed=0):
    call = {**spec.call_kwargs(num_inference_steps=STEPS), "output_type": "latent"}
    if callback is not None:
        call |= {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents"]}
    with torch.inference_mode():
        return pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), **call).images


def schedule_for(spec, pipe, guards=None):
    run(pipe, spec)
    return CacheSchedule(
        actions={BATCHED: [Action.parse(a) for a in ACTIONS]},
        sigmas=run_sigmas(pipe),
        blocks=block_layout(spec, pipe.transformer),
        fingerprint={"config_hash": "c", "weights_hash": "w"},
        guards=guards or {},
    )


def guarded_run(pipe, spec, schedule, guard=None, **kwargs):
    runner = attach_cache(pipe, schedule, guard=guard)
    try:
        out = run(pipe, spec, **kwargs)
        return out, runner
    finally:
        detach_cache(pipe.transformer)


def recorded_thresholds(pipe, spec, margin=1.0):
    recorder = Guard(record=True)
    _, runner = guarded_run(pipe, spec, schedule_for(spec, pipe), recorder)
    reuse_steps = [s for s, a in enumerate(ACTIONS) if a != "full"]
    assert sorted(recorder.values) == sorted((b, s) for b in ("cond", "uncond") for s in reuse_steps)
    assert runner.guard_checks == 0  # recording never decides
    return calibrate(recorder.values, STEPS, quantile=1.0, margin=margin)


def test_input_change_is_per_row_relative_l1():
    ref = torch.tensor([[1.0, -1.0], [2.0, 2.0]])
    cur = torch.tensor([[1.5, -1.0], [2.0, 2.0]])
    assert torch.allclose(input_change(cur, ref), torch.tensor([0.25, 0.0]))


def test_guard_is_silent_on_its_calibration_input_and_changes_nothing(flux_tiny):
    spec, pipe = flux_tiny
    guard = recorded_thresholds(pipe, spec)  # quantile 1, margin 1: the threshold is the largest value seen
    assert guard.thresholds["cond"][0] is None and guard.thresholds["cond"][1] > 0
    plain, _ = guarded_run(pipe, spec, schedule_for(spec, pipe))
    guarded, runner = guarded_run(pipe, spec, schedule_for(spec, pipe, guard.to_dict()))
    assert torch.equal(guarded, plain)
    assert (runner.guard_checks, runner.guard_forced) == (2 * 3, 0)  # 3 reuse steps x 2 CFG branches


def test_guard_forces_a_compute_on_an_unusual_input(flux_tiny):
    spec, pipe = flux_tiny
    guard = recorded_thresholds(pipe, spec, margin=1.5)
    schedule = schedule_for(spec, pipe, guard.to_dict())

    def jolt(pipeline, step, timestep, kwargs):  # after step 0 the latents jump: step 1 sees new input
        if step == 0:
            kwargs["latents"] = kwargs["latents"] * 3.0
        return kwargs

    unguarded, plain = guarded_run(pipe, spec, schedule_for(spec, pipe), callback=jolt)
    guarded, runner = guarded_run(pipe, spec, schedule, callback=jolt)
    assert runner.guard_forced >= 2  # step 1 in both branches
    n = plain.num_blocks
    assert runner.block_evaluations == plain.block_evaluations + runner.guard_forced * n
    assert not torch.equal(guarded, unguarded)

    # a threshold of 0 forces every reuse step: the run is the uncached one, exactly
    zero = {b: [None if t is None else 0.0 for t in ts] for b, ts in guard.thresholds.items()}
    forced, runner = guarded_run(pipe, spec, schedule_for(spec, pipe, Guard(zero, 1.0, 1.0).to_dict()))
    assert torch.equal(forced, run(pipe, spec))
    assert runner.guard_forced == runner.guard_checks == 6 and runner.block_evaluations == 2 * STEPS * n


def test_guard_maps_with_the_schedule_and_is_validated(flux_tiny):
    spec, pipe = flux_tiny
    guard = recorded_thresholds(pipe, spec)
    schedule = schedule_for(spec, pipe, guard.to_dict())
    assert Guard.from_dict({}) is None
    back = CacheSchedule.from_json(schedule.to_json())
    assert Guard.from_dict(back.guards).thresholds == guard.thresholds

    mapped = schedule.for_sigmas(schedule.sigmas[::2] + [schedule.sigmas[-1]])
    thresholds = mapped.guards["thresholds"]["cond"]
    assert len(thresholds) == mapped.num_steps and thresholds[0] is None and thresholds[-1] is None
    for i, a in enumerate(mapped.actions[BATCHED]):
        assert (thresholds[i] is None) == (a.kind == "full")

    for bad, match in (
        (guard.to_dict() | {"indicator": "vibes"}, "indicator"),
        (guard.to_dict() | {"thresholds": {"cond": [None] * (STEPS - 1)}}, "thresholds for"),
        (guard.to_dict() | {"thresholds": {"cond": [None, -1.0] + [None] * (STEPS - 2)}}, ">= 0"),
    ):
        data = schedule.to_dict() | {"guards": bad}
        with pytest.raises(PackageError, match=match):
            CacheSchedule.from_dict(data)


def _rank(rank: int, world: int, path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        results[rank] = (agree(rank == 1, torch.device("cpu")), agree(False, torch.device("cpu")))
    finally:
        dist.destroy_process_group()


def test_guard_decision_is_agreed_across_ranks(tmp_path):
    assert agree(True, torch.device("cpu")) and not agree(False, torch.device("cpu"))  # no process group
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
        assert dict(results) == {0: (True, False), 1: (True, False)}  # rank 1 forcing forces rank 0 too
