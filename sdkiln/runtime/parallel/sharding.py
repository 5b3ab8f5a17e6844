"""Split the sequence at the family's plan points and gather it again: diffusers' context-parallel
split hook with padding, so that sequence lengths need not divide the degree.

A plan is diffusers' ``_cp_plan`` (module name -> inputs to split, or the output to gather) — the
transformer class's own for split text, the family's ``ModelSpec.parallel_plan`` (sdkiln data in
the same shape) for replicated text. The split hook is diffusers' ``ContextParallelSplitHook``
(which finds each argument, positional or keyword, and splits outputs where the plan says so) with
one change: a tensor whose length does not divide the degree is padded with zeros at its end to the
next multiple, so every shard has the same length and every collective the same size. The global
lengths of the call are recorded (``SequenceLayout.lengths``); attention leaves padded keys out,
and the gather hook cuts the padding off again. Padded queries compute values nobody reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.context_parallel import ContextParallelSplitHook
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

from sdkiln.errors import ParallelError
from sdkiln.runtime.parallel.mesh import Mesh, all_gather

SPLIT_HOOK = "sdkiln_parallel_split---{}"
GATHER_HOOK = "sdkiln_parallel_gather---{}"


@dataclass
class SequenceLayout:
    """What every routed attention call and the gather hooks need to know about the split: the mesh,
    whether text is split, and each split input's global length in the current call."""

    mesh: Mesh
    split_text: bool
    image: str
    text: str
    lengths: dict[str, int] = field(default_factory=dict)

    @property
    def degree(self) -> int:
        return self.mesh.sequence_degree

    def shard(self, length: int) -> int:
        return -(-length // self.degree)


@dataclass(frozen=True)
class _NamedInput(ContextParallelInput):
    """diffusers' split entry, with the argument's name (its global length is recorded under it)."""

    name: str | int = ""


def pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - 1 - dim) + [0, extra]
    return F.pad(x, pad)


class SplitHook(ContextParallelSplitHook):
    def __init__(self, metadata, layout: SequenceLayout):
        super().__init__(metadata, parallel_config=None)
        self.layout = layout

    def _prepare_cp_input(self, x: torch.Tensor, cp_input: ContextParallelInput) -> torch.Tensor:
        if cp_input.expected_dims is not None and x.dim() != cp_input.expected_dims:
            return x  # as diffusers: the plan splits only tensors of this rank (Wan2.1's [B] timestep stays whole)
        layout, dim = self.layout, cp_input.split_dim
        length = x.shape[dim]
        if isinstance(cp_input, _NamedInput) and isinstance(cp_input.name, str):
            layout.lengths[cp_input.name] = length
        shard = layout.shard(length)
        x = pad_to(x, dim, shard * layout.degree)
        return x.narrow(dim, layout.mesh.sequence_rank * shard, shard)


class GatherHook(ModelHook):
    """All-gathers the module's output along the plan's dimension and cuts the padding off."""

    def __init__(self, output: ContextParallelOutput, length_of: str, layout: SequenceLayout):
        super().__init__()
        self.output, self.length_of, self.layout = output, length_of, layout

    def post_forward(self, module, output):
        if not isinstance(output, torch.Tensor):
            raise ParallelError(
                f"the parallel plan gathers a tensor, {type(module).__name__} returned {type(output)}"
            )
        if self.output.expected_dims is not None and output.dim() != self.output.expected_dims:
            raise ParallelError(
                f"the parallel plan gathers a {self.output.expected_dims}-d output of {type(module).__name__}, "
                f"got {output.dim()}-d"
            )
        length = self.layout.lengths.get(self.length_of)
        if length is None:
            raise ParallelError(
                f"the parallel plan gathers to the length of {self.length_of!r}, which it never split"
            )
        return gather_sequence(output, self.output.gather_dim, length, self.layout)


def gather_sequence(x: torch.Tensor, dim: int, length: int, layout: SequenceLayout) -> torch.Tensor:
    """The whole sequence from every rank's shard of ``x`` along ``dim``, padding cut off."""
    parts = all_gather(x, layout.mesh.sequence_group, layout.degree)
    whole = torch.cat(parts.unbind(0), dim=dim)
    return whole.narrow(dim, 0, length)


def to_diffusers_plan(plan) -> tuple[dict, dict[str, str]]:
    """A ``ModelSpec.parallel_plan`` as a diffusers ``_cp_plan`` (with named split entries) and the
    split input each gather restores the length of."""
    out: dict = {}
    lengths: dict[str, str] = {}
    for s in plan.splits:
        out.setdefault(s.module, {})[s.name] = _NamedInput(s.dim, s.ndim, s.output, name=s.name)
    for g in plan.gathers:
        out[g.module] = ContextParallelOutput(g.dim, g.ndim)
        lengths[g.module] = g.length_of
    return out, lengths


def named_cp_plan(cp_plan: dict, image: str) -> tuple[dict, dict[str, str]]:
    """A diffusers class's own ``_cp_plan`` with named split entries; its gathers restore ``image``."""
    out: dict = {}
    lengths: dict[str, str] = {}
    for module, entry in cp_plan.items():
        if isinstance(entry, dict):
            out[module] = {
                name: _NamedInput(**dataclasses.asdict(cpi), name=name) for name, cpi in entry.items()
            }
        else:
            out[module] = entry
            lengths[module] = image
    return out, lengths


def apply_plan(transformer: nn.Module, plan: dict, lengths: dict[str, str], layout: SequenceLayout) -> None:
    """Register the split and gather hooks of ``plan``."""
    for module_name, entry in plan.items():
        try:
            module = transformer.get_submodule(module_name) if module_name else transformer
        except AttributeError:
            raise ParallelError(
                f"the parallel plan names {module_name!r}, which the transformer does not have"
            ) from None
        registry = HookRegistry.check_if_exists_or_initialize(module)
        if isinstance(entry, dict):
            registry.register_hook(SplitHook(entry, layout), SPLIT_HOOK.format(module_name))
        else:
            outputs = entry if isinstance(entry, list | tuple) else [entry]
            if len(outputs) != 1:
                raise ParallelError(
                    f"the parallel plan gathers {len(outputs)} outputs of {module_name!r}; sdkiln gathers one"
                )
            gather = GatherHook(outputs[0], lengths[module_name], layout)
            registry.register_hook(gather, GATHER_HOOK.format(module_name))
