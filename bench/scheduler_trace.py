"""A seeded job trace replayed against the allocator's policy on a simulated clock, beside three baselines.

    python bench/scheduler_trace.py [--quick] [--seed 1]

The trace has the shape of the workloads Pollux (OSDI'21) was evaluated on (a
Microsoft Philly-derived trace: 160 jobs arriving over 8 hours on 64 GPUs, most of
them small): Poisson arrivals, requested sizes 1-16 weighted toward 1-2 workers,
log-normal durations (median 40 minutes at the requested size), and a share of
high-priority runs. Each job's throughput at n workers follows a fixed-global-batch
scaling model, step(n) = compute / n + comm * (n - 1) / n (the data-parallel split
of the batch's compute plus a ring all-reduce of the gradients), with comm/compute
drawn per job from [0.05, 0.6] (etrain's tiny model measures ~0.35 on gloo here).

Policies, side by side on the same trace:

- ``static``: first come first served, a gang at the requested size, no preemption
  (a Kueue-like queue without elasticity).
- ``suspend``: priority order; a high-priority run that does not fit suspends the
  lowest-priority running runs whole (checkpoint, requeue; 30 s to start again).
- ``restart_elastic``: the elastic policy (``orchestrator.service.policy``), but
  every resize is a restart: 60 s to notice, 30 s to start, and the work since the
  last checkpoint (every 10 minutes) lost (a Ray Train V2-like elastic run).
- ``etrain``: the same policy with etrain's measured resize cost (2 s, the median
  grow of bench/recovery.py rounded up; no step lost: a shrink restores from memory).

Elastic runs may use [requested / 2, requested x 2] workers; static and suspend
runs use their requested size. Prints one JSON line last: ``avg_jct_s`` and
``p99_jct_s`` per policy, ``jct_ratio_vs_static`` (etrain's), ``high_priority_wait_s_p50``
(etrain's, per policy beside it), ``steps_lost_per_preemption`` (etrain's and per
policy, in steps of the job's own step time), ``sensitivity`` (etrain's average JCT
at a resize cost of 1, 2, 5, 30 and 60 s), ``decision_ms_p99`` (the policy's decision
at 1,000 runs on 10,000 workers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from orchestrator.service.policy import ClusterView, RunDemand  # noqa: E402
from orchestrator.service.rules import decide  # noqa: E402

ETRAIN_RESIZE_S = 2.0
NOTICE_S, RESTART_S, CHECKPOINT_EVERY_S = 60.0, 30.0, 600.0
TICK_S = 300.0  # the allocator also decides on a clock, not only on arrivals and completions


@dataclass
class Job:
    jid: str
    arrival: float
    requested: int
    work: float  # samples to train
    comm: float  # comm / compute of one step at the requested size
    step_compute_s: float  # one step's compute on 1 worker
    high: bool
    # simulation state
    alloc: int = 0
    done: float = 0.0
    paused_until: float = 0.0
    started: float | None = None
    finished: float | None = None
    since_ckpt: float = 0.0  # samples trained since the last checkpoint (restart_elastic)
    run_s: float = 0.0  # running time since the last checkpoint
    lost: list = field(default_factory=list)  # samples lost per preemption

    def rate(self, n: int) -> float:
        """Samples per second at n workers (a step of one global batch of 1 sample per unit of compute)."""
        if n <= 0:
            return 0.0
        return 1.0 / (self.step_compute_s / n + self.step_compute_s * self.comm * (n - 1) / n)


def make_trace(seed: int, n_jobs: int, load: float, cluster: int) -> tuple[list[Job], float]:
    """``n_jobs`` jobs whose arrivals are spread so that their requested worker-seconds fill ``load`` of the
    cluster's capacity over the arrival window; returns them and the window in hours."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n_jobs):
        req = min(rng.choices([1, 2, 4, 8, 16], weights=[0.45, 0.25, 0.15, 0.1, 0.05])[0], cluster)
        dur = min(max(rng.lognormvariate(math.log(40 * 60), 1.0), 5 * 60), 10 * 3600)
        j = Job(jid=f"j{i:03d}", arrival=0.0, requested=req, work=0.0, comm=rng.uniform(0.05, 0.6),
                step_compute_s=1.0, high=rng.random() < 0.2)
        j.work = dur * j.rate(req)
        jobs.append((j, dur))
    window_s = sum(j.requested * dur for j, dur in jobs) / (cluster * load)
    t = 0.0
    for j, _ in jobs:
        t += rng.expovariate(n_jobs / window_s)
        j.arrival = t
    return [j for j, _ in jobs], window_s / 3600


