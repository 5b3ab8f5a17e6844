"""Sparsity (sparse attention calibration, weight sparsity). No technique ships here yet."""
