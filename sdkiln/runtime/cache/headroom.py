"""What a cache schedule does when the model it runs on is no longer the one it was searched on.

A package's schedule was searched on the package's own model. A LoRA (``runtime.lora``) changes the
model, and with it how much each reuse step loses: on the embedded model a strong LoRA takes 1 to 2.4
dB more from the same schedule (``docs/benchmarks.md``, LoRA), and the cache guard does not see it (it
watches the stack's input, which a LoRA barely moves). The policy decides what runs while the model
is changed:

* ``headroom`` (default): the cheapest schedule of the search's confirmed front whose calibration
  PSNR (mean and 5th percentile) is ``margin_db`` above the package schedule's
  (``CacheSchedule.stepped_up``); the package's schedule again once the model is back. A schedule
  without a front (hand-made) stays as it is, with a warning.
* ``keep``: the package's schedule.
* ``off``: every step full.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from sdkiln.errors import PackageError, SdkilnError
from sdkiln.runtime.cache.hooks import cache_runner
from sdkiln.runtime.cache.schedule import FULL, CacheSchedule

log = logging.getLogger("sdkiln.load")

POLICIES = ("headroom", "keep", "off")
DEFAULT_MARGIN_DB = 3.0
"""Measured on the embedded model (``bench/lora.py``): the first front schedule 3 dB or more above the
package's keeps a strength-1 LoRA's output at or above the package's PSNR without it."""


def check_policy(policy: str, margin_db: float | None) -> None:
    """One error for a policy or margin this module does not know (a margin of None: the default)."""
    if policy not in POLICIES:
        raise SdkilnError(f"cache policy under a LoRA must be one of {', '.join(POLICIES)}; got {policy!r}")
    if margin_db is not None and (not isinstance(margin_db, int | float) or not 0 <= margin_db <= 100):
        raise SdkilnError(f"cache headroom margin must be a number of dB in [0, 100], got {margin_db!r}")


def follow(
    transformer: nn.Module, changed: bool, policy: str, margin_db: float | None = None
) -> CacheSchedule | None:
    """Make ``transformer``'s cache runner (if it has one) follow ``policy``: the package's schedule
    when ``changed`` is false, else the policy's (``margin_db`` None: ``DEFAULT_MARGIN_DB``). Returns
    the schedule the next run follows (None without a cache runner). A change is logged once, on
    ``sdkiln.load``."""
    margin_db = DEFAULT_MARGIN_DB if margin_db is None else float(margin_db)
    runner = cache_runner(transformer)
    if runner is None:
        return None
    package = runner.schedule
    target = package
    if changed and policy == "off":
        target = dataclasses.replace(
            package, actions={b: [FULL] * package.num_steps for b in package.actions}, guards={}, expected={}
        )
    elif changed and policy == "headroom":
        try:
            stepped = package.stepped_up(margin_db)
        except ValueError as exc:
            raise PackageError(f"the cache schedule's search.front is invalid: {exc}") from exc
        if stepped is None:
            if runner.active is package and not getattr(runner, "_warned_no_headroom", False):
                runner._warned_no_headroom = True
                log.warning(
                    "the model changed (a LoRA) but the cache schedule has no safer schedule %.1f dB above "
                    "it on its search front; it runs as searched (set_cache_policy('off') runs every step)",
                    margin_db,
                )
        elif stepped.actions != package.actions:
            target = stepped
    if target.actions == runner.active.actions:
        return runner.active
    runner.use(target)
    if target is package:
        log.info(
            "cache schedule: the package's again (%.2f of the block evaluations)",
            package.block_evaluations_ratio(),
        )
    elif policy == "off":
        log.info("cache schedule off while a LoRA is active: every step computes")
    else:
        up = target.search["stepped_up"]
        log.info(
            "cache schedule stepped up while a LoRA is active: %.2f -> %.2f of the block evaluations "
            "(calibration PSNR %.1f -> %.1f dB); the package's was searched without the LoRA",
            up["from"]["block_evaluations_ratio"],
            up["to"]["block_evaluations_ratio"],
            up["from"]["psnr_mean"],
            up["to"]["psnr_mean"],
        )
    return target
