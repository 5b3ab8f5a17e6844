"""Every user-facing config: boring, versioned, JSON round-trippable (STYLE habit 2).

* ``recipe``: the serializer and allow-list (``RECIPE_STEPS``), ``RecipeStep``, ``Deployment`` and
  ``RecipeConfig``;
* ``quant``: the quantization recipe steps; ``cache``: the cache recipe steps; ``sparse``: block-sparse
  attention and 2:4 weight sparsity;
* ``runtime``: load-time settings (``ParallelConfig``, ``CompileConfig``, ``MemoryConfig``), which are not recipe steps.

Adding a technique is one config class registered with ``register_step`` in its kind's module,
plus its transform in ``sdkiln.optimizer``.
"""

from sdkiln.configs.cache import CacheAutoConfig
from sdkiln.configs.quant import (
    WEIGHT_ROUNDINGS,
    AttentionQuantConfig,
    FP8DynamicConfig,
    QuantAutoConfig,
    QuantStep,
    SmoothQuantConfig,
    TextEncoderQuantConfig,
    W4A16Config,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    W8A8TimestepConfig,
    W8A16Config,
    WeightRounding,
    quant_auto_schemes,
)
from sdkiln.configs.recipe import RECIPE_STEPS, Deployment, RecipeConfig, RecipeStep, register_step
from sdkiln.configs.runtime import CompileConfig, LoraFile, MemoryConfig, ParallelConfig
from sdkiln.configs.sparse import Sparse24Config, SparseAttentionConfig

__all__ = [
    "RECIPE_STEPS",
    "WEIGHT_ROUNDINGS",
    "AttentionQuantConfig",
    "CacheAutoConfig",
    "CompileConfig",
    "LoraFile",
    "MemoryConfig",
    "Deployment",
    "FP8DynamicConfig",
    "ParallelConfig",
    "QuantAutoConfig",
    "QuantStep",
    "RecipeConfig",
    "RecipeStep",
    "SmoothQuantConfig",
    "Sparse24Config",
    "SparseAttentionConfig",
    "TextEncoderQuantConfig",
    "W4A16Config",
    "W8A8DynamicConfig",
    "W8A8StaticConfig",
    "W8A8TimestepConfig",
    "W8A16Config",
    "WeightRounding",
    "quant_auto_schemes",
    "register_step",
]
