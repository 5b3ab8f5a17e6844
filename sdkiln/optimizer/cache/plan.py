"""The cache search's model of final-output error, and the schedules it proposes.

A schedule is a list of actions, one per step; it decomposes into **segments**: a full step s
followed by L steps of one reuse action a. What one segment does was measured in isolation (every
other step full, ``search.Search.measure_segments``):

* ``local[seg]``: the relative L2 error of the latents right after the segment's last step;
* ``gain[j]``: how an error present after step j has grown (or shrunk) by the final latents,
  final error / error after j, measured on runs that continue full to the end.

A segment's predicted contribution to the final error is ``local[seg] * gain[s + L]``: errors made
late count at full weight, errors that later full steps pull back count less. A schedule's predicted
error is the sum over its segments (a conservative model for errors that add coherently). ``solve``
finds the schedule of least predicted error within a block-evaluation budget; the prediction only
ranks candidates: ``search`` confirms every candidate end to end before it counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sdkiln.runtime.cache import FULL, Action


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    action: Action

    @property
    def end(self) -> int:
        """The segment's last reused step."""
        return self.start + self.length


def fill_gaps(values: dict[int, float], size: int) -> list[float]:
    """A list of ``size`` from the measured ``values`` by index; an unmeasured index takes the value of
    the nearest measured one (the earlier one on a tie). Empty ``values`` give all ones."""
    if not values:
        return [1.0] * size
    known = sorted(values)
    return [values[min(known, key=lambda k: (abs(k - j), k))] for j in range(size)]


@dataclass
class ErrorModel:
    num_steps: int
    num_blocks: int
    min_full: int
    max_reuse: int
    local: dict[Segment, float] = field(default_factory=dict)
    gain: list[float] = field(default_factory=list)

    def final(self, seg: Segment) -> float:
        return self.local[seg] * self.gain[seg.end]

    def segments(self, actions: list[Action]) -> list[Segment] | None:
        """The schedule's segments, or None when a run of reuse steps mixes actions or starts
        without a full step before it (the model cannot price it)."""
        segs, i, t = [], 0, len(actions)
        while i < t:
            if actions[i] == FULL:
                j = i + 1
                while j < t and actions[j] != FULL:
                    j += 1
                if j > i + 1:
                    if len({str(a) for a in actions[i + 1 : j]}) > 1:
                        return None
                    segs.append(Segment(i, j - i - 1, actions[i + 1]))
                i = j
            else:
                return None
        return segs

    def predict(self, actions: list[Action]) -> float:
        """Predicted final relative L2 error; inf when a segment was not measured."""
        segs = self.segments(actions)
        if segs is None or any(s not in self.local for s in segs):
            return math.inf
        return sum(self.final(s) for s in segs)

    def cost(self, actions: list[Action]) -> int:
        return sum(a.block_evaluations(self.num_blocks) for a in actions)

    def allowed(self, actions: list[Action]) -> bool:
        """The search's constraints: the first ``min_full`` steps and the last full, reuse runs of at
        most ``max_reuse`` steps, an extrapolating action only after two full steps."""
        if any(a != FULL for a in actions[: self.min_full]) or actions[-1] != FULL:
            return False
        run = fulls = 0
        for a in actions:
            run = run + 1 if a != FULL else 0
            if run > self.max_reuse or (a.extrapolate and fulls < 2):
                return False
            fulls += a == FULL
        return True

    def _by_start(self) -> dict[int, list[Segment]]:
        out: dict[int, list[Segment]] = {}
        for seg in self.local:
            if seg.length <= self.max_reuse and seg.end + 1 <= self.num_steps - 1:
                out.setdefault(seg.start, []).append(seg)
        return out

    def solve(self, max_cost: int) -> list[Action] | None:
        """The schedule with the least predicted final error among those of at most ``max_cost``
        block evaluations (dynamic programming over the full steps and the cost spent), None when
        no schedule within the constraints is that cheap."""
        t, n = self.num_steps, self.num_blocks
        by_start = self._by_start()
        # best[i][c]: (least predicted error, first segment or None for "next step full") of steps
        # i .. t-1 given step i is full, spending exactly c block evaluations on them.
        best: list[dict[int, tuple[float, Segment | None]]] = [{} for _ in range(t)]
        best[t - 1] = {n: (0.0, None)}
        for i in range(t - 2, -1, -1):
            table: dict[int, tuple[float, Segment | None]] = {}
            options = [(n, 0.0, i + 1, None)]
            if i >= self.min_full - 1:
                options += [
                    (n + s.length * s.action.block_evaluations(n), self.final(s), s.end + 1, s)
                    for s in by_start.get(i, ())
                ]
            for head, err, nxt, seg in options:
                for c, (e, _) in best[nxt].items():
                    cost = head + c
                    if cost <= max_cost and (cost not in table or err + e < table[cost][0]):
                        table[cost] = (err + e, seg)
            best[i] = table
        if not best[0]:
            return None
        cost = min(best[0], key=lambda c: (best[0][c][0], c))
        actions, i = [FULL] * t, 0
        while i < t - 1:
            _, seg = best[i][cost]
            if seg is None:
                cost, i = cost - n, i + 1
                continue
            actions[i + 1 : seg.end + 1] = [seg.action] * seg.length
            cost -= n + seg.length * seg.action.block_evaluations(n)
            i = seg.end + 1
        return actions

    def budgets(self, count: int) -> list[int]:
        """``count`` block-evaluation budgets evenly spaced from the cheapest schedule the constraints
        allow (with measured segments) to all-full."""
        full = self.num_steps * self.num_blocks
        lo, hi = 0, full
        while lo < hi:  # the least budget with a solution
            mid = (lo + hi) // 2
            if self.solve(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        if count < 2:
            return [lo]
        return sorted({round(lo + (full - lo) * k / (count - 1)) for k in range(count)})

    def cheaper_neighbours(self, actions: list[Action], actions_set: list[Action]) -> list[list[Action]]:
        """Schedules one move cheaper than ``actions`` that the model can price, best predicted first:
        a full step turned into reuse (joining the segments around it, any measured action), or a
        segment's action swapped for a cheaper one."""
        out: dict[tuple[str, ...], list[Action]] = {}
        cost = self.cost(actions)
        for i in range(self.min_full, self.num_steps - 1):
            for a in actions_set:
                trial = list(actions)
                if actions[i] == FULL:
                    trial[i] = a
                    j = i - 1
                    while j >= 0 and trial[j] != FULL:
                        trial[j] = a
                        j -= 1
                    j = i + 1
                    while j < self.num_steps and trial[j] != FULL:
                        trial[j] = a
                        j += 1
                elif actions[i] != a and actions[i - 1] == FULL:  # swap the action of the segment at i
                    j = i
                    while j < self.num_steps and trial[j] != FULL:
                        trial[j] = a
                        j += 1
                else:
                    continue
                if self.allowed(trial) and self.cost(trial) < cost and math.isfinite(self.predict(trial)):
                    out[tuple(str(x) for x in trial)] = trial
        return sorted(out.values(), key=lambda c: (self.predict(c), self.cost(c)))
