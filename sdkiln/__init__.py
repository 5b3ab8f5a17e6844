"""sdkiln: optimize diffusion models offline into packages; load and run them with a thin runtime.

``import sdkiln`` is light: the offline job (``optimize``), the runtime (``load``) and the config
classes import on first use, and neither triton nor torch_npu is imported unless a kernel for them
is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "optimize",
    "load",
    "RecipeConfig",
    "Deployment",
    "CompileConfig",
    "ParallelConfig",
    "MemoryConfig",
    "W8A8DynamicConfig",
    "__version__",
]
_CONFIGS = __all__[2:-1]

if TYPE_CHECKING:
    from sdkiln.configs import (
        CompileConfig,
        Deployment,
        MemoryConfig,
        ParallelConfig,
        RecipeConfig,
        W8A8DynamicConfig,
    )
    from sdkiln.optimizer import optimize
    from sdkiln.runtime import load


def __getattr__(name: str) -> Any:
    if name == "optimize":
        from sdkiln.optimizer import optimize

        return optimize
    if name == "load":
        from sdkiln.runtime import load

        return load
    if name in _CONFIGS:
        from sdkiln import configs

        return getattr(configs, name)
    raise AttributeError(f"module 'sdkiln' has no attribute {name!r}")
