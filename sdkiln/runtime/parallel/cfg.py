"""CFG parallel: the two guidance branches of every denoising step on the two cfg ranks.

The outermost hook on the transformer (``ParallelHook``) sees each call the pipeline makes.
diffusers' pipelines call the transformer once per branch, inside ``cache_context("cond")`` and
``cache_context("uncond")`` (``"pred_cond"`` and ``"pred_uncond"`` where a guider component runs
the branches: HunyuanVideo-1.5), and combine the two outputs only after both calls: cfg rank 0
computes the ``cond`` call, cfg rank 1 the ``uncond`` call, and at the ``uncond`` call the two
outputs are exchanged with one all-gather. Rank 1's ``cond`` call returns at once with a
placeholder (an empty tensor until filled) that the exchange fills in place before the pipeline reads it;
rank 0's ``uncond`` call returns rank 1's output. Every rank then applies guidance and the
scheduler step to the same tensors, so the latents stay identical. A pipeline that batches both
branches into one call (SD3) has its batch halved: each cfg rank computes its half and one
all-gather restores the batch. Each branch is evaluated with the shapes a single device uses for it
(FLUX, Wan and the embedded model call once per branch), so the result is bit-identical; a halved
batch is not the shape one device uses, and its GEMMs round differently (sd3-tiny on CPU: within
1e-6 of one device, not bitwise).

The hook also records which ranks run the current call (``call_group``: the guard agrees only
among them) and turns a failed collective into one ``ParallelError`` naming the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from diffusers.hooks.hooks import BaseState, StateManager
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from sdkiln.errors import ParallelError, SdkilnError
from sdkiln.runtime.parallel.mesh import Mesh, all_gather

HOOK = "sdkiln_parallel"
COND = ("cond", "pred_cond")
"""The cache contexts of the conditional branch: diffusers' pipelines, and its guiders (HunyuanVideo-1.5)."""
UNCOND = ("uncond", "pred_uncond")


class _Context(BaseState):
    def reset(self, *args, **kwargs) -> None:
        pass


def _sample(output) -> torch.Tensor:
    if isinstance(output, tuple):
        return output[0]
    if isinstance(output, Transformer2DModelOutput):
        return output.sample
    if isinstance(output, torch.Tensor):
        return output
    raise ParallelError(
        f"CFG parallel exchanges the transformer's output; it returned {type(output).__name__}"
    )


def _with_sample(like, sample: torch.Tensor):
    if isinstance(like, tuple):
        return (sample, *like[1:])
    if isinstance(like, Transformer2DModelOutput):
        return Transformer2DModelOutput(sample=sample)
    return sample


class ParallelHook(ModelHook):
    _is_stateful = True

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self.contexts = StateManager(_Context)
        self.call_group = mesh.sequence_group
        """The ranks that run the current call: a process group (``dist.group.WORLD`` for a batched
        CFG call, which every rank runs), or None (this rank alone)."""
        self._pending: torch.Tensor | None = None
        """cfg rank 1: the placeholder it returned for the ``cond`` call, filled at ``uncond``."""
        self._cond = None
        """cfg rank 0: its ``cond`` output, sent at ``uncond``."""

    def reset_state(self, module):
        self._pending = self._cond = None
        return module

    def new_forward(self, module, *args, **kwargs):
        try:
            return self._forward(args, kwargs)
        except BaseException as exc:
            self.reset_state(module)  # the next pipeline call starts clean whatever stopped this one
            if isinstance(exc, SdkilnError) or not _is_collective_failure(exc):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ParallelError(
                f"rank {self.mesh.rank}: a collective with the other ranks failed ({type(exc).__name__}: {first}); "
                "a peer process exited, or did not answer within the timeout"
            ) from None

    def _forward(self, args, kwargs):
        forward, mesh = self.fn_ref.original_forward, self.mesh
        context = self.contexts._context
        name = None if context is None else context.name
        self.call_group = mesh.sequence_group  # a branch's call runs on its sequence ranks
        if mesh.config.cfg == 1:
            return forward(*args, **kwargs)
        if name in COND:
            if self._pending is not None or self._cond is not None:
                raise ParallelError(
                    "CFG parallel: a 'cond' call came without the 'uncond' call of the step before it; "
                    "CFG parallel needs guidance on (both branches every step): run without --cfg-parallel"
                )
            if mesh.cfg_rank == 0:
                self._cond = forward(*args, **kwargs)
                return self._cond
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._pending = torch.empty(0, dtype=hidden.dtype, device=hidden.device)
            return (
                (self._pending,)
                if kwargs.get("return_dict", True) is False
                else Transformer2DModelOutput(sample=self._pending)
            )
        if name in UNCOND:
            if mesh.cfg_rank == 1:
                if self._pending is None:
                    raise ParallelError("CFG parallel: an 'uncond' call without the 'cond' call before it")
                out = forward(*args, **kwargs)
                cond, _ = self._exchange(_sample(out)).unbind(0)
                if cond.dtype != self._pending.dtype:
                    raise ParallelError(
                        f"CFG parallel: the transformer returned {cond.dtype} for {self._pending.dtype} "
                        "latents; the cond output it stands in for must keep the latents' dtype"
                    )
                self._pending.resize_(cond.shape).copy_(cond)
                self._pending = None
                return out
            if self._cond is None:
                raise ParallelError("CFG parallel: an 'uncond' call without the 'cond' call before it")
            cond_out, self._cond = self._cond, None
            _, uncond = self._exchange(_sample(cond_out)).unbind(0)
            return _with_sample(cond_out, uncond)
        return self._batched(forward, args, kwargs)

    def _exchange(self, sample: torch.Tensor) -> torch.Tensor:
        return all_gather(sample, self.mesh.cfg_group, 2)

    def _batched(self, forward, args, kwargs):
        """One call with both branches in its batch: each cfg rank computes its half."""
        self.call_group = dist.group.WORLD
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch = hidden.shape[0]
        if batch % 2:
            raise ParallelError(
                f"CFG parallel halves a call that batches both guidance branches; this call's batch is {batch}"
            )
        lo, half = self.mesh.cfg_rank * (batch // 2), batch // 2

        def halve(x):
            return (
                x.narrow(0, lo, half) if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch else x
            )

        out = forward(*(halve(a) for a in args), **{k: halve(v) for k, v in kwargs.items()})
        return _with_sample(out, torch.cat(self._exchange(_sample(out)).unbind(0), dim=0))


def _is_collective_failure(exc: BaseException) -> bool:
    """A failure of the process group (a peer gone, a timeout), not an error of the model's code."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(
        word in text for word in ("gloo", "nccl", "hccl", "connection", "timed out", "timeout", "peer")
    )
