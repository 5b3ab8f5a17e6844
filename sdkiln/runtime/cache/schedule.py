"""A cache schedule as data: what the transformer's block stack does at every denoising step.

The schedule is static: step ``s`` of branch ``b`` runs ``actions[b][s]``, one of

* ``full``: every block computes; the caches are refreshed from this step.
* ``skip``: no block computes; the stack's output is its input plus the whole stack's residual
  (output - input) cached at the last ``full`` step. ``skip~`` extrapolates that residual to first
  order from the last two ``full`` steps (by step index), which needs two of them.
* ``partial:F:B``: the first ``F`` and the last ``B`` blocks compute; the middle blocks are
  replaced by their residual cached at the last ``full`` step (``partial~:F:B`` extrapolates it).

Rules every schedule obeys (``validate``): the first step and the last step are ``full``; a
``partial`` leaves at least one block in the middle; an extrapolated action has two earlier
``full`` steps. Branches are named by the pipeline's cache context (``"cond"``/``"uncond"`` for
pipelines that call the transformer once per branch) or ``"batched"`` for pipelines that run both
CFG branches as one batch, whose branches then share one list of actions.

``schedules/cache_schedule.json`` holds the schedule with what it was made for: the model
fingerprint and the recipe steps before it, the scheduler class and the sigma of every step, the
block layout, the guidance mode, and the expected speedup and quality. For another step count the
schedule is mapped by sigma (``for_sigmas``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from sdkiln.errors import PackageError
from sdkiln.runtime.cache.guard import Guard

FORMAT = "sdkiln.cache_schedule"
FORMAT_VERSION = 1
SCHEDULE_FILE = "schedules/cache_schedule.json"
BATCHED = "batched"
# Bounds a schedule from a package must respect: more is no real model, only a way to hang the loader.
MAX_STEPS = 1000
MAX_BLOCKS = 10_000
MAX_BRANCHES = 16
"""The branch name of a pipeline that runs every CFG branch in one transformer call."""


@dataclass(frozen=True)
class Action:
    kind: str
    """``full``, ``skip`` or ``partial``."""
    first: int = 0
    """Blocks computed at the start of the stack (``partial``)."""
    last: int = 0
    """Blocks computed at the end of the stack (``partial``)."""
    extrapolate: bool = False

    @classmethod
    def parse(cls, text: str) -> Action:
        head, *rest = str(text).split(":")
        extrapolate = head.endswith("~")
        kind = head.rstrip("~")
        if kind == "full" and not rest and not extrapolate:
            return FULL
        if kind == "skip" and not rest:
            return cls("skip", extrapolate=extrapolate)
        if kind == "partial" and len(rest) == 2 and all(r.isdigit() for r in rest):
            return cls("partial", int(rest[0]), int(rest[1]), extrapolate)
        raise ValueError(
            f"unknown cache action {text!r}; expected full, skip, skip~, partial:F:B or partial~:F:B"
        )

    def __str__(self) -> str:
        head = self.kind + ("~" if self.extrapolate else "")
        return f"{head}:{self.first}:{self.last}" if self.kind == "partial" else head

    def computes(self, position: int, num_blocks: int) -> bool:
        """Whether the block at ``position`` of the stack computes under this action."""
        if self.kind == "full":
            return True
        if self.kind == "skip":
            return False
        return position < self.first or position >= num_blocks - self.last

    def block_evaluations(self, num_blocks: int) -> int:
        return sum(self.computes(p, num_blocks) for p in range(num_blocks))

    def cached_span(self, num_blocks: int) -> tuple[int, int]:
        """``(first, end)``: the blocks ``first .. end-1`` whose residual this action reuses."""
        if self.kind == "skip":
            return 0, num_blocks
        if self.kind == "partial":
            return self.first, num_blocks - self.last
        raise ValueError("a full step reuses nothing")


FULL = Action("full")


@dataclass(frozen=True)
class BlockLayout:
    """One block list of the transformer, in stack order: its attribute, its length, and the forward
    argument names that carry the hidden states in and the names of what the block returns."""

    attr: str
    count: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "attr": self.attr,
            "count": self.count,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockLayout:
        count = d["count"]
        if type(count) is not int or not 1 <= count <= MAX_BLOCKS:
            raise ValueError(f"block count must be an integer in [1, {MAX_BLOCKS}], got {count!r}")
        if not all(
            isinstance(x, list) and all(isinstance(s, str) for s in x) for x in (d["inputs"], d["outputs"])
        ):
            raise ValueError("block inputs and outputs must be lists of names")
        return cls(str(d["attr"]), count, tuple(d["inputs"]), tuple(d["outputs"]))


@dataclass
class CacheSchedule:
    actions: dict[str, list[Action]]
    """Branch name -> one action per step."""
    sigmas: list[float]
    """The scheduler's sigma at every step (``len == num_steps``)."""
    blocks: list[BlockLayout]
    scheduler_class: str = ""
    guidance_mode: str = BATCHED
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """The model it was made for: ``config_hash``, ``weights_hash`` and the recipe steps before it."""
    guards: dict[str, Any] = field(default_factory=dict)
    """The optional guard (``guard.Guard.to_dict``): input-change thresholds per branch and step."""
    expected: dict[str, Any] = field(default_factory=dict)
    """Measured on held-out prompts when the schedule was made: ``block_evaluations_ratio`` and quality."""
    search: dict[str, Any] = field(default_factory=dict)
    """How the schedule was found (budget, constraints, the Pareto front)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_steps(self) -> int:
        return len(self.sigmas)

    @property
    def num_blocks(self) -> int:
        return sum(b.count for b in self.blocks)

    def action(self, step: int, branch: str) -> Action:
        actions = self.actions.get(branch)
        if actions is None:
            if len(self.actions) == 1:  # one list serves every branch
                actions = next(iter(self.actions.values()))
            else:
                raise ValueError(
                    f"the cache schedule has no actions for branch {branch!r}; it has {sorted(self.actions)}"
                )
        return actions[step]

    def block_evaluations_ratio(self) -> float:
        """Block evaluations with the schedule over those of the uncached run (mean over branches)."""
        n = self.num_blocks
        ratios = [
            sum(a.block_evaluations(n) for a in acts) / (n * len(acts)) for acts in self.actions.values()
        ]
        return sum(ratios) / len(ratios)

    def validate(self) -> None:
        if self.num_steps < 1:
            raise ValueError("a cache schedule needs at least one step")
        if not self.blocks or any(b.count < 1 for b in self.blocks):
            raise ValueError("a cache schedule needs a block layout with at least one block per list")
        if not self.actions:
            raise ValueError("a cache schedule needs the actions of at least one branch")
        n = self.num_blocks
        for branch, actions in self.actions.items():
            where = f"cache schedule branch {branch!r}"
            if len(actions) != self.num_steps:
                raise ValueError(f"{where}: {len(actions)} actions for {self.num_steps} steps")
            if actions[0] != FULL or actions[-1] != FULL:
                raise ValueError(f"{where}: the first and the last step must be full")
            fulls = 0
            for step, a in enumerate(actions):
                if a.kind == "partial" and not (a.first >= 0 and a.last >= 0 and a.first + a.last < n):
                    raise ValueError(f"{where}, step {step}: {a} leaves no middle block of {n} to reuse")
                if a.extrapolate and fulls < 2:
                    raise ValueError(
                        f"{where}, step {step}: {a} extrapolates but only {fulls} full step(s) precede it"
                    )
                fulls += a == FULL
        if self.guards:
            guard = Guard.from_dict(self.guards)
            for branch, thresholds in guard.thresholds.items():
                if len(thresholds) != self.num_steps:
                    raise ValueError(
                        f"cache guard branch {branch!r}: {len(thresholds)} thresholds for {self.num_steps} steps"
                    )
                if any(t is not None and not (t >= 0 and math.isfinite(t)) for t in thresholds):
                    raise ValueError(f"cache guard branch {branch!r}: thresholds must be finite and >= 0")

    # --- mapping to another step count -------------------------------------------------------

    def for_sigmas(self, sigmas: list[float]) -> CacheSchedule:
        """This schedule for a run whose steps have ``sigmas``: itself when they match, else mapped by
        sigma. Step i takes the action of the schedule step whose sigma is nearest; the first and last
        steps stay full. Refused (``ValueError``) when the mapping is ambiguous: a sigma outside the
        schedule's range, a sigma equally near two schedule steps with different actions, or more
        steps than the schedule has (a skip would then be repeated past what was measured)."""
        sigmas = [float(s) for s in sigmas]
        if not all(math.isfinite(s) for s in sigmas):
            raise ValueError(
                f"the run's sigmas are not all finite ({sigmas[:4]}...): check the scheduler's config"
            )
        if len(sigmas) == self.num_steps and all(
            math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(sigmas, self.sigmas, strict=True)
        ):
            return self
        if len(sigmas) > self.num_steps:
            raise ValueError(
                f"the cache schedule was made for {self.num_steps} steps; mapping it to {len(sigmas)} steps "
                "would repeat its reuse decisions beyond what was measured: optimize again for this step count"
            )
        lo, hi = min(self.sigmas), max(self.sigmas)
        span = hi - lo
        mapped: dict[str, list[Action]] = {}
        index: list[int] = []  # the schedule step each run step takes its action (and guard) from
        for branch, actions in self.actions.items():
            out, index = [], []
            for i, sigma in enumerate(sigmas):
                if sigma < lo - 1e-6 * max(span, 1.0) or sigma > hi + 1e-6 * max(span, 1.0):
                    raise ValueError(
                        f"step {i} has sigma {sigma:.6g}, outside the schedule's range [{lo:.6g}, {hi:.6g}]"
                    )
                dist = [abs(sigma - s) for s in self.sigmas]
                best = min(dist)
                near = [j for j, d in enumerate(dist) if d - best <= 1e-9 * max(span, 1.0)]
                if len({actions[j] for j in near}) > 1:
                    raise ValueError(
                        f"step {i} (sigma {sigma:.6g}) is equally near schedule steps {near}, which differ"
                    )
                out.append(actions[near[0]])
                index.append(near[0])
            out[0] = out[-1] = FULL
            fulls = 0
            for j, a in enumerate(out):  # an extrapolation needs two full steps before it
                if a.extrapolate and fulls < 2:
                    out[j] = Action(a.kind, a.first, a.last, False)
                fulls += out[j] == FULL
            mapped[branch] = out
        return CacheSchedule(
            actions=mapped,
            sigmas=sigmas,
            blocks=self.blocks,
            scheduler_class=self.scheduler_class,
            guidance_mode=self.guidance_mode,
            fingerprint=self.fingerprint,
            guards=_map_guards(self.guards, index),
            expected={},  # measured for the original steps only
            search=self.search | {"mapped_from_steps": self.num_steps},
        )

    # --- a safer schedule from the search's front ---------------------------------------------

    def stepped_up(self, margin_db: float) -> CacheSchedule | None:
        """The cheapest schedule of the search's confirmed front (``search.front``) whose calibration
        PSNR, mean and 5th percentile, is at least ``margin_db`` above this schedule's own point on the
        front; the guard is kept. None when there is no front (a hand-made schedule), this schedule
        is not on it, or no point is that far above (it is all full already). ``ValueError`` for a
        front that is not a list of confirmed points of this schedule's length."""
        front = self.search.get("front")
        if not front:
            return None
        if not isinstance(front, list) or len(front) > 10 * MAX_STEPS:
            raise ValueError("search.front must be a list of confirmed schedules")
        points = []
        for p in front:
            ok = isinstance(p, dict) and isinstance(p.get("actions"), list)
            numbers = [p.get(k) for k in ("block_evaluations_ratio", "psnr_mean", "psnr_p5")] if ok else []
            if not ok or not all(type(x) in (int, float) and math.isfinite(x) for x in numbers):
                raise ValueError("search.front: each point needs actions and finite ratio and PSNRs")
            if len(p["actions"]) != self.num_steps or not all(isinstance(a, str) for a in p["actions"]):
                raise ValueError(f"search.front: each point needs {self.num_steps} actions")
            points.append((numbers, p["actions"]))
        own_lists = {tuple(str(a) for a in acts) for acts in self.actions.values()}
        own = [n for n, acts in points if len(own_lists) == 1 and tuple(acts) in own_lists]
        if not own:
            return None
        _, mean, p5 = own[0]
        above = [(n, acts) for n, acts in points if n[1] >= mean + margin_db and n[2] >= p5 + margin_db]
        if not above:
            return None
        (ratio, up_mean, up_p5), acts = min(above, key=lambda x: x[0][0])
        parsed = [Action.parse(a) for a in acts]
        return dataclasses.replace(
            self,
            actions={branch: list(parsed) for branch in self.actions},
            expected={},  # the front's numbers are the calibration samples', kept in `search`
            search=self.search
            | {
                "stepped_up": {
                    "margin_db": margin_db,
                    "from": {"block_evaluations_ratio": own[0][0], "psnr_mean": mean, "psnr_p5": p5},
                    "to": {"block_evaluations_ratio": ratio, "psnr_mean": up_mean, "psnr_p5": up_p5},
                }
            },
        )

    # --- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "scheduler_class": self.scheduler_class,
            "num_steps": self.num_steps,
            "sigmas": self.sigmas,
            "guidance_mode": self.guidance_mode,
            "blocks": [b.to_dict() for b in self.blocks],
            "actions": {k: [str(a) for a in v] for k, v in self.actions.items()},
            "guards": self.guards,
            "expected": self.expected,
            "search": self.search,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = SCHEDULE_FILE) -> CacheSchedule:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PackageError(
                f"{where}: not a cache schedule (format {d.get('format') if isinstance(d, dict) else None!r})"
            )
        if d.get("format_version") != FORMAT_VERSION:
            raise PackageError(
                f"{where}: cache schedule format version {d.get('format_version')!r}; this sdkiln reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            if not (
                isinstance(d["actions"], dict)
                and isinstance(d["sigmas"], list)
                and isinstance(d["blocks"], list)
            ):
                raise ValueError("actions must be an object, sigmas and blocks lists")
            if (
                len(d["sigmas"]) > MAX_STEPS
                or len(d["actions"]) > MAX_BRANCHES
                or len(d["blocks"]) > MAX_BRANCHES
            ):
                raise ValueError(f"more than {MAX_STEPS} steps or {MAX_BRANCHES} branches or block lists")
            if not all(
                isinstance(v, list) and all(isinstance(a, str) for a in v) for v in d["actions"].values()
            ):
                raise ValueError("actions must be lists of strings")
            if not all(type(s) in (int, float) and math.isfinite(s) for s in d["sigmas"]):
                raise ValueError("sigmas must be finite numbers")
            if not all(isinstance(b, dict) for b in d["blocks"]):
                raise ValueError("blocks must be objects")
            for key in ("fingerprint", "guards", "expected", "search"):
                if not isinstance(d.get(key, {}), dict):
                    raise ValueError(f"{key} must be an object")
            schedule = cls(
                actions={str(k): [Action.parse(a) for a in v] for k, v in d["actions"].items()},
                sigmas=[float(s) for s in d["sigmas"]],
                blocks=[BlockLayout.from_dict(b) for b in d["blocks"]],
                scheduler_class=str(d.get("scheduler_class", "")),
                guidance_mode=str(d.get("guidance_mode", BATCHED)),
                fingerprint=dict(d.get("fingerprint", {})),
                guards=dict(d.get("guards", {})),
                expected=dict(d.get("expected", {})),
                search=dict(d.get("search", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PackageError(f"{where}: invalid cache schedule: {exc}") from None
        if d.get("num_steps") != schedule.num_steps:
            raise PackageError(f"{where}: num_steps {d.get('num_steps')} but {schedule.num_steps} sigmas")
        return schedule

    @classmethod
    def from_json(cls, text: str, where: str = SCHEDULE_FILE) -> CacheSchedule:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PackageError(f"{where}: not JSON: {exc}") from exc
        return cls.from_dict(d, where)

    def check_fingerprint(self, actual: dict[str, Any], where: str = SCHEDULE_FILE) -> None:
        """Refuse a model whose fingerprint differs from the one the schedule was searched on."""
        for key in ("config_hash", "weights_hash"):
            if key not in self.fingerprint:
                raise PackageError(f"{where}: the cache schedule has no {key} to check the model against")
            if actual.get(key) != self.fingerprint[key]:
                raise PackageError(
                    f"{where}: the cache schedule was made for another model ({key} "
                    f"{str(self.fingerprint[key])[:12]}..., this model has {str(actual.get(key))[:12]}...); "
                    "optimize again for this model"
                )


def _map_guards(guards: dict[str, Any], index: list[int]) -> dict[str, Any]:
    """The guard thresholds for a run whose step i takes schedule step ``index[i]``'s action; the
    first and last steps (always full) get none. With fewer steps than the schedule, each step's
    input changes more than calibration saw, so a mapped guard forces more often, never less."""
    if not guards:
        return guards
    thresholds = {
        b: [None if i in (0, len(index) - 1) else ts[j] for i, j in enumerate(index)]
        for b, ts in guards["thresholds"].items()
    }
    return guards | {
        "thresholds": thresholds,
        "mapped_from_steps": len(next(iter(guards["thresholds"].values()))),
    }
