"""The parallel runtime: CFG parallel, Ulysses and ring attention over torch.distributed
(docs/parallel.md). ``sdkiln.load(path, parallel=ParallelConfig(...))`` calls ``enable_parallel``."""

from sdkiln.runtime.parallel.apply import ParallelRuntime, enable_parallel, parallel_runtime
from sdkiln.runtime.parallel.mesh import Mesh, init_mesh, layouts, shutdown

__all__ = [
    "Mesh",
    "ParallelRuntime",
    "enable_parallel",
    "init_mesh",
    "layouts",
    "parallel_runtime",
    "shutdown",
]
