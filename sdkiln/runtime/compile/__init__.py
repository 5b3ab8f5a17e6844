"""Compiling a loaded transformer: sdkiln's torch.compile backend (``Backend``: fusion patterns,
Inductor, CUDA graphs) and ``compile_transformer`` (regional or whole). ``CompileConfig`` says how
(``sdkiln.configs.runtime``); ``sdkiln.load(path, compile=CompileConfig(...))`` applies it."""

from sdkiln.runtime.compile.backend import Backend, FusionPass, compile_transformer, repeated_blocks

__all__ = ["Backend", "FusionPass", "compile_transformer", "repeated_blocks"]
