"""The ``sdkiln`` op namespace: how an op is defined, and which kernel runs it on which device.

**Defining an op** (``define``, called once by the op's family module in ``sdkiln.kernels.ops``):
its schema, its pure-torch reference, a fake for ``torch.compile`` and whether it differentiates.
The reference is registered under ``CompositeExplicitAutograd``: it is the CPU implementation and
runs on any device that has no kernel of its own. Float ops differentiate through the reference,
recomputed from the saved inputs in backward; quantized ops are inference-only and their backward
raises. Ops are defined with a plain ``torch.library.Library``, as vLLM's
``direct_register_custom_op``, rather than ``torch.library.custom_op``, which costs more Python per
call (docs/benchmarks.md) and imports ``torch._dynamo`` (and with it triton, where installed) on
its first call.

**Kernels**: any number per (op, device type), each with a name, a priority and an optional
``supports(*args) -> bool`` over the op's arguments::

    @register_kernel("fp8_linear", "cuda", name="scaled_mm", priority=10, supports=fits_scaled_mm)
    def fp8_linear_scaled_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype):  # the schema's arguments
        ...

For tensors on that device a dispatcher tries the kernels in priority order (ties: first
registered first) and runs the first that supports the arguments, falling back to the reference.
``implementation(op, device_type, *args)`` names what would run, so a test can assert the kernel
it measured, and ``kernel_counts()`` counts what did run, per op, device and kernel (or
reference). A device's kernel modules (``Platform.kernel_modules``) are imported only by
``load_device_kernels(device_type)``, which the runtime calls for the device it loads onto: never
``import sdkiln``, never a device query. A Triton kernel that Inductor should see into is written
with ``torch.library.triton_op`` and registered here like any other; the compile backend can find
it through ``kernels(op, device_type)``.

**Composites** (``define_composite``) are Python-level ops made of registered ops, for kernels
that fuse them: ``w8a8_linear_from_float`` is ``quantize_per_token_int8`` then ``w8a8_linear``. A
composite's kernels run only in plain eager calls (``eager_call``: no compile, trace, dispatch or
function mode, tensor subclass or gradient), skipping torch's dispatcher, whose Python round trip
costs about 10 us a call, as much as a small layer's whole product; everywhere else, and where no
kernel supports the arguments, its reference runs, and that calls the registered ops, so compiled
graphs, exports and other devices see exactly the ops they saw before. Kernels register with
``register_kernel`` as for any op, and are counted the same way.

Reloading this module (``importlib.reload``) keeps what the first import registered: the
dispatcher is process-wide, so its bookkeeping here is carried over rather than redefined.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from sdkiln.errors import DeviceError
from sdkiln.kernels.platform import DISPATCH_KEYS, platform_class

NAMESPACE = "sdkiln"
REFERENCE = "reference"
KERNEL_DEPENDENCIES = {"triton": "gpu", "torch_npu": "npu"}
"""The third-party module a device's kernels import -> the sdkiln extra that installs it."""

_F = TypeVar("_F", bound=Callable)


@dataclass(frozen=True)
class OpDef:
    name: str
    schema: str
    reference: Callable
    fake: Callable
    differentiable: bool


@dataclass(frozen=True)
class Kernel:
    name: str
    fn: Callable
    priority: int = 0
    supports: Callable[..., bool] | None = None

    def accepts(self, args: tuple) -> bool:
        return self.supports is None or bool(self.supports(*args))


# Carried over on re-import; see the module docstring.
_LIB: torch.library.Library = globals().get("_LIB") or torch.library.Library(NAMESPACE, "FRAGMENT")
_OPS: dict[str, OpDef] = globals().get("_OPS", {})
_KERNELS: dict[tuple[str, str], list[Kernel]] = globals().get("_KERNELS", {})
# (op, device_type) -> the Library that holds its dispatcher, while it has kernels
_DISPATCHERS: dict[tuple[str, str], torch.library.Library] = globals().get("_DISPATCHERS", {})
# composite name -> its reference (see the module docstring)
_COMPOSITES: dict[str, Callable] = globals().get("_COMPOSITES", {})
# (op, device_type, kernel or "reference") -> calls, for ``kernel_counts``
_RAN: Counter = globals().get("_RAN", Counter())


