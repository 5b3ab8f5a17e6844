"""``optimize --match-quality PACKAGE``: make a package whose cache is at least as good as another's.

A cache search chooses the cheapest schedule meeting its floor, so two searches under the same floor
land where their fronts happen to step over it: the embedded model's default package lands 4 dB above
its 30 dB floor and the same recipe with a LoRA fused lands 1-2 dB above it (``docs/benchmarks.md``,
LoRA). A user making variants of a published package (a fused LoRA, a fine-tune, another
quantization) wants each as good as the package it replaces, not merely above the recipe's floor.

``QualityTarget`` reads that package's cache search (the package is opened and the files read are
verified; the weights are not read) and:

* raises the recipe's ``cache_auto`` floors to its held-out result less ``slack_db`` (the mean PSNR
  against the uncached model and the 5th percentile; a floor is only ever raised);
* measures the held-out check on at least as many held-out samples as the target's (the same prompts
  and seeds: the held-out samples are the family's eval prompts with seeds counted from 10000, so the
  two packages are compared sample by sample);
* gives the search its confirmed front as candidates, confirmed on this model beside the search's own
  (a related model's good schedules are likely good here: on the embedded model the default package's
  schedules keep a LoRA'd model closer to its float output than the LoRA'd model's own search finds);
* refuses a package of another family or variant, one made for another call (steps, guidance,
  resolution), one without a searched schedule, a recipe without a cache search, and a pipeline with
  expert transformers (each has its own schedule; not built).

The manifest records the target (``recipe.quality_target``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs import CacheAutoConfig
from sdkiln.configs.recipe import RecipeConfig
from sdkiln.errors import PackageError, RecipeError
from sdkiln.model_zoo import ModelSpec
from sdkiln.runtime.cache.restore import schedule_file
from sdkiln.runtime.cache.schedule import CacheSchedule
from sdkiln.runtime.package import open_package

DEFAULT_SLACK_DB = 1.0
"""How far under the target's held-out PSNR the floor goes. The held-out check asks the mean less one
standard error to meet the floor, so a package that passes measured about as well as the target."""

CALL_FIELDS = ("steps", "guidance", "resolution")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PackageError(f"{where} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class QualityTarget:
    package: str
    digest: str
    family: str
    variant: str
    call: dict[str, Any]
    """The target's search deployment: ``steps``, ``guidance``, ``resolution`` (``PromptLoop.record``)."""
    psnr_mean_db: float
    psnr_p5_db: float
    samples: int
    block_evaluations_ratio: float
    front: tuple[str, ...]
    """Its confirmed front, each schedule comma-joined (``CacheAutoConfig.candidates``)."""
    slack_db: float = DEFAULT_SLACK_DB

    @classmethod
    def read(cls, path: str | os.PathLike, slack_db: float = DEFAULT_SLACK_DB) -> QualityTarget:
        if isinstance(slack_db, bool) or not isinstance(slack_db, int | float) or not 0 <= slack_db <= 50:
            raise RecipeError(f"the match slack must be a number of dB in [0, 50], got {slack_db!r}")
        if not Path(path).is_dir():
            raise PackageError(f"--match-quality: {path} is not a package directory")
        pkg = open_package(path)
        manifest = pkg.manifest
        where = f"--match-quality {path}"
        if manifest.get("experts"):
            raise RecipeError(
                f"{where}: the package has expert transformers, each with its own cache schedule; "
                "matching them is not built"
            )
        rel = schedule_file(manifest)
        if rel is None:
            raise RecipeError(f"{where}: the package has no cache schedule, so no cache quality to match")
        schedule = CacheSchedule.from_dict(pkg.read_json(rel), rel)
        search, expected = schedule.search, schedule.expected
        if not search or not expected or not isinstance(search.get("front"), list):
            raise RecipeError(
                f"{where}: its cache schedule was not searched (no held-out result and front to match)"
            )
        calibration = search.get("calibration")
        if not isinstance(calibration, dict) or not all(k in calibration for k in CALL_FIELDS):
            raise PackageError(f"{where}: {rel}: search.calibration lacks {', '.join(CALL_FIELDS)}")
        front = []
        for i, point in enumerate(search["front"]):
            actions = point.get("actions") if isinstance(point, dict) else None
            if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
                raise PackageError(f"{where}: {rel}: search.front[{i}].actions is not a list of actions")
            front.append(",".join(actions))
        model = manifest["model"]
        prompts = expected.get("prompts")
        return cls(
            package=str(path),
            digest=pkg.digest,
            family=model["family"],
            variant=model.get("variant") or "",
            call={k: calibration[k] for k in CALL_FIELDS},
            psnr_mean_db=_number(expected.get("psnr_mean"), f"{where}: {rel}: expected.psnr_mean"),
            psnr_p5_db=_number(expected.get("psnr_p5"), f"{where}: {rel}: expected.psnr_p5"),
            samples=len(prompts) if isinstance(prompts, list) else 0,
            block_evaluations_ratio=_number(
                expected.get("block_evaluations_ratio"), f"{where}: {rel}: expected.block_evaluations_ratio"
            ),
            front=tuple(front),
            slack_db=float(slack_db),
        )

    def check(self, spec: ModelSpec, call: dict[str, Any]) -> None:
        """Refuse a model or a deployment other than the target's: their PSNRs would not compare."""
        where = f"--match-quality {self.package}"
        if (spec.family, spec.variant) != (self.family, self.variant):
            theirs = self.family + (f" {self.variant}" if self.variant else "")
            ours = spec.family + (f" {spec.variant}" if spec.variant else "")
            raise RecipeError(f"{where}: that package is {theirs}, this model is {ours}")
        ours = PromptLoop(spec, 1, call).record()
        for k in CALL_FIELDS:
            if ours[k] != self.call[k]:
                raise RecipeError(
                    f"{where}: that package was made for {k} {self.call[k]!r}, this one for {ours[k]!r}: "
                    "their cache quality does not compare (give the same --steps, --guidance, --height, --width)"
                )

    def floors(self, config: CacheAutoConfig) -> tuple[float, float]:
        return (
            max(config.psnr_floor_db, round(self.psnr_mean_db - self.slack_db, 2)),
            max(config.psnr_p5_floor_db, round(self.psnr_p5_db - self.slack_db, 2)),
        )

    def apply(self, recipe: RecipeConfig) -> RecipeConfig:
        """The recipe with each ``cache_auto`` step's floors raised and the target's front given."""
        if not any(isinstance(s, CacheAutoConfig) for s in recipe.steps):
            raise RecipeError(
                f"--match-quality matches a cache search's quality; the recipe {recipe.name!r} has no "
                "cache_auto step (add +cache-auto)"
            )
        steps = []
        for step in recipe.steps:
            if isinstance(step, CacheAutoConfig):
                mean, p5 = self.floors(step)
                given = tuple(dict.fromkeys([*step.candidates, *self.front]))
                step = dataclasses.replace(
                    step,
                    psnr_floor_db=mean,
                    psnr_p5_floor_db=p5,
                    candidates=given,
                    eval_samples=max(step.eval_samples, self.samples),
                )
            steps.append(step)
        return dataclasses.replace(recipe, steps=steps)

    def record(self) -> dict[str, Any]:
        """``recipe.quality_target`` in the manifest."""
        return {
            "package": self.package,
            "digest": self.digest,
            "held_out": {
                "psnr_mean_db": self.psnr_mean_db,
                "psnr_p5_db": self.psnr_p5_db,
                "samples": self.samples,
                "block_evaluations_ratio": self.block_evaluations_ratio,
            },
            "slack_db": self.slack_db,
            "front_given": len(self.front),
        }

    def describe(self, recipe: RecipeConfig) -> str:
        step = next(s for s in recipe.steps if isinstance(s, CacheAutoConfig))
        return (
            f"matching {self.package}'s cache quality (held-out {self.psnr_mean_db:.2f} dB, 5th percentile "
            f"{self.psnr_p5_db:.2f}, at {self.block_evaluations_ratio:.3f} of the block evaluations): cache "
            f"floor {step.psnr_floor_db:g} / {step.psnr_p5_floor_db:g} dB, its {len(self.front)} front "
            "schedules given to the search"
        )
