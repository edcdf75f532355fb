"""The silent-fault detectors: pure functions and small values over the signals a run already has.

    spikes = SpikeWindow(window=64, zscore=8.0)
    z = spikes.score(loss)            # None until the window holds 16 values; else the robust z-score
    spikes.accept(loss)               # a step whose update was applied joins the window
    replica_findings(step, holdings)  # digests of the same shard that differ, and who differs
    first_divergence(before, after)   # where a replay first departs from the run it replays: (step, phase, ranks)

A detector never acts: it returns a :class:`Finding` (what, where, the evidence);
:class:`trainer.health.guard.HealthGuard` decides what the run does about it.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

MIN_WINDOW = 16  # values before a robust z-score means anything (the first steps move fast)
MAD_SCALE = 1.4826  # MAD x this estimates the standard deviation of a normal distribution
REL_FLOOR = 0.01  # the spread is never taken below 1% of the median: a flat curve's MAD of ~0 flags nothing


@dataclass(frozen=True)
class Finding:
    """One detector's report. ``kind``: ``spike`` (the loss or gradient norm over the window), ``nonfinite``,
    ``seal`` (a rank's state changed between its updates: corrupted at rest), ``replica`` (ranks that must hold
    the same bytes do not), ``local`` (one rank's own loss spiked against its own window)."""

    kind: str
    step: int  # as the step log numbers it: the step whose computation showed it
    rank: int | None = None  # the rank it points at, when it points at one
    target: str | None = None  # "param" or "optimizer" when the evidence names the state
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "rank": self.rank, "target": self.target,
                "evidence": self.evidence}


class SpikeWindow:
    """A robust z-score against the last ``window`` accepted values: (x - median) / (1.4826 x MAD), the spread
    floored at 1% of the median. One-sided: only values above the median are spikes."""

    def __init__(self, window: int, zscore: float):
        self.values: deque[float] = deque(maxlen=window)
        self.zscore = zscore

    def score(self, x: float) -> float | None:
        if len(self.values) < MIN_WINDOW:
            return None
        med = statistics.median(self.values)
        mad = statistics.median(abs(v - med) for v in self.values)
        spread = max(MAD_SCALE * mad, REL_FLOOR * abs(med), 1e-12)
        return (x - med) / spread

    def is_spike(self, x: float) -> tuple[bool, float | None]:
        z = self.score(x)
        return z is not None and z > self.zscore, z

    def accept(self, x: float) -> None:
        self.values.append(float(x))

    def state(self) -> list[float]:
        return list(self.values)

    def load(self, values: list[float]) -> None:
        self.values.clear()
        self.values.extend(values)


def target_of(key: str) -> str:
    """The state a leaf key names: ``param`` (``model.*``) or ``optimizer`` (``optim.*``)."""
    return "optimizer" if key.startswith("optim.") else "param"


def target_of_all(keys) -> str | None:
    """The state every one of ``keys`` names, None when they name both."""
    targets = {target_of(k) for k in keys}
    return targets.pop() if len(targets) == 1 else None


def replica_findings(step: int, holdings: Mapping[int, Mapping[tuple, int]]) -> list[Finding]:
    """Leaves whose holders disagree, from every rank's ``{identity: digest}``. The ranks outside a strict
    majority are named; with no strict majority (two replicas that differ) ``rank`` is None and the
    evidence lists both."""
    holders: dict[tuple, dict[int, int]] = {}
    for rank, digests in holdings.items():
        for ident, d in digests.items():
            holders.setdefault(ident, {})[rank] = d
    bad: dict[int | None, dict] = {}
    for ident, by_rank in holders.items():
        if len(by_rank) < 2 or len(set(by_rank.values())) == 1:
            continue
        common, n = Counter(by_rank.values()).most_common(1)[0]
        if n * 2 > len(by_rank):
            for r, d in by_rank.items():
                if d != common:
                    bad.setdefault(r, {"leaves": [], "holders": sorted(by_rank)})["leaves"].append(ident[0])
        else:
            bad.setdefault(None, {"leaves": [], "holders": sorted(by_rank)})["leaves"].append(ident[0])
    out = []
    for r, ev in sorted(bad.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        leaves = ev["leaves"]
        out.append(Finding("replica", step, r, target_of_all(leaves), {"leaves": leaves[:8], "n_leaves": len(leaves),
                                                         "holders": ev["holders"]}))
    return out


# A step's records on one rank, in the order its computation makes them: its own loss (before the
# gradients are reduced), its share of the reduced gradients' squared norm, the digest of its state after
# the update (None for a step whose update was held).
PHASES = ("local_loss", "local_grad", "state")


def first_divergence(before: Mapping[int, Mapping[int, tuple]], after: Mapping[int, Mapping[int, tuple]]
                     ) -> tuple[int, str, list[int]] | None:
    """Where a replay first departs from the run it replays, from each rank's ``{step: (loss, grad, digest)}``
    in both: the earliest (step, phase) at which some rank's record differs, and every rank that differs
    there. None when they agree wherever both have a record. A deterministic replay of a transient fault
    departs first on the rank the fault struck (its own loss, or its own update)."""
    steps = sorted({s for recs in before.values() for s in recs} & {s for recs in after.values() for s in recs})
    for s in steps:
        for i, phase in enumerate(PHASES):
            ranks = [r for r in sorted(before) if s in before[r] and s in after.get(r, {})
                     and before[r][s][i] is not None and after[r][s][i] is not None
                     and not _same(before[r][s][i], after[r][s][i])]
            if ranks:
                return s, phase, ranks
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # two nans
    return a == b
