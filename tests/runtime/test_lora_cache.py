"""A LoRA on a cached package (``sdkiln.runtime.cache.headroom``): while a LoRA changes the model, the
cache runner follows the policy's schedule (``headroom``: the search front's cheapest schedule
``margin_db`` safer; ``keep``; ``off``), and the package's own schedule again once the model is back.

Comparisons are exact (``torch.equal``): the policy only chooses which schedule runs, so a run under it
must equal the same run with that schedule attached by hand, and a run with the LoRA off must equal
the package without a LoRA.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sdkiln.errors import PackageError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.cache.layout import block_layout, run_sigmas
from sdkiln.runtime import lora
from sdkiln.runtime.cache import Action, CacheSchedule, attach_cache, cache_runner, detach_cache

STEPS = 6
PACKAGE = ["full", "skip", "skip", "full", "skip", "full"]
SAFER = ["full", "full", "skip", "full", "full", "full"]
NEARLY = ["full", "skip", "full", "full", "skip", "full"]
FRONT = [  # calibration PSNRs, as the search keeps them
    {"actions": PACKAGE, "block_evaluations_ratio": 0.5, "psnr_mean": 30.0, "psnr_p5": 25.0},
    {"actions": NEARLY, "block_evaluations_ratio": 0.67, "psnr_mean": 32.5, "psnr_p5": 28.5},
    {"actions": SAFER, "block_evaluations_ratio": 0.83, "psnr_mean": 34.0, "psnr_p5": 29.0},
    {"actions": ["full"] * STEPS, "block_evaluations_ratio": 1.0, "psnr_mean": 100.0, "psnr_p5": 100.0},
]
LAYERS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.ff.net.2",
    "single_transformer_blocks.0.proj_out",
]


@pytest.fixture
def pipe():
    spec = get_spec("flux-tiny")
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.sdkiln_spec = spec
    run(pipe)  # the scheduler then holds this step count's sigmas
    return pipe


def run(pipe) -> torch.Tensor:
    call = {**pipe.sdkiln_spec.call_kwargs(num_inference_steps=STEPS), "output_type": "latent"}
    with torch.inference_mode():
        return pipe(prompt="a photo of a dog", generator=torch.Generator().manual_seed(0), **call).images


def schedule(pipe, actions, front=FRONT) -> CacheSchedule:
    return CacheSchedule(
        actions={"batched": [Action.parse(a) for a in actions]},
        sigmas=run_sigmas(pipe),
        blocks=block_layout(pipe.sdkiln_spec, pipe.transformer),
        fingerprint={"config_hash": "c", "weights_hash": "w"},
        search={"front": front} if front is not None else {},
    )


def a_lora(pipe) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {}
    for name in LAYERS:
        layer = pipe.transformer.get_submodule(name)
        state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=g) / 4
        state[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=g) / 2
    return state


def with_schedule(pipe, actions) -> torch.Tensor:
    """A run with ``actions`` attached by hand (the LoRA state as it is), then the package's back."""
    detach_cache(pipe.transformer)
    attach_cache(pipe, schedule(pipe, actions, front=None))
    out = run(pipe)
    detach_cache(pipe.transformer)
    attach_cache(pipe, schedule(pipe, PACKAGE))
    return out


def test_headroom_steps_up_under_a_lora_and_back_without_one(pipe, caplog):
    runner = attach_cache(pipe, schedule(pipe, PACKAGE))
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    plain = run(pipe)
    with caplog.at_level(logging.INFO, logger="sdkiln.load"):
        pipe.load_lora_weights(a_lora(pipe), adapter_name="style")
    assert [str(a) for a in cache_runner(pipe.transformer).active.actions["batched"]] == SAFER
    assert "stepped up while a LoRA is active: 0.50 -> 0.83" in caplog.text
    runner.reset_counters()
    stepped = run(pipe)
    assert runner.block_evaluations == 2 * 5 * runner.num_blocks  # 5 full steps of 6, two CFG calls each
    assert not torch.equal(stepped, plain)
    assert torch.equal(stepped, with_schedule(pipe, SAFER))

    runner = cache_runner(pipe.transformer)  # with_schedule attached a new one: the policy follows it
    pipe.set_adapters("style", 0.0)  # strength 0: the model is the package's
    assert runner.active is runner.schedule
    assert torch.equal(run(pipe), plain)
    pipe.set_adapters("style", 0.8)
    assert [str(a) for a in runner.active.actions["batched"]] == SAFER
    pipe.disable_lora()
    assert runner.active is runner.schedule
    assert torch.equal(run(pipe), plain)
    pipe.enable_lora()
    pipe.unload_lora_weights()
    assert runner.active is runner.schedule
    assert torch.equal(run(pipe), plain)


