"""Calibration: the ``forward_loop(pipeline)`` contract and its default (``loop``), streaming
observers of layer inputs, per tensor, per channel and per denoising step (``observers``), and
streaming input second moments for GPTQ rounding (``hessian``). W8A8_DYNAMIC with nearest rounding
needs none; SmoothQuant, W8A8 static, W8A8_TIMESTEP and every GPTQ-rounded scheme calibrate
through these."""
