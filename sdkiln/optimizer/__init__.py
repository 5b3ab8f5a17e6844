"""The offline job: recipes of registered steps, the quality report, and ``optimize``."""

from sdkiln.optimizer.optimize import OptimizeResult, optimize
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform

__all__ = ["optimize", "OptimizeResult", "resolve_recipe", "register_transform", "StepContext", "StepResult"]
