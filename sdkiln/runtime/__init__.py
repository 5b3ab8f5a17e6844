"""The thin runtime: verify a package, restore its sections, run it. Never imports the offline modules."""

from sdkiln.runtime.loader import load
from sdkiln.runtime.package import Package, open_package
from sdkiln.runtime.quant import QuantLinear, quant_module, scheme_classes
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear, W8A8Linear

__all__ = [
    "load",
    "open_package",
    "Package",
    "QuantLinear",
    "W8A8DynamicLinear",
    "W8A8Linear",
    "quant_module",
    "scheme_classes",
]
