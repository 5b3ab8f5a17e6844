"""The thin runtime: verify a package, build its pipeline, run it. Never imports the offline modules."""

from sdkiln.runtime.loader import load
from sdkiln.runtime.package import Package, open_package
from sdkiln.runtime.quant import QUANT_MODULES, quant_module
from sdkiln.runtime.quant.w8a8_dynamic import W8A8Linear

__all__ = ["load", "open_package", "Package", "W8A8Linear", "QUANT_MODULES", "quant_module"]
