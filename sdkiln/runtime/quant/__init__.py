"""Runtime modules that replace ``nn.Linear`` in a quantized transformer, one file per scheme.

The manifest names a scheme (and its parameters) per layer; ``quant_module(scheme)`` imports the
module class that runs it. Every class follows one contract:

* ``scheme``: the Ascend quant type it implements (``W8A8_DYNAMIC``, ``W8A8``, ...);
* ``__init__(in_features, out_features, bias, dtype, device, **params)``: empty buffers, so the
  runtime can build it on the meta device; ``params`` are the manifest entry's other keys;
* ``params() -> dict``: what the manifest must record to rebuild it (e.g. ``group_size``);
* state-dict names are the Ascend tensor names (``weight``, ``weight_scale``, ``input_scale``, ...).
"""

from __future__ import annotations

import importlib

from torch import nn

SCHEME_MODULES = {
    "W8A8_DYNAMIC": "sdkiln.runtime.quant.w8a8_dynamic",
    "W8A8": "sdkiln.runtime.quant.w8a8_static",
    "W8A8_TIMESTEP": "sdkiln.runtime.quant.w8a8_timestep",
    "FP8_DYNAMIC": "sdkiln.runtime.quant.fp8_dynamic",
    "W8A16": "sdkiln.runtime.quant.weight_only",
    "W4A16": "sdkiln.runtime.quant.weight_only",
}
QUANT_MODULES: dict[str, type[nn.Module]] = {}


def register_quant_module(cls: type[nn.Module]) -> type[nn.Module]:
    if QUANT_MODULES.get(cls.scheme, cls) is not cls:
        raise ValueError(f"scheme {cls.scheme} is registered twice")
    QUANT_MODULES[cls.scheme] = cls
    return cls


def quant_module(scheme: str) -> type[nn.Module]:
    """The runtime module class for ``scheme``; KeyError if this sdkiln does not run it."""
    if scheme not in QUANT_MODULES and scheme in SCHEME_MODULES:
        importlib.import_module(SCHEME_MODULES[scheme])
    return QUANT_MODULES[scheme]
