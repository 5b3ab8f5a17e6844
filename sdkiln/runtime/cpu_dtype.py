"""16-bit weights computed in fp32 on a CPU without fast 16-bit matmuls.

A bf16 matmul is 2x faster than fp32 on a CPU with AVX-512 BF16 or AMX and about 80x slower on
an AMD EPYC with AVX2 only (``sdkiln.kernels.cpu_profile`` measures which). There a bf16 package
or base model keeps its weights in 16 bits in memory and each module widens its own 16-bit
parameters and buffers to fp32 for the length of its forward (one layer's fp32 copy at a time),
with its 16-bit floating inputs widened too, so every matmul, convolution and attention runs in
fp32. The outputs stay fp32: the next module receives fp32 and the pipeline rounds its latents to
its own dtype where it always does. Named, removable hooks on the unmodified modules
(``unwiden``); ``sdkiln.load`` applies them on the CPU where the profile says the package's dtype
is slow, and says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WIDENED = (torch.bfloat16, torch.float16)
HANDLES_ATTR = "_sdkiln_widen_handles"


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in WIDENED:
        return value.float()
    if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_widen(v) for v in value)
    return value


def _own_16bit(module: nn.Module) -> tuple[list[str], list[str]]:
    params = [n for n, p in module.named_parameters(recurse=False) if p.dtype in WIDENED]
    buffers = [n for n, b in module.named_buffers(recurse=False) if b.dtype in WIDENED]
    return params, buffers


def widen_to_float32(model: nn.Module) -> int:
    """Hook every submodule of ``model`` that owns 16-bit parameters or buffers so its forward runs
    in fp32; returns how many modules were hooked. Calling it again on a hooked model does nothing."""
    if getattr(model, HANDLES_ATTR, None):
        return 0
    handles = []
    for module in model.modules():
        params, buffers = _own_16bit(module)
        if not params and not buffers:
            continue

        def pre(mod, args, kwargs, params=params, buffers=buffers):
            mod._sdkiln_narrow = (
                {n: mod._parameters[n] for n in params},
                {n: mod._buffers[n] for n in buffers},
            )
            for n in params:
                mod._parameters[n] = mod._parameters[n].detach().float()
            for n in buffers:
                mod._buffers[n] = mod._buffers[n].float()
            return _widen(args), {k: _widen(v) for k, v in kwargs.items()}

        def post(mod, args, kwargs, output):
            narrow_params, narrow_buffers = mod.__dict__.pop("_sdkiln_narrow")
            mod._parameters.update(narrow_params)
            mod._buffers.update(narrow_buffers)
            return output

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
    setattr(model, HANDLES_ATTR, handles)
    return len(handles) // 2


def unwiden(model: nn.Module) -> None:
    """Remove ``widen_to_float32``'s hooks."""
    for handle in getattr(model, HANDLES_ATTR, None) or ():
        handle.remove()
    if hasattr(model, HANDLES_ATTR):
        delattr(model, HANDLES_ATTR)


def widen_slow_dtypes(pipeline: Any) -> dict[str, str]:
    """On this CPU, hook each model component of ``pipeline`` whose 16-bit dtype the profile says is
    slower than fp32; returns component -> dtype for those widened."""
    from sdkiln.kernels.cpu_profile import cpu_profile

    profile, widened = cpu_profile(), {}
    for name, component in pipeline.components.items():
        if not isinstance(component, nn.Module):
            continue
        dtypes = {p.dtype for p in component.parameters()} & set(WIDENED)
        slow = sorted(str(d).removeprefix("torch.") for d in dtypes if not profile.fast_dtype(d))
        if slow and widen_to_float32(component):
            widened[name] = "/".join(slow)
    return widened
