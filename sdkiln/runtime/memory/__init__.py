"""Running a package within a device memory budget: the planner (``plan``), the sizes it plans from
(``sizes``) and the hooks that carry a plan out (``residency``)."""

from sdkiln.runtime.memory.plan import Plan, Sizes, plan
from sdkiln.runtime.memory.residency import Residency, apply
from sdkiln.runtime.memory.sizes import sizes_of

__all__ = ["Plan", "Residency", "Sizes", "apply", "plan", "sizes_of"]
