"""Run a cache schedule: named, removable hooks on the unmodified diffusers transformer blocks.

``attach_cache(pipeline, schedule)`` puts one hook on every block of the schedule's block layout
(``sdkiln_cache_block``), one on the transformer (``sdkiln_cache``, which keeps one state per
``cache_context``), and a forward pre-hook and a forward hook on the transformer. Each block hook
either runs its block or, for a block the call's action does not compute, returns what the cached
residual gives:

* the first block of the reused span returns its input plus the span's residual (``out - in``
  recorded at the last ``full`` step, or extrapolated from the last two to first order);
* the other reused blocks return their input unchanged, in the block's output order.

**Decisions are made per call, outside the compiled region.** The forward pre-hook (under
``torch.compiler.disable``) reads the
denoising step from the pipeline's scheduler (``DenoisingStepTracker``, never a call counter),
maps the schedule to the run's sigmas at a run's first step, picks the action of the step for the
call's branch, counts block evaluations and computes an extrapolation weight (a 0-dim tensor). A
``torch.compile``d transformer runs torch's module hooks outside its graph, so the compiled region
sees only the chosen action (a few distinct values, one graph each), the cached tensors and the
weight: no step index, no host sync, no graph break. Block signatures are read once, at attach.

Branches: a pipeline that wraps its calls in ``transformer.cache_context(name)`` (diffusers'
FLUX, Wan, ... pipelines: ``"cond"``/``"uncond"``) gets one state per context name. Without a
context, the calls of one step are told apart by their order within the step (``"batched"`` for
the first, ``"call1"``... after): a pipeline that batches both CFG branches into one call keeps
each sample's residual in its own batch row, so the branches never mix either way.

Buffers are freed after the last step of a run and when a run starts again at step 0. A schedule
with a guard (``guard.py``) checks the stack input's change at each reuse step and runs the step
full when it is unusual: one host sync per reuse step, the decision agreed across ranks, taken in
a ``torch.compiler.disable``d function (one graph break per guarded reuse step under compile).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager
from torch import nn

from sdkiln.errors import StepError
from sdkiln.runtime.cache.guard import WORLD, Guard, agree, input_change
from sdkiln.runtime.cache.schedule import BATCHED, FULL, Action, CacheSchedule
from sdkiln.runtime.denoising import (
    attach_step_tracker,
    detach_step_tracker,
    needs_step_tracker,
    step_tracker,
)
from sdkiln.runtime.parallel.apply import parallel_runtime

MODEL_HOOK = "sdkiln_cache"
BLOCK_HOOK = "sdkiln_cache_block"

Named = dict[str, torch.Tensor]


class BranchState(BaseState):
    """The cached residuals of one branch: span -> the residuals of up to the last two full steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, *args, **kwargs) -> None:
        self.step: int | None = None
        self.full_steps: list[int] = []
        """The last two full steps of this run, oldest first: the residuals' steps."""
        self.span_inputs: dict[tuple[int, int], Named] = {}
        self.residuals: dict[tuple[int, int], list[Named]] = {}
        self.guard_input: torch.Tensor | None = None
        """The stack input at the last full step, which the guard measures change against."""


