"""LoRA on a loaded package (``sdkiln.runtime.lora``): diffusers' calls on a package pipeline, the
branch on every quantization scheme, strengths, mixing, switching off and unloading, hot swap under
compile, and the refusals.

Comparisons (STYLE habit 12):
* Exact (``torch.equal``): anything that must leave the package as it was (strength 0, disable,
  unload, delete), and what the same LoRA state must reproduce.
* A LoRA'd quantized layer against the float layer with the same LoRA: their difference is the
  scheme's own error, ``q(x) - f(x)``: the branch is computed from the same x in fp32 on both sides, so
  the two differences agree within fp32 rounding of the sums (``BRANCH_TOL``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sdkiln
import sdkiln.kernels as K
from sdkiln.errors import SdkilnError
from sdkiln.runtime.lora import LoraRunner
from sdkiln.runtime.quant import Ranges, scheme_classes
from sdkiln.runtime.quant.smooth import SmoothedLinear

sys.path.insert(0, str(Path(__file__).parent))
from lora_helpers import tiny_call  # noqa: E402  (tests/runtime/lora_helpers.py)

BRANCH_TOL = dict(rtol=1e-4, atol=1e-4)
"""fp32 sums of values of order 1-10: the branch added to q(x) and to f(x) rounds differently."""


class Block(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.proj = layer


class Transformer(nn.Module):
    """A stand-in transformer: one block with the layer under test; FLUX's converter reads its LoRA."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([Block(layer)])


class Pipe:
    @classmethod
    def lora_state_dict(cls, state, return_alphas=False):
        from diffusers import FluxPipeline

        return FluxPipeline.lora_state_dict(state, return_alphas=return_alphas)


def _runner(layer: nn.Module, folded=None) -> tuple[LoraRunner, Transformer]:
    transformer = Transformer(layer)
    return LoraRunner(Pipe(), transformer, compiled=False, folded=folded or {}), transformer


def _lora(k: int, n: int, rank: int, seed: int, layer: str = "transformer_blocks.0.proj", alpha=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        f"transformer.{layer}.lora_A.weight": torch.randn(rank, k, generator=g) / k**0.5,
        f"transformer.{layer}.lora_B.weight": torch.randn(n, rank, generator=g) / rank**0.5,
    }
    if alpha is not None:
        state[f"transformer.{layer}.alpha"] = torch.tensor(float(alpha))
    return state


def _merged(linear: nn.Linear, state: dict, scale: float) -> nn.Linear:
    """The float reference: W + scale * B @ A."""
    (a,) = [v for k, v in state.items() if k.endswith("lora_A.weight")]
    (b,) = [v for k, v in state.items() if k.endswith("lora_B.weight")]
    out = nn.Linear(linear.in_features, linear.out_features)
    with torch.no_grad():
        out.weight.copy_(linear.weight + scale * b @ a)
        out.bias.copy_(linear.bias)
    return out


def _quantized(scheme: str, linear: nn.Linear, x: torch.Tensor) -> nn.Module:
    cls = scheme_classes()[scheme]
    if scheme == "W8A8":
        return cls.from_linear(linear, Ranges(float(x.min()), float(x.max())))
    if scheme == "W8A8_TIMESTEP":
        lo, hi = torch.full((2,), float(x.min())), torch.full((2,), float(x.max()))
        layer = cls.from_linear(linear, Ranges(step_min=lo, step_max=hi), dynamic_steps=1)
        layer.set_step(1, 2)  # the static row
        return layer
    if scheme == "W4A16":
        return cls.from_linear(linear, group_size=32)
    return cls.from_linear(linear)


