"""Every family's spec against its tiny real diffusers pipeline (STYLE.md habit 13).

Every comparison here is exact (``torch.equal`` / ``np.array_equal``): the same seed on the same
weights on one CPU thread must give the same bits.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sdkiln.calibrate.steps import has_step_callback, on_step_end
from sdkiln.model_zoo import get_spec, spec_names

NAMES = [name for name in spec_names() if name != "fmnist-flux"]  # tests/model_zoo/test_fmnist.py
SAVED_SUFFIXES = {".safetensors", ".json", ".txt", ".jinja"}  # .jinja: a chat template (FLUX.2, Qwen-Image)
LATENTS = "latents"
"""The tensor every pipeline hands to ``callback_on_step_end``; calibration records it."""


def _generate(pipe, spec, seed: int = 0, **overrides):
    call = spec.call_kwargs(**overrides)
    out = pipe(
        prompt=spec.eval_prompts[0],
        generator=torch.Generator().manual_seed(seed),
        **call,
        **spec.condition(call),
    )
    return out.frames if hasattr(out, "frames") else out.images


def _expected_shape(spec) -> tuple[int, ...]:
    kwargs = spec.call_kwargs()
    frames = (kwargs["num_frames"],) if "num_frames" in kwargs else ()
    return (1, *frames, kwargs["height"], kwargs["width"], 3)


@pytest.fixture(params=NAMES)
def spec(request):
    return get_spec(request.param)


@pytest.fixture
def pipe(spec):
    return spec.build()


def test_build_is_deterministic_and_leaves_global_rng_alone(spec):
    state = torch.random.get_rng_state()
    first, second = spec.build(), spec.build()
    assert torch.equal(torch.random.get_rng_state(), state)
    for name, component in first.components.items():
        if isinstance(component, nn.Module):
            assert not component.training, name
            other = second.components[name].state_dict()
            for key, tensor in component.state_dict().items():
                assert tensor.dtype == torch.float32 or not tensor.is_floating_point(), (name, key)
                assert torch.equal(tensor, other[key]), (name, key)


def test_pipeline_class_matches_spec(spec, pipe):
    module, cls = spec.pipeline_class.split(":")
    assert type(pipe) is getattr(importlib.import_module(module), cls)
    if spec.guidance_arg is None:  # the guidance is the guider component's
        assert type(pipe.guider).__name__ == "ClassifierFreeGuidance" and pipe.guider.guidance_scale > 1
    else:
        assert spec.guidance_arg in inspect.signature(type(pipe).__call__).parameters


def test_generation_shape_finite_and_seeded(spec, pipe):
    first = _generate(pipe, spec, seed=0)
    assert first.shape == _expected_shape(spec)
    assert np.isfinite(first).all()
    assert np.array_equal(first, _generate(pipe, spec, seed=0))
    assert not np.array_equal(first, _generate(pipe, spec, seed=1))


def test_save_pretrained_round_trip(spec, pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written
    assert {p.suffix for p in written} <= SAVED_SUFFIXES, sorted(
        str(p.relative_to(tmp_path)) for p in written
    )

    transformer_cls = type(getattr(pipe, spec.transformer_attr))
    if transformer_cls._keep_in_fp32_modules and importlib.util.find_spec("accelerate") is None:
        pytest.fail(
            f"{transformer_cls.__name__}.from_pretrained needs `accelerate`: diffusers loads models with "
            "_keep_in_fp32_modules only with low_cpu_mem_usage=True; pip install accelerate"
        )
    # read into memory, not mapped: a mapped weight sits wherever the safetensors header leaves it, and
    # the CPU GEMM rounds differently on unaligned weights (HunyuanVideo's, 8 bytes off 16)
    reloaded = type(pipe).from_pretrained(Path(tmp_path), disable_mmap=True)
    assert np.array_equal(_generate(pipe, spec), _generate(reloaded, spec))


def test_block_lists_and_float_layers_resolve(spec, pipe):
    transformer = getattr(pipe, spec.transformer_attr)
    for block_list in spec.block_lists:
        blocks = getattr(transformer, block_list.attr)
        assert isinstance(blocks, nn.ModuleList), block_list.attr
        assert len(blocks) >= 2, block_list.attr

    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    for pattern in (*spec.float_layers, *spec.weight_only_layers):
        matched = [name for name in linears if fnmatch.fnmatchcase(name, pattern)]
        assert matched, f"float_layers / weight_only_layers pattern {pattern!r} matches no Linear"
        assert all(name.startswith(spec.block_prefixes()) for name in matched), pattern

    in_blocks = [m for name, m in linears.items() if name.startswith(spec.block_prefixes())]
    assert in_blocks
    for linear in in_blocks:
        assert linear.in_features % 16 == 0 and linear.out_features % 16 == 0, linear


def test_blocks_return_declared_outputs_in_order(spec, pipe):
    """Block 0's outputs, read by the declared names, are exactly what block 1 receives."""
    transformer = getattr(pipe, spec.transformer_attr)
    calls: dict[tuple[str, int], tuple[tuple, dict]] = {}

    def record(key):
        def hook(module, args, kwargs):
            calls.setdefault(key, (args, dict(kwargs)))

        return hook

    handles = [
        getattr(transformer, bl.attr)[i].register_forward_pre_hook(record((bl.attr, i)), with_kwargs=True)
        for bl in spec.block_lists
        for i in (0, 1)
    ]
    try:
        _generate(pipe, spec, num_inference_steps=1)
    finally:
        for handle in handles:
            handle.remove()

    for block_list in spec.block_lists:
        blocks = getattr(transformer, block_list.attr)
        signature = inspect.signature(blocks[0].forward)
        args, kwargs = calls[(block_list.attr, 0)]
        first_inputs = signature.bind(*args, **kwargs).arguments
        next_args, next_kwargs = calls[(block_list.attr, 1)]
        next_inputs = signature.bind(*next_args, **next_kwargs).arguments
        assert set(block_list.inputs) <= set(first_inputs), block_list.attr

        with torch.no_grad():
            out = blocks[0](*args, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        assert len(out) == len(block_list.outputs), block_list.attr
        for name, tensor in zip(block_list.outputs, out, strict=True):
            assert tensor.shape == first_inputs[name].shape, (block_list.attr, name)
            assert torch.equal(tensor, next_inputs[name]), (block_list.attr, name)


def test_callback_captures_final_latents(spec, pipe):
    """The latents after every step reach the step callback (``calibrate.steps``: diffusers'
    ``callback_on_step_end``, or the scheduler's step where the pipeline has none)."""
    captured = {}

    def capture(pipeline, step, timestep, callback_kwargs):
        captured[step] = callback_kwargs[LATENTS].clone()
        return callback_kwargs

    with on_step_end(pipe, capture) as extra:
        latents = _generate(pipe, spec, output_type="latent", **extra)
    assert bool(extra) == has_step_callback(pipe)
    steps = spec.call_kwargs()["num_inference_steps"]
    assert sorted(captured) == list(range(steps))
    assert torch.equal(captured[steps - 1], latents)
