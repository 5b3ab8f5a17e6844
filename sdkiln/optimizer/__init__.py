"""The offline job: recipes of registered transforms, the quality report, and ``optimize``.

``quant/`` and ``cache/`` hold the techniques (one transform a file, registered for its recipe
step config); ``layers.py`` chooses the Linear layers every quantization transform takes.
"""

from sdkiln.optimizer.optimize import OptimizeResult, optimize
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform

__all__ = [
    "optimize",
    "OptimizeResult",
    "resolve_recipe",
    "register_transform",
    "TransformContext",
    "TransformResult",
]