def test_keep_and_off_policies(pipe):
    attach_cache(pipe, schedule(pipe, PACKAGE))
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    pipe.sdkiln_lora.set_cache_policy("keep")
    pipe.load_lora_weights(a_lora(pipe), adapter_name="style")
    runner = cache_runner(pipe.transformer)
    assert runner.active is runner.schedule
    kept = run(pipe)
    assert torch.equal(kept, with_schedule(pipe, PACKAGE))
    pipe.sdkiln_lora.set_cache_policy("off")
    runner = cache_runner(pipe.transformer)
    assert all(a.kind == "full" for a in runner.active.actions["batched"])
    off = run(pipe)
    detach_cache(pipe.transformer)
    assert torch.equal(off, run(pipe))  # every step full: the uncached run with the LoRA
    # a larger margin than the front offers above SAFER still finds all-full; 0 dB keeps the package's
    attach_cache(pipe, schedule(pipe, PACKAGE))
    pipe.sdkiln_lora.set_cache_policy("headroom", margin_db=40.0)
    assert cache_runner(pipe.transformer).active.block_evaluations_ratio() == 1.0
    pipe.sdkiln_lora.set_cache_policy("headroom", margin_db=0.0)
    assert cache_runner(pipe.transformer).active is cache_runner(pipe.transformer).schedule


def test_without_a_front_the_schedule_runs_as_searched_with_one_warning(pipe, caplog):
    runner = attach_cache(pipe, schedule(pipe, PACKAGE, front=None))
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    with caplog.at_level(logging.WARNING, logger="sdkiln.load"):
        pipe.load_lora_weights(a_lora(pipe), adapter_name="style")
        pipe.set_adapters("style", 0.5)
    assert runner.active is runner.schedule
    assert caplog.text.count("no safer schedule") == 1


@pytest.mark.parametrize(
    "front, message",
    [
        ("not a list", "list of confirmed schedules"),
        ([{"actions": PACKAGE, "block_evaluations_ratio": 0.5, "psnr_mean": "high", "psnr_p5": 1}], "finite"),
        (
            [{"actions": PACKAGE[:3], "block_evaluations_ratio": 0.5, "psnr_mean": 1, "psnr_p5": 1}],
            "6 actions",
        ),
    ],
)
def test_a_bad_front_is_one_error(pipe, front, message):
    attach_cache(pipe, schedule(pipe, PACKAGE, front=front))
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    with pytest.raises(PackageError, match=message):
        pipe.load_lora_weights(a_lora(pipe), adapter_name="style")


def test_bad_policies_are_refused(pipe):
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    with pytest.raises(Exception, match="one of headroom, keep, off"):
        pipe.sdkiln_lora.set_cache_policy("fast")
    with pytest.raises(Exception, match="margin"):
        pipe.sdkiln_lora.set_cache_policy("headroom", margin_db=-1)


def test_run_says_what_the_cache_does_under_the_lora(pipe, capsys):
    from sdkiln.cli_run import _print_lora_cache

    attach_cache(pipe, schedule(pipe, PACKAGE))
    lora.attach(pipe, pipe.transformer, compiled=False, folded={})
    pipe.load_lora_weights(a_lora(pipe), adapter_name="style")
    for policy in ("headroom", "keep", "off"):
        pipe.sdkiln_lora.set_cache_policy(policy)
        _print_lora_cache(pipe, policy)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "cache: stepped up under the LoRA to 0.83 of the block evaluations from 0.50 (calibration PSNR "
        "30.0 -> 34.0 dB; --lora-cache keep runs it as searched)",
        "cache: the package's schedule as searched (0.50 of the block evaluations; --lora-cache keep)",
        "cache: off under the LoRA, every step computes (--lora-cache off)",
    ]