def _parameter_names(forward) -> tuple[str, ...]:
    return tuple(
        p.name
        for p in inspect.signature(forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


class CacheRunner:
    """Shared by the hooks of one transformer: the schedule, the current call, the counters."""

    def __init__(
        self, pipeline: Any, transformer: nn.Module, schedule: CacheSchedule, guard: Guard | None = None
    ):
        self._pipeline = weakref.ref(pipeline)
        self.transformer = transformer
        self.schedule = schedule
        self.active = schedule
        """The schedule runs follow: the package's, or the one ``use`` set (a LoRA's stepped-up one)."""
        self._run_schedule = schedule
        self.blocks: list[tuple[nn.Module, Any]] = []
        for layout in schedule.blocks:
            blocks = getattr(transformer, layout.attr, None)
            if blocks is None or len(blocks) != layout.count:
                found = "none" if blocks is None else len(blocks)
                raise StepError(
                    f"the cache schedule expects {layout.count} blocks in transformer.{layout.attr}, found {found}"
                )
            forward_args = inspect.signature(blocks[0].forward).parameters
            if (
                len(set(layout.outputs)) != len(layout.outputs)
                or not set(layout.outputs) <= set(layout.inputs)
                or not set(layout.inputs) <= set(forward_args)
            ):
                raise StepError(
                    f"the cache schedule's block layout of transformer.{layout.attr} (inputs {list(layout.inputs)}, "
                    f"outputs {list(layout.outputs)}) does not fit the blocks' forward({', '.join(forward_args)})"
                )
            self.blocks += [(block, layout) for block in blocks]
        self.num_blocks = len(self.blocks)
        self.spans = self._spans(schedule)
        try:
            self.guard = guard if guard is not None else Guard.from_dict(schedule.guards)
        except (KeyError, TypeError, ValueError) as exc:
            raise StepError(f"the cache schedule's guard is invalid: {exc}") from exc
        self._run_guard = self.guard
        self._guard_given = guard is not None
        self.guard_checks = 0
        """Reuse steps whose input change the guard compared with a threshold (calls)."""
        self.guard_forced = 0
        """Of those, the ones it ran full."""
        self.block_evaluations = 0
        self.transformer_calls = 0
        self.forced = 0
        """Calls the schedule had reuse (or extrapolate) that ran full (plain reuse): the first of a run
        for this transformer (``begin_call``)."""
        self.owns_tracker = False
        """attach_cache attached the step tracker, so detach_cache removes it (unless a module needs it)."""
        self._handles: list[Any] = []
        window = schedule.search.get("steps")  # the steps this transformer runs (an expert's window)
        self._window_ends_early = isinstance(window, list) and window[-1:] != [schedule.num_steps - 1]
        self._action: Action = FULL
        self._state: BranchState | None = None
        self._step = 0
        self._branch = BATCHED
        self._weight = torch.zeros((), dtype=torch.float64)
        """The extrapolation weight of the current call's reuse action, a tensor so a compiled graph
        takes it as an input rather than guarding on its value."""

    def _spans(self, schedule: CacheSchedule) -> set[tuple[int, int]]:
        spans = {
            a.cached_span(self.num_blocks) for acts in schedule.actions.values() for a in acts if a != FULL
        }
        for start, end in spans:
            names_in = set(self.blocks[start][1].inputs)
            names_out = set(self.blocks[end - 1][1].outputs)
            if names_in != names_out:
                raise StepError(
                    f"blocks {start}..{end - 1} take {sorted(names_in)} but return {sorted(names_out)}; "
                    "their residual cannot be reused"
                )
        return spans

    def use(self, schedule: CacheSchedule | None) -> None:
        """Follow ``schedule`` from the next run on (None: the package's own again). It must have the
        package schedule's steps and blocks; a run already started keeps its schedule."""
        schedule = self.schedule if schedule is None else schedule
        if schedule.blocks != self.schedule.blocks or schedule.sigmas != self.schedule.sigmas:
            raise StepError("a schedule to use must have the package schedule's steps and block layout")
        self.spans |= self._spans(schedule)
        self.active = schedule

    def reset_counters(self) -> None:
        self.block_evaluations = 0
        self.transformer_calls = 0
        self.forced = 0
        self.guard_checks = self.guard_forced = 0

    # --- one transformer call: outside any compiled region ------------------------------------

    def begin_call(self, step: int, num_steps: int, state: BranchState, branch: str) -> None:
        if step == 0 or state.step is None or step < state.step:
            state.reset()
            self._run_schedule = self._schedule_for_run(num_steps)
            self._run_guard = self._guard_for_run()
        state.step = step
        self._state, self._step, self._branch = state, step, branch
        action = self._run_schedule.action(step, branch)
        # This transformer's first call of a run computes every block, whatever the schedule says:
        # nothing of the run is cached yet (a pipeline's second expert takes over mid-run, its first
        # step mapped by sigma onto a reuse step of a schedule made for another step count); an
        # extrapolation with one full step before it reuses without extrapolating. Counted in `forced`.
        if action != FULL and not state.full_steps:
            action, self.forced = FULL, self.forced + 1
        elif action.extrapolate and len(state.full_steps) < 2:
            action, self.forced = Action(action.kind, action.first, action.last, False), self.forced + 1
        self._action = action
        if action == FULL:
            state.full_steps = [*state.full_steps[-1:], step]
        elif action.extrapolate:
            step0, step1 = state.full_steps
            self._weight = torch.tensor((step - step1) / (step1 - step0), dtype=torch.float64)
        self.transformer_calls += 1
        self.block_evaluations += action.block_evaluations(self.num_blocks)

    def end_call(self, num_steps: int) -> None:
        state, step = self._state, self._step
        if state is not None and step == num_steps - 1:
            state.reset()  # the run is over: free its buffers
        elif (
            state is not None
            and self._window_ends_early
            and all(self._run_schedule.action(j, self._branch) == FULL for j in range(step + 1, num_steps))
        ):
            # a pipeline's expert whose window of the run ends before the run does (Wan2.2-A14B's
            # high-noise one) past its last reuse: free the buffers the other expert's steps would
            # hold, keep the run's step
            state.reset()
            state.step = step
        self._state = None

    def _schedule_for_run(self, num_steps: int) -> CacheSchedule:
        pipeline = self._pipeline()
        sigmas = getattr(getattr(pipeline, "scheduler", None), "sigmas", None)
        if sigmas is None:
            if num_steps != self.active.num_steps:
                raise StepError(
                    f"the cache schedule has {self.active.num_steps} steps, this run {num_steps}, and its "
                    "scheduler has no sigmas to map the schedule by"
                )
            return self.active
        run_sigmas = [float(s) for s in sigmas.detach().cpu().flatten()[:num_steps]]
        try:
            return self.active.for_sigmas(run_sigmas)
        except ValueError as exc:
            raise StepError(f"cannot run the cache schedule on this run's {num_steps} steps: {exc}") from exc

    def _guard_for_run(self) -> Guard | None:
        """The guard for this run's steps: the one given to ``attach_cache`` as it is, else the run
        schedule's thresholds (mapped with its actions when the run has other steps)."""
        if self.guard is None or self._run_schedule is self.schedule or self._guard_given:
            return self.guard
        return Guard.from_dict(self._run_schedule.guards)

    @torch.compiler.disable
    def _guard_action(self, stream: torch.Tensor, action: Action, state: BranchState) -> Action:
        """The guard at the stack input: a reuse step whose input changed unusually runs full (and
        refreshes the caches). It reads the device, so it runs outside any compiled graph."""
        guard = self._run_guard
        parallel = parallel_runtime(self.transformer)
        if parallel is not None:
            stream = parallel.whole_sequence(stream)
        if action != FULL:
            if guard.record:
                guard.observe(self._step, self._branch, input_change(stream, state.guard_input))
            else:
                limit = guard.threshold(self._step, self._branch)
                self.guard_checks += limit is not None
                # every rank that runs this call reaches this at every reuse step (the actions are
                # shared), so all of them join the reduction
                force = agree(
                    limit is not None and bool(input_change(stream, state.guard_input).max() > limit),
                    stream.device,
                    WORLD if parallel is None else parallel.call_group,
                )
                if force:
                    self.guard_forced += 1
                    self.block_evaluations += self.num_blocks - action.block_evaluations(self.num_blocks)
                    state.full_steps = [*state.full_steps[-1:], self._step]
                    action = self._action = FULL
        if action == FULL:
            state.guard_input = stream.detach().clone()
        return action

    # --- one block: what a compiled graph traces ----------------------------------------------

    def block_forward(self, position: int, layout, names: tuple[str, ...], forward, args, kwargs):
        action, state = self._action, self._state
        if state is None:  # called outside a transformer forward (a block on its own)
            return forward(*args, **kwargs)
        inputs = _named_inputs(names, layout.inputs, args, kwargs)
        if position == 0 and self._run_guard is not None:
            action = self._guard_action(inputs[layout.inputs[0]], action, state)
        if action.computes(position, self.num_blocks):
            if action == FULL:
                for span in self.spans:
                    if span[0] == position:
                        state.span_inputs[span] = inputs
            output = forward(*args, **kwargs)
            if action == FULL:
                outputs = _named_outputs(output, layout.outputs)
                for span in self.spans:
                    if span[1] - 1 == position:
                        before = state.span_inputs.pop(span)
                        residual = {k: _difference(outputs[k], before[k]) for k in before}
                        state.residuals[span] = [*state.residuals.get(span, [])[-1:], residual]
            return output
        start, end = action.cached_span(self.num_blocks)
        if position == start:
            residual = self._residual((start, end), action, state)
            inputs = {k: v if residual[k] is None else v + residual[k] for k, v in inputs.items()}
        values = tuple(inputs[name] for name in layout.outputs)
        return values if len(values) > 1 else values[0]

    def _residual(self, span: tuple[int, int], action: Action, state: BranchState) -> Named:
        history = state.residuals[span]
        r1 = history[-1]
        if not action.extrapolate:
            return r1
        r0, w = history[-2], self._weight
        return {k: None if r1[k] is None else r1[k] + (r1[k] - r0[k]) * w for k in r1}


def _difference(out: torch.Tensor | None, before: torch.Tensor) -> torch.Tensor | None:
    """A stream's residual; None where the span's last block ends the stream (SD3's last block
    returns no text states): a reused span then passes that stream through, which nothing reads."""
    return None if out is None else out - before


def _named_inputs(positional: tuple[str, ...], names: tuple[str, ...], args, kwargs) -> Named:
    out = {}
    for name in names:
        if name in kwargs:
            out[name] = kwargs[name]
        elif name in positional and positional.index(name) < len(args):
            out[name] = args[positional.index(name)]
        else:
            raise StepError(f"the cache hook found no {name!r} among the block's arguments")
    return out


def _named_outputs(output, names: tuple[str, ...]) -> Named:
    values = output if isinstance(output, tuple) else (output,)
    if len(values) != len(names):
        raise StepError(f"a block returned {len(values)} values, its layout names {len(names)}: {names}")
    return dict(zip(names, values, strict=True))


class _ModelHook(ModelHook):
    """Keeps one ``BranchState`` per ``cache_context`` name (diffusers sets the context on every
    stateful hook's manager) or per call order within a step; the decisions are the runner's, in
    the transformer's forward pre-hook."""

    _is_stateful = True

    def __init__(self, runner: CacheRunner, tracker):
        super().__init__()
        self.runner = runner
        self.tracker = tracker
        self.contexts = StateManager(BranchState)
        self.plain: dict[str, BranchState] = {}
        self._last_step: int | None = None
        self._calls_at_step = 0

    @torch.compiler.disable
    def before_call(self, module, args) -> None:
        """The transformer's forward pre-hook: every decision of the call, outside any compiled graph."""
        self.tracker.update()
        step, num_steps = self.tracker.step, self.tracker.num_steps
        if self.contexts._context is not None:
            branch = self.contexts._context.name
            state = self.contexts.get_state()
        else:
            self._calls_at_step = self._calls_at_step + 1 if step == self._last_step else 0
            branch = BATCHED if self._calls_at_step == 0 else f"call{self._calls_at_step}"
            state = self.plain.setdefault(branch, BranchState())
        self._last_step = step
        self.runner.begin_call(step, num_steps, state, branch)

    @torch.compiler.disable
    def after_call(self, module, args, output) -> None:
        self.runner.end_call(self.tracker.num_steps)

    def reset_state(self, module):
        self.contexts.reset()
        self.plain.clear()
        self._last_step = None
        return module


class _BlockHook(ModelHook):
    def __init__(self, runner: CacheRunner, position: int, layout, names: tuple[str, ...]):
        super().__init__()
        self.runner, self.position, self.layout, self.names = runner, position, layout, names

    def new_forward(self, module, *args, **kwargs):
        return self.runner.block_forward(
            self.position, self.layout, self.names, self.fn_ref.original_forward, args, kwargs
        )


def _unwrapped(transformer: nn.Module) -> nn.Module:
    return getattr(transformer, "_orig_mod", transformer)


def attach_cache(
    pipeline: Any, schedule: CacheSchedule, transformer_attr: str = "transformer", guard: Guard | None = None
) -> CacheRunner:
    """Make ``pipeline``'s transformer follow ``schedule``; returns the runner (its counters:
    ``block_evaluations``, ``transformer_calls``, ``guard_checks`` and ``guard_forced``). ``guard``
    replaces the schedule's own (a recording guard calibrates one). ``detach_cache`` undoes it."""
    transformer = _unwrapped(getattr(pipeline, transformer_attr))
    if cache_runner(transformer) is not None:
        raise StepError("this transformer already follows a cache schedule; detach_cache(transformer) first")
    if parallel_runtime(transformer) is not None:
        raise StepError(
            "this transformer runs on a device mesh: a cache schedule attaches before the parallel runtime "
            "(sdkiln.load restores a package's schedule first), so that its hooks see this rank's shard"
        )
    runner = CacheRunner(pipeline, transformer, schedule, guard)
    runner.owns_tracker = step_tracker(transformer) is None
    tracker = attach_step_tracker(pipeline, transformer_attr)
    for position, (block, layout) in enumerate(runner.blocks):
        names = _parameter_names(block.forward)
        HookRegistry.check_if_exists_or_initialize(block).register_hook(
            _BlockHook(runner, position, layout, names), BLOCK_HOOK
        )
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    model_hook = _ModelHook(runner, tracker)
    registry.register_hook(model_hook, MODEL_HOOK)
    if hasattr(registry, "invalidate_child_registries_cache"):  # so cache_context finds the block hooks
        registry.invalidate_child_registries_cache()
    runner._handles = [
        transformer.register_forward_pre_hook(model_hook.before_call),
        transformer.register_forward_hook(model_hook.after_call),
    ]
    return runner


def cache_runner(transformer: nn.Module) -> CacheRunner | None:
    registry = getattr(_unwrapped(transformer), "_diffusers_hook", None)
    hook = None if registry is None else registry.get_hook(MODEL_HOOK)
    return None if hook is None else hook.runner


def reset_cache(transformer: nn.Module) -> None:
    """Drop every cached tensor of ``transformer``'s cache runner (if it has one): the next call
    starts from an empty cache whatever its step."""
    transformer = _unwrapped(transformer)
    if cache_runner(transformer) is not None:
        transformer._diffusers_hook.get_hook(MODEL_HOOK).reset_state(transformer)


def detach_cache(transformer: nn.Module) -> None:
    """Remove every cache hook from ``transformer`` and its blocks and drop the cached tensors."""
    transformer = _unwrapped(transformer)
    runner = cache_runner(transformer)
    if runner is None:
        return
    hook = transformer._diffusers_hook.get_hook(MODEL_HOOK)
    hook.reset_state(transformer)
    for handle in runner._handles:
        handle.remove()
    transformer._diffusers_hook.remove_hook(MODEL_HOOK, recurse=False)
    for block, _ in runner.blocks:
        block._diffusers_hook.remove_hook(BLOCK_HOOK, recurse=False)
    if runner.owns_tracker and not needs_step_tracker(transformer):
        detach_step_tracker(transformer)