def _recompute_autograd(fn: Callable) -> tuple[Callable, Callable]:
    """(setup_context, backward) that differentiate ``fn`` by running it again under autograd."""

    def setup_context(ctx, inputs, output):
        ctx.is_tensor = [isinstance(a, Tensor) for a in inputs]
        ctx.constants = [None if is_t else a for a, is_t in zip(inputs, ctx.is_tensor, strict=True)]
        ctx.save_for_backward(*(a for a, is_t in zip(inputs, ctx.is_tensor, strict=True) if is_t))

    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = [
            next(saved).detach().requires_grad_(need) if is_t else const
            for is_t, const, need in zip(ctx.is_tensor, ctx.constants, ctx.needs_input_grad, strict=True)
        ]
        with torch.enable_grad():
            outputs = fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [a for a, need in zip(args, ctx.needs_input_grad, strict=True) if need]
        if not pairs or not wanted:
            return tuple(None for _ in args)
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        )
        return tuple(next(got) if need else None for need in ctx.needs_input_grad)

    return setup_context, backward


def _no_gradient(name: str) -> tuple[Callable, Callable]:
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{NAMESPACE}::{name} has no gradient: quantized ops are inference-only; run the model under "
            "torch.no_grad() or freeze its parameters"
        )

    return (lambda ctx, inputs, output: None), backward


def define(schema: str, *, reference: Callable, fake: Callable, differentiable: bool) -> OpDef:
    """Define ``sdkiln::<op>`` from its schema (``"name(args) -> out"``) with its reference, its fake
    and its autograd rule. Defining the same op again with the same schema returns the first
    definition (a reloaded family module); another schema is an error. The first argument is a
    tensor (``Tensor x``): the device its calls are counted on (``kernel_counts``)."""
    name, args = schema.split("(", 1)
    if not args.startswith("Tensor "):
        raise ValueError(f"{NAMESPACE}::{name}: the first argument must be a Tensor, got {schema!r}")
    if name in _OPS:
        if _OPS[name].schema != schema:
            raise ValueError(f"{NAMESPACE}::{name} is already defined as {_OPS[name].schema!r}")
        return _OPS[name]
    _LIB.define(schema)

    def counted_reference(*args):
        _RAN[name, args[0].device.type, REFERENCE] += 1
        return reference(*args)

    _LIB.impl(name, counted_reference, "CompositeExplicitAutograd")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, fake, lib=_LIB)
    setup_context, backward = _recompute_autograd(reference) if differentiable else _no_gradient(name)
    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)
    _OPS[name] = OpDef(name, schema, reference, fake, differentiable)
    return _OPS[name]


def define_composite(name: str, reference: Callable) -> None:
    """Define the composite ``name``: ``reference(*args)`` calls registered ops; kernels fuse them
    (module docstring). Its first argument is a Tensor, as an op's. Defining it again from the same
    function (a reloaded family module) keeps the first definition, as ``define`` does."""
    first = _COMPOSITES.get(name, reference)
    where = (first.__module__, first.__qualname__)
    if name in _OPS or where != (reference.__module__, reference.__qualname__):
        raise ValueError(f"{NAMESPACE}: {name!r} is already defined")
    _COMPOSITES.setdefault(name, reference)


def composite_names() -> list[str]:
    """The composites, in definition order (``op_names`` lists the registered ops)."""
    return list(_COMPOSITES)


_PLAIN = (Tensor, torch.nn.Parameter)


def _plain_eager(args: tuple) -> bool:
    """Whether a call can skip torch's dispatcher without changing what anyone observes: not under
    torch.compile, a JIT trace, a dispatch or function mode; only plain tensors; no gradient."""
    if (
        torch.compiler.is_compiling()
        or torch._C._get_tracing_state() is not None
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, Tensor) and (type(a) not in _PLAIN or (grad and a.requires_grad)):
            return False
    return True


def eager_call(name: str, *args):
    """Run the composite ``name``: its first supporting kernel in a plain eager call, else its
    reference (which dispatches the ops it is made of)."""
    if _plain_eager(args):
        device_type = args[0].device.type
        for kernel in _KERNELS.get((name, device_type), ()):
            if kernel.supports is None or kernel.supports(*args):
                _RAN[name, device_type, kernel.name] += 1
                return kernel.fn(*args)
    return _COMPOSITES[name](*args)


def _check_op(op: str, device_type: str) -> None:
    if op in _COMPOSITES and device_type in DISPATCH_KEYS:
        return
    if op not in _OPS:
        raise KeyError(f"unknown sdkiln op {op!r}; ops: {', '.join(_OPS)}")
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(DISPATCH_KEYS)}")


