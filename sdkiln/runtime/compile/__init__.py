"""Compiling a loaded transformer: sdkiln's torch.compile backend (``Backend``: fusion patterns,
Inductor, CUDA graphs), ``compile_transformer`` (regional or whole) and the compile cache a second
process reuses (``use_compile_cache``). ``CompileConfig`` says how (``sdkiln.configs.runtime``);
``sdkiln.load(path, compile=CompileConfig(...))`` applies it."""

from sdkiln.runtime.compile.backend import Backend, FusionPass, compile_transformer, repeated_blocks
from sdkiln.runtime.compile.cache import use_compile_cache

__all__ = ["Backend", "FusionPass", "compile_transformer", "repeated_blocks", "use_compile_cache"]
