"""Carry out a residency plan on a loaded pipeline: components that visit the device, transformer
blocks that stream from host memory in groups.

A **unit** (a visiting component, or a group of consecutive blocks of one block list) keeps a host
copy of each of its parameters and buffers (pinned on CUDA) and swaps the tensors' ``.data``:
*onload* points each at a device copy, *offload* at an empty device tensor, which frees the device
copy. Module objects, hooks and names stay as they are, so the quantized modules, the cache hooks and
the LoRA branch run unchanged; the LoRA's buffers (``lora_a``, ``lora_b``, ``lora_scale``) are not
moved. On the CPU the device copy is the host copy itself: the hooks run and the tensors really are
emptied between uses, so a block that ran without its onload would fail, and outputs are the
resident run's bit for bit.

* A visiting text encoder onloads before its forward and offloads after it; a visiting VAE around
  each ``encode`` / ``decode`` call (the outermost, where one calls another).
* A streamed block list: the first block of a group onloads the group (and, with prefetch on CUDA,
  starts the next group's copy on a side stream; the next group waits for that copy before it
  computes); the group's last block offloads it. After the last group, the first is prefetched for
  the next call.
* A ``+tiled`` plan turns on the VAE's tiled decode (``tile_decode``), whether the VAE visits or not.

Counters (``Residency.onloads``) say what moved; ``Residency.plan`` says which plan ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sdkiln.runtime.memory.plan import Plan
from sdkiln.runtime.memory.sizes import VAE_TILE, block_lists

KEPT = ("lora_a", "lora_b", "lora_scale")
"""Buffers that stay where they are: the LoRA branch's, written in place at any time."""


class Unit:
    """Tensors that move together (module docstring)."""

    def __init__(self, name: str, modules: list[nn.Module], device: torch.device):
        self.name, self.device = name, device
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        pin = device.type == "cuda"
        for module in modules:
            for sub in module.modules():
                for key, t in [*sub._parameters.items(), *sub._buffers.items()]:
                    if t is None or key in KEPT or id(t) in seen:
                        continue
                    seen.add(id(t))
                    host = t.data if t.device.type == "cpu" else t.data.to("cpu")
                    if pin:
                        host = host.pin_memory()
                    self.tensors.append((t, host))
        self.on = True
        self.event: Any = None
        self.onloads = 0

    def onload(self, stream: Any = None) -> None:
        if self.on:
            return
        where = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with where:
            for t, host in self.tensors:
                t.data = host.to(self.device, non_blocking=True)
            if stream is not None:
                self.event = torch.cuda.Event()
                self.event.record(stream)
        self.on, self.onloads = True, self.onloads + 1

    def ready(self) -> None:
        """Before compute: wait for a prefetch's copy, and tell the allocator the tensors are used here."""
        if self.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            for t, _ in self.tensors:
                t.data.record_stream(current)
            self.event = None

    def offload(self) -> None:
        for t, host in self.tensors:
            t.data = torch.empty(0, dtype=host.dtype, device=self.device)
        self.on = False


@dataclass
class Residency:
    """The plan a pipeline runs under and its units (``pipe.sdkiln_memory``)."""

    plan: Plan
    visitors: dict[str, Unit] = field(default_factory=dict)
    groups: dict[str, list[Unit]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    sizes: Any = None
    """The planner's ``Sizes`` the plan was made from."""

    @property
    def onloads(self) -> dict[str, int]:
        out = {name: u.onloads for name, u in self.visitors.items()}
        for attr, units in self.groups.items():
            out[attr] = sum(u.onloads for u in units)
        return out


def apply(
    pipeline: Any, plan: Plan, device: torch.device, transformer_attrs: tuple[str, ...], sizes: Any = None
) -> Residency:
    """Put ``pipeline`` (on the host) under ``plan`` on ``device``: units made and offloaded, hooks
    attached, the rest moved to the device."""
    res = Residency(plan, sizes=sizes)
    for name in plan.visiting:
        component = getattr(pipeline, name)
        unit = Unit(name, [component], device)
        unit.offload()
        res.visitors[name] = unit
        if name == "vae":
            _visit_methods(component, unit, ("encode", "decode"))
        else:
            res.handles += _visit_forward(component, unit)
    if plan.vae_tiled:
        tile_decode(pipeline.vae)
    if plan.blocks_per_group:
        stream = torch.cuda.Stream(device) if plan.prefetch and device.type == "cuda" else None
        for attr in transformer_attrs:
            res.groups[attr] = _stream_blocks(
                getattr(pipeline, attr), plan.blocks_per_group, device, stream, res
            )
    pipeline.to(device)
    return res


def tile_decode(vae: nn.Module) -> None:
    """The VAE decodes in tiles of ``VAE_TILE`` pixels, 192 apart: diffusers' tiling, which an
    ``AutoencoderKL`` sizes from its config's ``sample_size`` (1024 for FLUX's, no tiling at 1024x1024)
    and the video VAEs take as arguments."""
    from diffusers import AutoencoderKL

    if isinstance(vae, AutoencoderKL):
        vae.tile_sample_min_size = VAE_TILE
        vae.tile_latent_min_size = VAE_TILE // 2 ** (len(vae.config.block_out_channels) - 1)
        vae.tile_overlap_factor = 0.25
        vae.enable_tiling()
    else:
        stride = VAE_TILE * 3 // 4
        vae.enable_tiling(
            tile_sample_min_height=VAE_TILE,
            tile_sample_min_width=VAE_TILE,
            tile_sample_stride_height=stride,
            tile_sample_stride_width=stride,
        )


def _visit_forward(module: nn.Module, unit: Unit) -> list[Any]:
    def before(mod, args):
        unit.onload()

    def after(mod, args, output):
        unit.offload()

    return [
        module.register_forward_pre_hook(before),
        module.register_forward_hook(after, always_call=True),
    ]


def _visit_methods(module: nn.Module, unit: Unit, names: tuple[str, ...]) -> None:
    depth = [0]
    for name in names:
        original = getattr(module, name, None)
        if original is None:
            continue

        def visiting(*args, _original=original, **kwargs):
            depth[0] += 1
            unit.onload()
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    unit.offload()

        object.__setattr__(module, name, visiting)


def _stream_blocks(
    transformer: nn.Module, size: int, device: torch.device, stream: Any, res: Residency
) -> list[Unit]:
    units: list[Unit] = []
    for list_name, blocks in block_lists(transformer):
        for start in range(0, len(blocks), size):
            members = list(blocks[start : start + size])
            unit = Unit(f"{list_name}[{start}:{start + len(members)}]", members, device)
            unit.offload()
            units.append(unit)
            first, last = members[0], members[-1]
            index = len(units) - 1

            def before(mod, args, _unit=unit, _index=index, _first=first):
                _unit.onload()  # any member: a group is on before any of its blocks runs
                _unit.ready()
                if mod is _first and stream is not None:
                    units[(_index + 1) % len(units)].onload(stream)

            def after(mod, args, output, _unit=unit, _last=last):
                if mod is _last:
                    _unit.offload()

            res.handles += [block.register_forward_pre_hook(before) for block in members]
            res.handles.append(last.register_forward_hook(after, always_call=True))
    return units