@pytest.mark.parametrize("scheme", sorted(scheme_classes()))
def test_the_branch_adds_the_float_lora_to_every_scheme(scheme):
    """q(x) + LoRA - (f(x) + LoRA) is the scheme's own error q(x) - f(x): the branch runs from the
    unquantized x, with alpha / r, at the set strength."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(2, 9, 64)
    layer = _quantized(scheme, linear, x)
    with torch.no_grad():
        plain_error = layer(x) - linear(x)
    runner, transformer = _runner(layer)
    state = _lora(64, 48, rank=8, seed=1, alpha=4)
    runner.load_lora_weights(state, adapter_name="style")
    runner.set_adapters("style", 0.75)
    K.reset_kernel_counts()
    with torch.no_grad():
        ours = transformer.transformer_blocks[0].proj(x)
        assert K.kernel_counts()[("lora_add", "cpu", "reference")] == 1
        want = _merged(linear, state, 0.75 * 4 / 8)(x)
    assert runner.get_active_adapters() == ["style"]
    torch.testing.assert_close(ours - want, plain_error, **BRANCH_TOL)


def test_a_smoothed_layer_is_taken_whole_and_a_folded_one_sees_the_models_input():
    """SmoothedLinear: the branch hooks the outer module (input x, before 1/s). A layer whose 1/s was
    folded into the modulation sees x / s; A's columns are multiplied by s on load."""
    torch.manual_seed(0)
    linear, x = nn.Linear(32, 16), torch.randn(3, 32)
    s = torch.rand(32) + 0.5
    state = _lora(32, 16, rank=4, seed=2)
    want = _merged(linear, state, 1.0)(x)
    runner, transformer = _runner(SmoothedLinear.from_linear(linear, s))
    runner.load_lora_weights(state)
    with torch.no_grad():
        torch.testing.assert_close(transformer.transformer_blocks[0].proj(x), want, **BRANCH_TOL)
    smoothed = SmoothedLinear.from_linear(linear, s).linear  # weight W * s: its input is x / s
    runner, transformer = _runner(smoothed, folded={"transformer_blocks.0.proj": s})
    runner.load_lora_weights(state)
    with torch.no_grad():
        torch.testing.assert_close(transformer.transformer_blocks[0].proj(x / s), want, **BRANCH_TOL)


def test_bad_loras_are_one_line_and_change_nothing(tmp_path):
    linear = nn.Linear(16, 8)
    runner, _ = _runner(linear)
    good = _lora(16, 8, 4, 0)
    cases = [
        (
            {**good, "text_encoder.layers.0.q.lora_A.weight": torch.zeros(4, 16)},
            "LoRA layers of the text_encoder",
        ),
        (_lora(16, 8, 4, 0, layer="transformer_blocks.0.nope"), "no such layer in the transformer"),
        (_lora(12, 8, 4, 0), r"do not fit the layer \(16 -> 8\)"),
        ({k: v for k, v in good.items() if "lora_B" not in k}, "needs both lora_A and lora_B"),
        ({**good, "transformer.transformer_blocks.0.proj.lora_B.bias": torch.zeros(8)}, "no LoRA bias"),
        (
            {k: v * float("nan") if "lora_A" in k else v for k, v in good.items()},
            "must be finite float tensors",
        ),
    ]
    for state, words in cases:
        with pytest.raises(SdkilnError, match=words) as caught:
            runner.load_lora_weights(state)
        assert "\n" not in str(caught.value)
    (tmp_path / "lora.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(SdkilnError, match="only .safetensors files are read"):
        runner.load_lora_weights(tmp_path / "lora.bin")
    assert runner.adapters == {} and runner.hooks == {} and "lora_a" not in dict(linear.named_buffers())


# ---- a package ----


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "pkg"
    return sdkiln.optimize("flux-tiny", "w8a8-dynamic", out, eval_samples=0, progress=False).package


def _package_lora(pipe, rank: int, seed: int) -> dict:
    """A LoRA on every attention projection of every block, quantized or float, plus the float
    modulation of the first block."""
    state = {}
    for name, module in pipe.sdkiln_lora.transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "norm1.linear")):
            k, n = module.in_features, module.out_features
            state |= _lora(k, n, rank, seed + len(state), layer=name)
    return state


def test_strengths_mixing_and_switching_off_return_the_package_bit_for_bit(package):
    pipe = sdkiln.load(package, device="cpu")
    base = pipe(**tiny_call()).images
    one, two = _package_lora(pipe, 4, 0), _package_lora(pipe, 8, 100)
    kinds = {
        type(pipe.transformer.get_submodule(k.split(".lora_")[0].removeprefix("transformer."))).__name__
        for k in one
    }
    assert kinds == {"W8A8DynamicLinear", "Linear"}  # quantized attention, float modulation
    pipe.load_lora_weights(one, adapter_name="one")
    pipe.load_lora_weights(two, adapter_name="two")
    assert pipe.get_list_adapters() == {"transformer": ["one", "two"]}
    mixed = pipe(**tiny_call()).images
    assert not torch.equal(torch.from_numpy(mixed), torch.from_numpy(base))
    pipe.set_adapters(["one", "two"], [0.0, 0.0])
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(base))
    pipe.set_adapters(["one", "two"], [1.0, 1.0])
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(mixed))
    pipe.disable_lora()
    assert pipe.get_active_adapters() == []
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(base))
    pipe.enable_lora()
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(mixed))
    pipe.set_adapters("two", 0.5)
    only_two = pipe(**tiny_call()).images
    pipe.delete_adapters("one")
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(only_two))
    pipe.unload_lora_weights()
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(base))
    assert not [n for n, _ in pipe.transformer.named_buffers() if "lora_" in n]