def elastic_range(j: Job) -> tuple[int, int]:
    return max(1, j.requested // 2), j.requested * 2


def demand(j: Job, now: float, cost_s: float, cluster: int) -> RunDemand:
    lo, hi = elastic_range(j)
    hi = min(hi, cluster)
    return RunDemand(run_id=j.jid, min_workers=lo, max_workers=hi, priority=10 if j.high else 0,
                     allocated=j.alloc, queued_since=j.arrival, remaining=j.work - j.done,
                     throughput={n: j.rate(n) for n in range(lo, hi + 1)}, resize_cost_s=cost_s)


class Sim:
    """Run a trace to the end under one allocation rule; ``allocate(now)`` sets every job's ``alloc``."""

    def __init__(self, jobs: list[Job], cluster: int, policy: str, cost_s: float):
        self.jobs = [replace(j, lost=[]) for j in jobs]
        self.cluster, self.policy, self.cost_s = cluster, policy, cost_s
        self.preemptions = 0

    def progress(self, j: Job, until: float, now: float) -> None:
        start = max(now, j.paused_until)
        if j.alloc and until > start and j.finished is None:
            d = (until - start) * j.rate(j.alloc)
            j.done += d
            j.since_ckpt += d
            j.run_s += until - start
            while j.run_s >= CHECKPOINT_EVERY_S:  # a checkpoint: what came before is safe
                j.run_s -= CHECKPOINT_EVERY_S
                j.since_ckpt = min(j.since_ckpt, j.run_s * j.rate(j.alloc))

    def finish_time(self, j: Job, now: float) -> float:
        if not j.alloc or j.finished is not None:
            return math.inf
        return max(now, j.paused_until) + (j.work - j.done) / j.rate(j.alloc)

    def change(self, j: Job, n: int, now: float) -> None:
        """Carry out a size change under this policy's cost model."""
        old = j.alloc
        if n == old:
            return
        if old == 0:  # admitted, or resumed after a suspend
            j.started = now if j.started is None else j.started
            j.paused_until = now + (RESTART_S if j.done > 0 else 0.0)
        elif self.policy == "restart_elastic":
            if n < old:
                self.preemptions += 1
            lost = j.since_ckpt
            j.lost.append(lost)
            j.done -= lost
            j.since_ckpt = j.run_s = 0.0
            j.paused_until = now + NOTICE_S + RESTART_S
        elif self.policy == "etrain":
            if n < old:
                self.preemptions += 1
                j.lost.append(0.0)
            j.paused_until = now + self.cost_s
        if n == 0:  # suspended: committed at the boundary, nothing lost
            self.preemptions += 1
            j.lost.append(0.0)
            j.since_ckpt = j.run_s = 0.0
        j.alloc = n

    def allocate(self, now: float) -> None:
        live = [j for j in self.jobs if j.arrival <= now and j.finished is None]
        if self.policy == "static":
            free = self.cluster - sum(j.alloc for j in live)
            for j in sorted(live, key=lambda j: j.arrival):
                if j.alloc == 0 and j.requested <= free:
                    self.change(j, j.requested, now)
                    free -= j.requested
        elif self.policy == "suspend":
            free = self.cluster - sum(j.alloc for j in live)
            for j in sorted(live, key=lambda j: (not j.high, j.arrival)):
                if j.alloc or (free < j.requested and not j.high):
                    continue
                if free < j.requested:
                    victims = sorted((v for v in live if v.alloc and not v.high), key=lambda v: -v.arrival)
                    if free + sum(v.alloc for v in victims) < j.requested:
                        continue
                    for v in victims:
                        if free >= j.requested:
                            break
                        free += v.alloc
                        self.change(v, 0, now)
                self.change(j, j.requested, now)
                free -= j.requested
        else:
            plan = decide([demand(j, now, self.cost_s if self.policy == "etrain" else NOTICE_S + RESTART_S,
                                  self.cluster) for j in live], ClusterView(capacity=self.cluster), now)
            for j in live:
                self.change(j, plan.targets[j.jid], now)

    def run(self) -> dict:
        arrivals = sorted(self.jobs, key=lambda j: j.arrival)
        now, i, next_tick = 0.0, 0, TICK_S
        while any(j.finished is None for j in self.jobs):
            nxt = min([arrivals[i].arrival] if i < len(arrivals) else [math.inf])
            ends = [(self.finish_time(j, now), j.jid) for j in self.jobs]
            end, _ = min(ends)
            t = min(nxt, end, next_tick)
            for j in self.jobs:
                self.progress(j, t, now)
            now = t
            for j in self.jobs:
                if j.finished is None and j.alloc and j.done >= j.work - 1e-6 and now >= j.paused_until:
                    j.finished, j.alloc = now, 0
            while i < len(arrivals) and arrivals[i].arrival <= now:
                i += 1
            if now >= next_tick:
                next_tick = now + TICK_S
            self.allocate(now)
        return self.summary()

    def summary(self) -> dict:
        jct = sorted(j.finished - j.arrival for j in self.jobs)
        waits = sorted(j.started - j.arrival for j in self.jobs if j.high)
        lost = [loss for j in self.jobs for loss in j.lost]
        steps = [loss / (j.rate(j.requested) or 1) / j.step_compute_s * 1 for j in self.jobs for loss in j.lost]
        return {"avg_jct_s": round(statistics.fmean(jct), 1), "p99_jct_s": round(jct[min(len(jct) - 1,
                                                                                          int(0.99 * len(jct)))], 1),
                "high_priority_wait_s_p50": round(statistics.median(waits), 1) if waits else 0.0,
                "preemptions": self.preemptions,
                "steps_lost_per_preemption": round(statistics.fmean(steps), 1) if lost else 0.0}


def decision_ms_p99(seed: int, n_runs: int = 1000, workers: int = 10000, rounds: int = 30) -> float:
    """The policy's decision time at ``n_runs`` runs on ``workers`` workers: half running, half queued."""
    rng = random.Random(seed)
    runs = []
    for i in range(n_runs):
        lo = rng.choice([1, 2, 4, 8])
        hi = lo * rng.choice([1, 2, 4])
        runs.append(RunDemand(run_id=f"r{i}", min_workers=lo, max_workers=hi, priority=rng.choice([0, 0, 5, 10]),
                              team=rng.choice("abcd"), allocated=rng.choice([0, lo, hi]) if i % 2 else 0,
                              queued_since=rng.uniform(0, 1000), remaining=rng.uniform(1e3, 1e7),
                              throughput={n: n ** rng.uniform(0.5, 1.0) for n in range(lo, hi + 1)}))
    times = []
    for k in range(rounds):
        t0 = time.perf_counter()
        decide(runs, ClusterView(capacity=workers - k, quotas={"a": workers // 3}), now=float(k))
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return round(times[min(len(times) - 1, int(0.99 * len(times)))], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 jobs on 24 workers (else 160 jobs on 64)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.8, help="the requested worker-seconds over the capacity of the "
                    "arrival window (0.8: a busy cluster that is not overloaded)")
    args = ap.parse_args()
    n_jobs, cluster = (60, 24) if args.quick else (160, 64)
    jobs, hours = make_trace(args.seed, n_jobs, args.load, cluster)
    out: dict = {"bench": "scheduler_trace", "jobs": n_jobs, "arrival_hours": round(hours, 2), "load": args.load,
                 "workers": cluster, "seed": args.seed,
                 "etrain_resize_s": ETRAIN_RESIZE_S}
    per = {}
    for policy in ("static", "suspend", "restart_elastic", "etrain"):
        t0 = time.monotonic()
        per[policy] = Sim(jobs, cluster, policy, ETRAIN_RESIZE_S).run()
        print(f"{policy:16s} {per[policy]} ({time.monotonic() - t0:.1f} s)", flush=True)
    out["policies"] = per
    out["avg_jct_s"] = {p: v["avg_jct_s"] for p, v in per.items()}
    out["p99_jct_s"] = {p: v["p99_jct_s"] for p, v in per.items()}
    out["jct_ratio_vs_static"] = round(per["etrain"]["avg_jct_s"] / per["static"]["avg_jct_s"], 3)
    out["high_priority_wait_s_p50"] = per["etrain"]["high_priority_wait_s_p50"]
    out["steps_lost_per_preemption"] = per["etrain"]["steps_lost_per_preemption"]
    out["sensitivity"] = {str(c): Sim(jobs, cluster, "etrain", c).run()["avg_jct_s"] for c in (1, 2, 5, 30, 60)}
    out["below_restart_elastic_at_every_cost"] = all(v < per["restart_elastic"]["avg_jct_s"]
                                                     for v in out["sensitivity"].values())
    out["decision_ms_p99"] = decision_ms_p99(args.seed)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
