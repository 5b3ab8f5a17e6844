"""Calibration: the ``forward_loop(pipeline)`` contract and its default (``loop``), and streaming
observers of layer inputs, per tensor, per channel and per denoising step (``observers``).
W8A8_DYNAMIC needs none; SmoothQuant, W8A8 static and W8A8_TIMESTEP calibrate through these."""
