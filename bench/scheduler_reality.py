"""The scheduler simulator checked against reality: a small trace of tiny runs on a local Ray cluster,
beside the same trace through bench/scheduler_trace.py's simulator.

    python bench/scheduler_reality.py [--quick]

Three runs of the tiny model arrive on a local Ray of 3 worker CPUs, as a platform would see them: a
long preemptible run that may use the whole cluster (min 1, max 3), a high-priority run of 2 workers
a little later (the allocator shrinks the first to make room, from memory), and a third, low-priority
one that waits in the queue until there is room. Each run's completion time (submission to FINISHED)
is measured; then the simulator replays the same arrivals with each run's throughput at each size
and its resize cost as the runs themselves measured them (their step histories and ``resized``
events), under the allocator's real policy. Prints one JSON line last: ``jct_s`` (measured),
``sim_jct_s`` and ``error`` per run, ``max_abs_error`` (target <= 0.15).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from bench.scheduler_trace import Job, Sim  # noqa: E402
from orchestrator.service.demand import resize_cost, throughput  # noqa: E402
from orchestrator.service.policy import ClusterView, RunDemand  # noqa: E402
from orchestrator.service.rules import decide  # noqa: E402

BASE = ['model.preset="tiny"', "data.seq_len=32", "data.max_bytes=1000000", "train.global_batch=12",
        "train.micro_batch=1", "train.warmup_steps=4", "train.log_every=1000", "checkpoint.interval_steps=20",
        'metrics.file_sd_dir="-"', "parallel.zero_stage=2"]
CLUSTER = 3


@dataclass
class Arrival:
    name: str
    at_s: float
    steps: int
    workers: int
    min_workers: int
    max_workers: int
    priority: int


def trace(quick: bool) -> list[Arrival]:
    k = 1 if quick else 2
    return [Arrival("long", 0.0, 150 * k, 1, 1, 3, 0),
            Arrival("urgent", 25.0 * k, 60 * k, 2, 2, 2, 10),
            Arrival("later", 35.0 * k, 60 * k, 1, 1, 1, 0)]


def run_real(arrivals: list[Arrival], root: str) -> dict[str, dict]:
    from orchestrator.driver.run import BackgroundRun, connect, prepare_run

    connect(None, num_cpus=CLUSTER)
    t0, runs, out = time.time(), {}, {}
    pending = sorted(arrivals, key=lambda a: a.at_s)
    while pending or any("finished" not in out[name] for name in runs):
        while pending and time.time() - t0 >= pending[0].at_s:
            a = pending.pop(0)
            spec, store = prepare_run(None, [*BASE, f"train.steps={a.steps}", f"elastic.priority={a.priority}",
                                             f'checkpoint.url="file://{root}/{a.name}"', f'run_id="{a.name}"'],
                                      workers=a.workers, min_workers=a.min_workers, max_workers=a.max_workers,
                                      store=f"file://{root}/store")
            runs[a.name] = BackgroundRun(spec, store)
            out[a.name] = {"submitted": time.time(), "store": store}
            print(f"t={time.time() - t0:5.1f} s: {a.name} submitted", flush=True)
        for name, r in runs.items():
            if not r.thread.is_alive() and "finished" not in out[name]:
                final = r.join()
                out[name]["finished"] = time.time()
                out[name]["phase"] = final["phase"]
                print(f"t={time.time() - t0:5.1f} s: {name} {final['phase']} at step {final['step']}", flush=True)
        time.sleep(0.2)
    for name, o in out.items():
        st = o.pop("store")
        o["history"] = st.get_history(name)
        o["events"] = st.events(name)
        o["jct_s"] = o["finished"] - o["submitted"]
        o["arrival_s"] = o["submitted"] - t0
    return out


@dataclass
class MeasuredJob(Job):
    """A job of the simulator whose throughput at each size is what the real run measured."""

    measured: dict = field(default_factory=dict)
    bounds: tuple = (1, 1)
    priority: int = 0
    startup_s: float = 0.0  # admission to its first step: driver, controller, group and data start

    def rate(self, n: int) -> float:
        if n <= 0:
            return 0.0
        return RunDemand(run_id=self.jid, min_workers=1, max_workers=max(n, 1), throughput=self.measured).rate(n)


class RealitySim(Sim):
    """The simulator on the allocator's clock (every 2 s) with each job's own bounds and priority."""

    def allocate(self, now: float) -> None:
        live = [j for j in self.jobs if j.arrival <= now and j.finished is None]
        demands = [RunDemand(run_id=j.jid, min_workers=j.bounds[0], max_workers=j.bounds[1], priority=j.priority,
                             allocated=j.alloc, queued_since=j.arrival, remaining=j.work - j.done,
                             throughput=dict(j.measured), resize_cost_s=self.cost_s) for j in live]
        plan = decide(demands, ClusterView(capacity=CLUSTER), now)
        for j in live:
            admitted = j.alloc == 0 and plan.targets[j.jid] > 0
            self.change(j, plan.targets[j.jid], now)
            if admitted:  # it starts as the real run did: driver, controller, group, data
                j.paused_until = now + j.startup_s


def simulate(arrivals: list[Arrival], real: dict[str, dict]) -> dict[str, float]:
    import bench.scheduler_trace as trace_mod

    jobs, costs = [], []
    for a in arrivals:
        r = real[a.name]
        measured = throughput(r["history"], 12)
        costs.append(resize_cost(r["events"]))
        first = r["history"][0].unix - r["history"][0].step_s if r["history"] else r["submitted"]
        admitted = max([e["time"] for e in r["events"] if e.get("kind") == "admitted"], default=r["submitted"])
        jobs.append(MeasuredJob(jid=a.name, arrival=r["arrival_s"], requested=a.workers, work=a.steps * 12.0,
                                comm=0.0, step_compute_s=1.0, high=a.priority > 0, measured=measured,
                                bounds=(a.min_workers, a.max_workers), priority=a.priority,
                                startup_s=max(0.0, first - admitted)))
    old_tick, old_restart = trace_mod.TICK_S, trace_mod.RESTART_S
    trace_mod.TICK_S = 2.0
    trace_mod.RESTART_S = 0.0
    try:
        sim = RealitySim(jobs, CLUSTER, "etrain", statistics.median(costs))
        sim.run()
    finally:
        trace_mod.TICK_S, trace_mod.RESTART_S = old_tick, old_restart
    return {j.jid: j.finished - j.arrival for j in sim.jobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (about 2 minutes; else about 4)")
    args = ap.parse_args()
    arrivals = trace(args.quick)
    with tempfile.TemporaryDirectory() as root:
        real = run_real(arrivals, root)
    sim = simulate(arrivals, real)
    out = {"bench": "scheduler_reality", "workers": CLUSTER, "jct_s": {}, "sim_jct_s": {}, "error": {}}
    for a in arrivals:
        r, s = real[a.name]["jct_s"], sim[a.name]
        out["jct_s"][a.name] = round(r, 1)
        out["sim_jct_s"][a.name] = round(s, 1)
        out["error"][a.name] = round((s - r) / r, 3)
        print(f"{a.name:8s} measured {r:6.1f} s, simulated {s:6.1f} s ({(s - r) / r:+.1%}); phase "
              f"{real[a.name]['phase']}", flush=True)
    out["max_abs_error"] = max(abs(e) for e in out["error"].values())
    out["phases"] = {a.name: real[a.name]["phase"] for a in arrivals}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