def op_names() -> list[str]:
    """The ops of the ``sdkiln`` namespace, in definition order."""
    return list(_OPS)


def _dispatcher(op: OpDef, device_type: str, candidates: list[Kernel]) -> Callable:
    def dispatch(*args):
        for kernel in candidates:
            if kernel.accepts(args):
                _RAN[op.name, device_type, kernel.name] += 1
                return kernel.fn(*args)
        _RAN[op.name, device_type, REFERENCE] += 1
        return op.reference(*args)

    return dispatch


def register_kernel(
    op: str, device_type: str, name: str, *, priority: int = 0, supports: Callable[..., bool] | None = None
) -> Callable[[_F], _F]:
    """Decorator: add the function as a kernel of ``sdkiln::<op>`` for tensors on ``device_type``.

    It takes the schema's arguments in order and must match the reference within the tolerances of
    ``tests/kernels``. ``supports(*args)``, when given, says whether it handles these arguments;
    the dispatcher then tries the next kernel and finally the reference. A name is registered once
    per (op, device type); ``remove_kernel`` first.
    """
    _check_op(op, device_type)

    def decorator(fn: _F) -> _F:
        candidates = _KERNELS.setdefault((op, device_type), [])
        if any(k.name == name for k in candidates):
            raise ValueError(
                f"{NAMESPACE}::{op} already has the {device_type} kernel {name!r}; remove_kernel() it first"
            )
        candidates.append(Kernel(name, fn, priority, supports))
        candidates.sort(key=lambda k: -k.priority)  # stable: first registered first among equals
        if op in _OPS and (op, device_type) not in _DISPATCHERS:
            lib = torch.library.Library(NAMESPACE, "IMPL")
            lib.impl(op, _dispatcher(_OPS[op], device_type, candidates), DISPATCH_KEYS[device_type])
            _DISPATCHERS[op, device_type] = lib
        return fn

    return decorator


def remove_kernel(op: str, device_type: str, name: str) -> None:
    """Take the kernel ``name`` of ``op`` for ``device_type`` out; with none left, the reference runs
    there again."""
    _check_op(op, device_type)
    candidates = _KERNELS.get((op, device_type), [])
    if not any(k.name == name for k in candidates):
        raise KeyError(f"{NAMESPACE}::{op} has no {device_type} kernel {name!r} to remove")
    candidates[:] = [k for k in candidates if k.name != name]
    if not candidates:
        del _KERNELS[op, device_type]
        lib = _DISPATCHERS.pop((op, device_type), None)
        if lib is not None:
            lib._destroy()


def kernels(op: str, device_type: str) -> tuple[Kernel, ...]:
    """The kernels of ``op`` for ``device_type``, in the order the dispatcher tries them."""
    _check_op(op, device_type)
    return tuple(_KERNELS.get((op, device_type), ()))


def implementation(op: str, device_type: str, *example_args) -> str:
    """The name of what runs ``sdkiln::<op>`` for tensors on ``device_type``: a kernel or "reference".

    With example arguments (the schema's, in order) each kernel's ``supports`` is asked; without
    them, only a kernel that declares no ``supports`` is certain to run, so the answer is the first
    such kernel (or "reference")."""
    for kernel in kernels(op, device_type):
        if kernel.accepts(example_args) if example_args else kernel.supports is None:
            return kernel.name
    return REFERENCE


def kernel_counts() -> dict[tuple[str, str, str], int]:
    """What ran since the last ``reset_kernel_counts``: (op, device type, kernel name or
    "reference") -> calls. ``sdkiln run --verbose`` prints it."""
    return dict(_RAN)


def reset_kernel_counts() -> None:
    _RAN.clear()


def load_device_kernels(device_type: str) -> list[str]:
    """Import the kernel modules of ``device_type`` (``Platform.kernel_modules``), which register
    their kernels; a second call does nothing more. Returns the modules. The runtime calls it for
    the device a package is loaded onto; call it yourself for a pipeline you built and moved."""
    modules = list(platform_class(device_type).kernel_modules)
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name not in KERNEL_DEPENDENCIES:
                raise
            raise DeviceError(
                f"the {device_type} kernels ({module}) need {err.name}, which is not installed: "
                f"pip install 'sdkiln[{KERNEL_DEPENDENCIES[err.name]}]'"
            ) from None
    return modules
