"""Calibration: forward_loop capture and observers. W8A8_DYNAMIC needs none; static schemes add it."""
