"""Cache recipe steps: a static cache schedule searched on measured output error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sdkiln.configs.recipe import RecipeStep, register_step


@register_step
@dataclass
class CacheAutoConfig(RecipeStep):
    """A static cache schedule searched on measured output error (``sdkiln.optimizer.cache.search``),
    for the recipe's deployment (its denoising steps, guidance and resolution).

    The schedule runs ``actions`` (``skip``, ``partial:F:B``) for at most ``max_reuse`` steps in a row
    after a full step; the first ``min_full`` steps and the last step are full. Candidates come from
    ``budgets`` block-evaluation budgets in the search's dynamic program and from the fixed-interval family;
    each is confirmed end to end on ``calib_samples`` calibration samples, then up to ``refine`` more
    confirmations (``refine_tries`` neighbours per round) refine the cheapest one meeting the floor.
    The chosen schedule is the cheapest confirmed one whose mean PSNR against the uncached model on
    the calibration samples is at least ``psnr_floor_db`` and whose 5th percentile is at least
    ``psnr_p5_floor_db``, and which meets the same floor on ``eval_samples`` held-out samples, its
    mean less ``held_out_margin_se`` standard errors of that mean (else the next safer schedule of the
    front is measured there, up to ``held_out_retries`` times); a borderline result is measured again on
    ``held_out_extend`` more held-out samples.
    """

    kind: ClassVar[str] = "cache_auto"
    order: ClassVar[int] = 50
    transform_module: ClassVar[str] = "sdkiln.optimizer.cache.search"
    actions: tuple[str, ...] = ("skip", "skip~", "partial:1:1")
    max_reuse: int = 4
    min_full: int = 1
    psnr_floor_db: float = 30.0
    psnr_p5_floor_db: float = 25.0
    calib_samples: int = 4
    eval_samples: int = 8
    budgets: int = 16
    refine: int = 12
    refine_tries: int = 3
    held_out_retries: int = 4
    """When the chosen schedule misses the floor on the held-out samples, up to this many safer schedules
    of the confirmed front are measured there too, the first that meets it chosen. Each costs one run
    of the held-out samples (8: two runs of the calibration batch), a few percent of a search; four
    calibration samples can order neighbouring front points wrongly, so a step or two may not do."""
    held_out_margin_se: float = 1.0
    """The held-out check asks the mean PSNR less this many standard errors of the mean (the samples'
    standard deviation over the square root of their count) to meet the floor: a mean of eight samples
    whose PSNRs spread by 4 dB is uncertain by about 1.4 dB. 0 checks the mean alone."""
    held_out_extend: int = 8
    """A schedule that meets the held-out check by less than another ``held_out_margin_se`` standard errors
    (its mean less twice the margin misses the floor) is measured on this many more held-out samples
    (other seeds), and the check is made again on all of them: a borderline result costs more samples,
    a clear one none. 0 never extends."""
    guard: bool = False
    """Ship a guard (``runtime.cache.guard``): a reuse step whose stack input changed more than
    ``guard_quantile`` of the calibration samples' change at that step times ``guard_margin`` runs full."""
    guard_quantile: float = 1.0
    guard_margin: float = 1.5
    candidates: tuple[str, ...] = ()
    """Schedules confirmed beside the search's own candidates, each the actions of the transformer's
    steps joined by commas (``full,skip,full,...``): a search started from another package's front
    (``optimize --match-quality``). One that does not fit the search (its step count, its actions,
    ``min_full``, ``max_reuse``) is left out with a note."""

    def __post_init__(self) -> None:
        from sdkiln.runtime.cache.schedule import Action  # the runtime owns the action grammar

        self.actions = tuple(str(a) for a in self.actions)
        if not self.actions:
            raise ValueError("cache_auto needs at least one reuse action (skip, partial:F:B)")
        for a in self.actions:
            if Action.parse(a).kind == "full":
                raise ValueError(
                    "cache_auto actions are the reuse actions (skip, partial:F:B); full is implied"
                )
        if self.max_reuse < 1 or self.min_full < 1:
            raise ValueError("max_reuse and min_full must be >= 1")
        if self.calib_samples < 1 or self.eval_samples < 1:
            raise ValueError("calib_samples and eval_samples must be >= 1")
        if self.budgets < 1 or self.refine < 0 or self.refine_tries < 1 or self.held_out_retries < 0:
            raise ValueError("need budgets >= 1, refine >= 0, refine_tries >= 1 and held_out_retries >= 0")
        if not self.held_out_margin_se >= 0.0:
            raise ValueError("held_out_margin_se must be >= 0")
        if (
            isinstance(self.held_out_extend, bool)
            or not isinstance(self.held_out_extend, int)
            or self.held_out_extend < 0
        ):
            raise ValueError(f"held_out_extend must be an integer >= 0, got {self.held_out_extend!r}")
        if not 0.0 < self.guard_quantile <= 1.0 or self.guard_margin < 1.0:
            raise ValueError("need 0 < guard_quantile <= 1 and guard_margin >= 1")
        self.candidates = tuple(self.candidates)
        for c in self.candidates:
            if not isinstance(c, str) or not c:
                raise ValueError(f"a cache_auto candidate is a comma-joined action list, got {c!r}")
            for a in c.split(","):
                Action.parse(a)  # a ValueError naming the action
