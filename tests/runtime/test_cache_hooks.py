"""Cache schedules at run time: exact when nothing is reused, per-branch state, clean detach."""

import pytest
import torch

from sdkiln.errors import PackageError, StepError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.cache.layout import block_layout, run_sigmas
from sdkiln.runtime.cache import BATCHED, Action, CacheSchedule, attach_cache, cache_runner, detach_cache
from sdkiln.runtime.cache.hooks import BLOCK_HOOK, MODEL_HOOK


def run(pipe, spec, steps=4, **overrides):
    call = {**spec.call_kwargs(num_inference_steps=steps), "output_type": "latent", **overrides}
    with torch.inference_mode():
        return pipe(prompt="a photo of a dog", generator=torch.Generator().manual_seed(0), **call).images


def schedule_for(spec, pipe, actions, branch=BATCHED, steps=4):
    run(pipe, spec, steps=steps)  # the scheduler then holds this step count's sigmas
    acts = [Action.parse(a) for a in actions]
    return CacheSchedule(
        actions={branch: acts} if isinstance(branch, str) else {b: acts for b in branch},
        sigmas=run_sigmas(pipe),
        blocks=block_layout(spec, pipe.transformer),
        fingerprint={"config_hash": "c", "weights_hash": "w"},
    )


def test_all_full_schedule_reproduces_the_uncached_output_exactly(flux_tiny):
    spec, pipe = flux_tiny
    reference = run(pipe, spec)
    runner = attach_cache(pipe, schedule_for(spec, pipe, ["full"] * 4))
    try:
        runner.reset_counters()
        cached = run(pipe, spec)
        assert torch.equal(cached, reference)
        assert runner.transformer_calls == 8  # true CFG: two calls a step
        assert runner.block_evaluations == 8 * runner.num_blocks
    finally:
        detach_cache(pipe.transformer)


def test_skip_and_partial_reuse_the_residual_of_the_last_full_step_per_branch(flux_tiny):
    """At a reused step the span's first block returns its input plus (out - in) of the same span at
    the last full step of the same cache context; the uncond branch never reads the cond branch's."""
    spec, pipe = flux_tiny
    schedule = schedule_for(spec, pipe, ["full", "skip", "partial:1:1", "full"])
    n = sum(b.count for b in schedule.blocks)
    blocks = [getattr(pipe.transformer, b.attr)[i] for b in schedule.blocks for i in range(b.count)]
    runner = attach_cache(pipe, schedule)
    log = []  # (context, step, position, hidden_states in, hidden_states out)

    def hook(position):
        def record(module, args, kwargs, output):
            ctx = pipe.transformer._diffusers_hook.get_hook(MODEL_HOOK).contexts._context
            out = dict(zip(("encoder_hidden_states", "hidden_states"), output, strict=True))
            log.append((ctx.name, runner._step, position, kwargs["hidden_states"], out["hidden_states"]))

        return record

    handles = [b.register_forward_hook(hook(p), with_kwargs=True) for p, b in enumerate(blocks)]
    try:
        runner.reset_counters()
        run(pipe, spec)
    finally:
        for h in handles:
            h.remove()
        detach_cache(pipe.transformer)
    got = {(c, s, p): (i, o) for c, s, p, i, o in log}
    assert {c for c, *_ in log} == {"cond", "uncond"}
    for ctx in ("cond", "uncond"):
        # step 1 skips the whole stack: block 0's output = its input + residual of stack at step 0
        residual = got[(ctx, 0, n - 1)][1] - got[(ctx, 0, 0)][0]
        assert torch.equal(got[(ctx, 1, 0)][1], got[(ctx, 1, 0)][0] + residual)
        assert all(torch.equal(got[(ctx, 1, p)][1], got[(ctx, 1, p)][0]) for p in range(1, n))
        # step 2 computes block 0 and block n-1 and reuses blocks 1..n-2 from step 0
        middle = got[(ctx, 0, n - 2)][1] - got[(ctx, 0, 1)][0]
        assert torch.equal(got[(ctx, 2, 1)][1], got[(ctx, 2, 1)][0] + middle)
    other = got[("uncond", 0, n - 1)][1] - got[("uncond", 0, 0)][0]
    own = got[("cond", 0, n - 1)][1] - got[("cond", 0, 0)][0]
    assert not torch.equal(other, own)  # the two branches' residuals differ, so a mix would show
    # full: 2 steps x n blocks; skip: none; partial:1:1: 2 blocks; per branch
    assert runner.block_evaluations == 2 * (2 * n + 2)
    assert runner.transformer_calls == 8
    assert schedule.block_evaluations_ratio() == pytest.approx((2 * n + 2) / (4 * n))


