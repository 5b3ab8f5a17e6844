"""Block-sparse attention at run time: the plan a package carries (``plan``), the tiling of image
tokens into local blocks (``tiling``), the block selection (``selection``), the ``"sparse"``
attention backend that runs them (``attention``), putting it on a pipeline (``apply``) and the
``sparse_attention`` package section (``restore``). Calibrating a plan is ``sdkiln.sparsify``'s."""

from sdkiln.runtime.sparse.apply import attach_sparse_attention, detach_sparse_attention, sparse_attention_of
from sdkiln.runtime.sparse.plan import PLAN_FILE, SparseAttentionPlan

__all__ = [
    "PLAN_FILE",
    "SparseAttentionPlan",
    "attach_sparse_attention",
    "detach_sparse_attention",
    "sparse_attention_of",
]