def test_fuse_is_refused_on_quantized_layers_and_exact_on_float_ones(package):
    pipe = sdkiln.load(package, device="cpu")
    base = pipe(**tiny_call()).images
    pipe.load_lora_weights(_package_lora(pipe, 4, 0))
    with pytest.raises(SdkilnError, match="fuse_lora: .* quantized .*sdkiln optimize --lora"):
        pipe.fuse_lora()
    pipe.unload_lora_weights()
    floats = {k: v for k, v in _package_lora(pipe, 4, 0).items() if "norm1.linear" in k}
    pipe.load_lora_weights(floats, adapter_name="mod")
    branched = pipe(**tiny_call()).images
    pipe.fuse_lora()
    fused = pipe(**tiny_call()).images
    assert abs(fused - branched).max() < 1e-4 and not torch.equal(
        torch.from_numpy(fused), torch.from_numpy(base)
    )
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    assert torch.equal(torch.from_numpy(pipe(**tiny_call()).images), torch.from_numpy(base))


def test_hot_swap_under_compile_does_not_recompile(package):
    """With enable_lora_hotswap's capacity prepared, a compiled package swaps in a LoRA of the same or
    smaller rank, changes strengths and switches LoRA off without a new graph (Dynamo's
    error_on_recompile); the compiled run with the LoRA matches the eager one; a larger rank and a new
    layer are one line each."""
    from sdkiln.configs.runtime import CompileConfig

    eager = sdkiln.load(package, device="cpu")
    eager.load_lora_weights(_package_lora(eager, 8, 1))
    want = eager(**tiny_call()).images
    torch._dynamo.reset()
    pipe = sdkiln.load(package, device="cpu", compile=CompileConfig(regional=True))
    pipe.enable_lora_hotswap(target_rank=8)
    pipe.load_lora_weights(_package_lora(pipe, 4, 0), adapter_name="style")
    pipe(**tiny_call())  # compiles, LoRA included
    pipe.load_lora_weights(_package_lora(pipe, 8, 1), adapter_name="style", hotswap=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        swapped = pipe(**tiny_call()).images
        pipe.set_adapters("style", 0.3)
        pipe(**tiny_call())
        pipe.disable_lora()
        pipe(**tiny_call())
    assert abs(swapped - want).max() < 2e-3  # Inductor's fp32 rounding against eager's
    with pytest.raises(SdkilnError, match="rank 16; .* above enable_lora_hotswap's target_rank 8") as caught:
        pipe.load_lora_weights(_package_lora(pipe, 16, 2), adapter_name="big")
    assert "\n" not in str(caught.value)


def test_a_new_layer_after_a_compiled_run_is_refused_before_one_it_is_free():
    """Without enable_lora_hotswap, a compiled package takes a LoRA's layers until it has run
    (``ColdStart``'s first step); after that a layer without a branch would recompile it: one line."""
    from types import SimpleNamespace

    class Compiled(Pipe):
        sdkiln_cold_start = SimpleNamespace(phases={"compile": 1.0})

    runner, transformer = _runner(nn.Linear(16, 8))
    runner.compiled, runner.pipeline = True, Compiled()
    runner.load_lora_weights(_lora(16, 8, 4, 0), adapter_name="one")
    runner.pipeline.sdkiln_cold_start.phases["first_step"] = 2.0
    runner.load_lora_weights(_lora(16, 8, 4, 1), adapter_name="one", hotswap=True)  # same columns
    with pytest.raises(
        SdkilnError, match="8 ranks in all, above the 4 prepared; this package has run compiled"
    ):
        runner.load_lora_weights(_lora(16, 8, 4, 2), adapter_name="two")