def test_batched_cfg_pipeline_runs_a_schedule_and_frees_its_buffers():
    spec = get_spec("sd3-tiny")  # SD3 batches both CFG branches into one call per step
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    reference = run(pipe, spec)
    runner = attach_cache(pipe, schedule_for(spec, pipe, ["full", "skip", "skip", "full"]))
    try:
        runner.reset_counters()
        cached = run(pipe, spec)
        assert cached.shape == reference.shape and not torch.equal(cached, reference)
        assert runner.transformer_calls == 4
        assert runner.block_evaluations == 2 * runner.num_blocks
        hook = pipe.transformer._diffusers_hook.get_hook(MODEL_HOOK)
        assert list(hook.plain) == [BATCHED]
        assert hook.plain[BATCHED].residuals == {}  # freed after the last step
    finally:
        detach_cache(pipe.transformer)


def test_detach_removes_every_hook_and_restores_the_uncached_output(flux_tiny):
    spec, pipe = flux_tiny
    reference = run(pipe, spec)
    attach_cache(pipe, schedule_for(spec, pipe, ["full", "skip", "skip", "full"]))
    with pytest.raises(StepError, match="already follows"):
        attach_cache(pipe, schedule_for(spec, pipe, ["full"] * 4))
    detach_cache(pipe.transformer)
    assert cache_runner(pipe.transformer) is None
    for module in pipe.transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None:
            assert registry.get_hook(MODEL_HOOK) is None and registry.get_hook(BLOCK_HOOK) is None
    assert torch.equal(run(pipe, spec), reference)


def test_schedule_maps_by_sigma_to_fewer_steps_and_refuses_ambiguity(flux_tiny):
    spec, pipe = flux_tiny
    schedule = schedule_for(spec, pipe, ["full", "skip", "full", "skip", "skip", "full"], steps=6)
    run(pipe, spec, steps=3)
    mapped = schedule.for_sigmas(run_sigmas(pipe))
    assert mapped.num_steps == 3
    assert [str(a) for a in mapped.actions[BATCHED]] == ["full", "full", "full"]  # ends forced full
    sigmas = schedule.sigmas
    picked = schedule.for_sigmas([sigmas[0], sigmas[3], sigmas[4], sigmas[5]])
    assert [str(a) for a in picked.actions[BATCHED]] == ["full", "skip", "skip", "full"]
    assert schedule.for_sigmas(sigmas) is schedule
    with pytest.raises(ValueError, match="equally near"):
        schedule.for_sigmas([sigmas[0], (sigmas[1] + sigmas[2]) / 2, sigmas[5]])
    with pytest.raises(ValueError, match="outside"):
        schedule.for_sigmas([sigmas[0] + 1.0, sigmas[5]])
    with pytest.raises(ValueError, match="optimize again"):
        schedule.for_sigmas(sigmas + [sigmas[-1] / 2])
    # at run time, another step count is mapped through the scheduler's sigmas
    runner = attach_cache(pipe, schedule)
    try:
        run(pipe, spec, steps=3)
        assert runner.transformer_calls == 6
    finally:
        detach_cache(pipe.transformer)


def test_schedule_json_round_trip_validation_and_fingerprint(flux_tiny):
    spec, pipe = flux_tiny
    schedule = schedule_for(spec, pipe, ["full", "full", "skip~", "full"])
    again = CacheSchedule.from_json(schedule.to_json())
    assert again.to_dict() == schedule.to_dict()
    schedule.check_fingerprint({"config_hash": "c", "weights_hash": "w"})
    with pytest.raises(PackageError, match="another model"):
        schedule.check_fingerprint({"config_hash": "c", "weights_hash": "other"})
    bad = schedule.to_dict() | {"format_version": 2}
    with pytest.raises(PackageError, match="format version 2"):
        CacheSchedule.from_dict(bad)
    for actions, message in [
        (["skip", "full", "full", "full"], "first and the last"),
        (["full", "skip~", "full", "full"], "extrapolates"),
        (["full", f"partial:2:{schedule.num_blocks - 2}", "full", "full"], "no middle block"),
    ]:
        with pytest.raises(ValueError, match=message):
            schedule_for(spec, pipe, actions)
    with pytest.raises(ValueError, match="unknown cache action"):
        Action.parse("sometimes")
