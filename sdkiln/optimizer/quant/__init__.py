"""Quantization transforms: ``weights`` (the schemes built from the weight alone, with nearest or
GPTQ rounding), ``w8a8_static`` and ``w8a8_timestep`` (calibrated activation ranges),
``smoothquant`` (prepares an int8 scheme), ``quant_auto`` (a per-layer mix under a quality floor),
and what they share: ``calibration`` and ``gptq``. The layers they take come from
``sdkiln.optimizer.layers``; the modules they build are the runtime classes of
``sdkiln.runtime.quant``."""
