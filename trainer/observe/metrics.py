"""The run's Prometheus exporter: every metric name, its buckets, and the state it renders from.

    m = RunMetrics(run_id)
    m.observe_step(step_stats_dict)          # rank 0's last step
    m.observe_ranks(worker_id, telemetry)    # each rank's comm and memory figures (cumulative)
    m.observe_save(save_result_dict)         # the coordinator's checkpoint results
    m.observe_failure(kind, detect_s) / m.observe_recovery(seconds, steps_lost)
    m.observe_run(world_size=..., epoch=..., phase=..., goodput=..., step_time_ratio=...)

    ledger = StepLedger()                    # goodput: which trained steps the model still holds
    ledger.trained(step, seconds); ledger.restored(step)

One per run: fed by the controller on Ray (``orchestrator.driver.run``), by rank 0
under torchrun (:mod:`trainer.observe.launcher`), and served over HTTP by
:mod:`trainer.observe.endpoint`. Every metric is documented in
docs/metrics.md. Ranks report cumulative counters; the exporter adds each
report's increase over the previous report of the same process, so counters
stay monotonic across recoveries, replaced workers and changes of rank.
:class:`RunMetrics` is a custom collector that renders from this state on
every scrape: nothing is computed on the training path.
"""

from __future__ import annotations

import threading
import time
from array import array

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    SummaryMetricFamily)

from .telemetry import SECONDS_BUCKETS, STEP_BUCKETS

RECOVERY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CKPT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STEPS_LOST_BUCKETS = (0, 1, 2, 3, 5, 8, 10, 20, 50, 100, 200, 500, 1000)
# The values of the etrain_phase label, in the order a run goes through them: the controller's
# phases (``orchestrator.phase.Phase`` without PENDING), which the trainer cannot import.
# tests/test_architecture.py checks that the two agree.
PHASES = ("INITIALIZING", "QUEUED", "SCHEDULING", "RUNNING", "RECOVERING", "RESIZING", "SUSPENDING",
          "FINISHING", "SUSPENDED", "FINISHED", "FAILED")


class Histogram:
    """A plain bucket count, rendered as a Prometheus histogram."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(self.bounds) and v > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v

    def add(self, counts: list[int], total: float) -> None:
        for i, c in enumerate(counts):
            self.counts[i] += c
        self.sum += total

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip(list(self.bounds) + [float("inf")], self.counts):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        return out


class RunMetrics:
    """Everything the endpoint shows for one run, kept up to date by ``observe_*`` calls."""

    def __init__(self, run_id: str, *, clock=time.time):
        self.run_id = run_id
        self.clock = clock
        self._lock = threading.Lock()
        self.started = clock()
        # training
        self.last_step: dict = {}
        self.eval_loss: float | None = None  # the newest held-out loss ([eval])
        self.steps_total = 0
        self.tokens_total = 0
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.data_wait_seconds_total = 0.0
        self.mfu: float | None = None
        # per rank: comm by (rank, kind, axis) and memory by (rank, kind)
        self.comm: dict[tuple[str, str, str], dict] = {}
        self.busbw: dict[tuple[str, str, str], float] = {}
        self.memory: dict[str, dict[str, int]] = {}
        self.tier_bytes: dict[str, int] = {}  # host bytes the memory tier holds, per rank
        self._seen: dict[str, tuple[float, dict]] = {}  # process -> (time, last cumulative comm by (kind, axis))
        # checkpoints
        self.saves_total = 0
        self.save_failures_total = 0
        self.saves_skipped_total = 0
        self.ckpt_bytes_total = 0
        self.ckpt_blocking = Histogram(CKPT_BUCKETS)
        self.ckpt_persist = Histogram(CKPT_BUCKETS)
        self.ckpt_throughput = 0.0
        self.last_committed_step: int | None = None
        self.last_commit_time: float | None = None
        # recovery and the run
        self.failures: dict[str, int] = {}
        self.preemptions: dict[tuple[str, str], int] = {}  # (action, reason): a drain's shrink, hold, commit
        self.recoveries_total = 0
        self.resizes_total = 0
        self.steps_lost_total = 0
        self.time_to_detect = Histogram(RECOVERY_BUCKETS)
        self.time_to_recover = Histogram(RECOVERY_BUCKETS)
        self.steps_lost_per_failure = Histogram(STEPS_LOST_BUCKETS)
        self.world_size = 0
        self.epoch = 0
        self.phase = "INITIALIZING"
        self.queue_wait_s = 0.0
        # [health]: the checks (rank 0's totals), silent faults by verdict, samples skipped as the data's fault
        self.health: dict = {}
        self.sdc: dict[str, int] = {}
        self.skipped_samples_total = 0
        self.goodput = 0.0
        self.step_time_ratio = 0.0

    # --- observations ------------------------------------------------------------------

    def observe_step(self, s: dict) -> None:
        """Rank 0's newest step (``StepStats.to_dict()``); steps in between are accounted for by count
        (``steps_done``, tokens) and by the ranks' step histograms (``observe_ranks``)."""
        with self._lock:
            prev = self.last_step.get("step")
            self.last_step = dict(s)
            if s.get("health_totals"):
                self.health = dict(s["health_totals"])
            for e in s.get("health_events") or []:  # under torchrun (the Ray controller: observe_health_event)
                self._health_event(e)
            if s.get("eval_loss") is not None:
                self.eval_loss = s["eval_loss"]
            if prev is not None and s.get("step", 0) > prev:
                done = s["step"] - prev
            elif prev is None or s.get("step", 0) < prev:  # first report, or training went back (a restore)
                done = 1
            else:
                return
            self.steps_total += done
            per_step = s.get("tokens_per_s", 0.0) * s.get("step_seconds", 0.0)
            self.tokens_total += int(round(per_step * done))
            if s.get("mfu") is not None:
                self.mfu = s["mfu"]

    def observe_ranks(self, process: str, t: dict) -> None:
        """One rank's telemetry (``trainer.observe.telemetry.rank_telemetry`` plus ``steps``): counters are
        cumulative per process; their increase since the process's previous report is added."""
        rank = str(t.get("rank", -1))
        now = t.get("time", self.clock())
        with self._lock:
            prev_time, prev = self._seen.get(process, (None, {}))
            cur = {}
            for c in t.get("comm", []):
                key = (c["kind"], c["axis"])
                cur[key] = c
                p = prev.get(key)
                d_calls = c["calls"] - (p["calls"] if p else 0)
                if d_calls < 0:  # the process reset its meter: take it whole
                    p, d_calls = None, c["calls"]
                agg = self.comm.setdefault((rank, *key), {"calls": 0, "bytes": 0, "bus_bytes": 0.0,
                                                         "hist": Histogram(SECONDS_BUCKETS)})
                agg["calls"] += d_calls
                agg["bytes"] += c["bytes"] - (p["bytes"] if p else 0)
                agg["bus_bytes"] += c["bus_bytes"] - (p["bus_bytes"] if p else 0.0)
                d_sec = c["seconds"] - (p["seconds"] if p else 0.0)
                agg["hist"].add([a - (b if p else 0) for a, b in zip(c["buckets"], p["buckets"] if p else c["buckets"])],
                                d_sec)
                d_bus = c["bus_bytes"] - (p["bus_bytes"] if p else 0.0)
                if d_sec > 0:
                    self.busbw[(rank, *key)] = d_bus / d_sec
            self._seen[process] = (now, cur)
            steps = t.get("steps")
            if steps:
                self._add_steps(process, steps, count=rank == "0")
            if t.get("memory"):
                self.memory[rank] = dict(t["memory"])
            if "recovery_tier_bytes" in t:
                self.tier_bytes[rank] = int(t["recovery_tier_bytes"])

    def _add_steps(self, process: str, steps: dict, count: bool) -> None:
        """Add a process's steps since its previous report, when it reports as rank 0 (``count``):
        every rank trains the same steps. The baseline moves on every report, so a process that
        becomes rank 0 adds only the steps after that."""
        key = f"steps:{process}"
        _, prev = self._seen.get(key, (None, {}))
        counts = steps["buckets"]
        base = prev.get("buckets", [0] * len(counts))
        if sum(counts) < sum(base):  # a new process under the same name
            base, prev = [0] * len(counts), {}
        if count:
            self.step_seconds.add([a - b for a, b in zip(counts, base)], steps["seconds"] - prev.get("seconds", 0.0))
            self.data_wait_seconds_total += steps["data_seconds"] - prev.get("data_seconds", 0.0)
        self._seen[key] = (0.0, steps)

    def forget_ranks_above(self, world_size: int) -> None:
        """Drop per-rank gauges of ranks that no longer exist after a shrink (counters stay)."""
        with self._lock:
            for r in [r for r in self.memory if int(r) >= world_size]:
                del self.memory[r]
            for r in [r for r in self.tier_bytes if int(r) >= world_size]:
                del self.tier_bytes[r]
            for key in [k for k in self.busbw if int(k[0]) >= world_size]:
                del self.busbw[key]

    def observe_save(self, r: dict) -> None:
        with self._lock:
            if r.get("status") == "committed":
                self.saves_total += 1
                self.ckpt_bytes_total += int(r.get("bytes") or 0)
                self.ckpt_blocking.observe(float(r.get("blocking_s") or 0.0))
                persist = float(r.get("persist_s") or 0.0)
                self.ckpt_persist.observe(persist)
                if persist > 0 and r.get("bytes"):
                    self.ckpt_throughput = r["bytes"] / persist
                if self.last_committed_step is None or r["step"] >= self.last_committed_step:
                    self.last_committed_step = r["step"]
                    self.last_commit_time = self.clock()
            elif r.get("status") == "skipped":  # when_busy="skip": not a failure
                self.saves_skipped_total += 1
            else:
                self.save_failures_total += 1

    def observe_commit(self, step: int | None) -> None:
        """A committed step known otherwise (the one a group restored from, a sync save)."""
        if step is None:
            return
        with self._lock:
            if self.last_committed_step is None or step > self.last_committed_step:
                self.last_committed_step = step
                self.last_commit_time = self.clock()

    def observe_failure(self, kind: str, detect_s: float | None) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
            if detect_s is not None:
                self.time_to_detect.observe(max(0.0, detect_s))

    def observe_recovery(self, seconds: float, steps_lost: int) -> None:
        with self._lock:
            self.recoveries_total += 1
            self.steps_lost_total += steps_lost
            self.steps_lost_per_failure.observe(steps_lost)
            self.time_to_recover.observe(seconds)

    def observe_health_event(self, e: dict) -> None:
        with self._lock:
            self._health_event(e)

    def _health_event(self, e: dict) -> None:
        if e.get("kind") == "sdc":
            v = str(e.get("verdict"))
            self.sdc[v] = self.sdc.get(v, 0) + 1
            if v == "data" and isinstance(e.get("samples"), list) and len(e["samples"]) == 2:
                self.skipped_samples_total += int(e["samples"][1]) - int(e["samples"][0])

    def observe_preemption(self, action: str, reason: str) -> None:
        with self._lock:
            self.preemptions[(action, reason)] = self.preemptions.get((action, reason), 0) + 1

    def observe_resize(self) -> None:
        with self._lock:
            self.resizes_total += 1

    def observe_run(self, *, world_size: int, epoch: int, phase: str, goodput: float,
                    step_time_ratio: float | None = None, queue_wait_s: float = 0.0) -> None:
        """``goodput``: effective (:class:`StepLedger`); ``step_time_ratio``: every trained step's time over
        wall time. None: the same as ``goodput``, for a reporter that never rolls back (rank 0 under
        torchrun: a restart is a new process, whose steps all stay in the model). ``queue_wait_s``: seconds
        spent in QUEUED so far, the current wait included."""
        with self._lock:
            self.world_size, self.epoch, self.phase, self.goodput = world_size, epoch, phase, goodput
            self.queue_wait_s = queue_wait_s
            self.step_time_ratio = goodput if step_time_ratio is None else step_time_ratio

    # --- the collector ------------------------------------------------------------------

    def describe(self):
        return []

    def collect(self):
        with self._lock:
            yield from self._collect()

    def _collect(self):
        rid = self.run_id

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(name, doc, labels=["run_id", *(labels or {})])
            if value is not None:
                g.add_metric([rid, *(labels or {}).values()], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["run_id"])
            c.add_metric([rid], value)
            return c

        def hist(name, doc, h: Histogram):
            f = HistogramMetricFamily(name, doc, labels=["run_id"])
            f.add_metric([rid], h.buckets(), h.sum)
            return f

        # training
        s = self.last_step
        yield gauge("etrain_step", "Last completed training step", s.get("step"))
        yield counter("etrain_steps", "Training steps completed (steps redone after a restore count again)",
                      self.steps_total)
        yield counter("etrain_tokens", "Tokens trained", self.tokens_total)
        yield hist("etrain_step_seconds", "Wall time of one training step (rank 0)", self.step_seconds)
        yield gauge("etrain_tokens_per_second", "Tokens per second of the last step", s.get("tokens_per_s"))
        yield gauge("etrain_loss", "Loss of the last step (mean over the global batch)", s.get("loss"))
        yield gauge("etrain_eval_loss", "Held-out loss of the newest evaluation ([eval])", self.eval_loss)
        yield gauge("etrain_learning_rate", "Learning rate of the last step", s.get("lr"))
        yield gauge("etrain_grad_norm", "Global gradient norm of the last step, before clipping", s.get("grad_norm"))
        if s.get("aux_loss") is not None:  # a Mixture of Experts (trainer.models.moe)
            yield gauge("etrain_moe_aux_loss", "Load-balancing loss of the last step (part of the loss)", s["aux_loss"])
            yield gauge("etrain_moe_imbalance_ratio",
                        "Largest max/mean tokens per expert over the MoE layers, last step", s.get("moe_imbalance"))
            yield gauge("etrain_moe_dropped_tokens", "Routed token slots dropped by expert capacity, last step",
                        s.get("moe_dropped"))
            per = GaugeMetricFamily("etrain_moe_tokens_per_expert", "Routed token slots per expert, last step",
                                    labels=["run_id", "layer", "expert"])
            for layer, loads in (s.get("moe_tokens_per_expert") or {}).items():
                for e, n in enumerate(loads):
                    per.add_metric([rid, str(layer), str(e)], n)
            yield per
        yield gauge("etrain_step_data_wait_seconds", "Seconds the last step waited for its batch",
                    s.get("data_seconds"))
        yield counter("etrain_data_wait_seconds", "Seconds steps waited for their batches (rank 0)",
                      self.data_wait_seconds_total)
        if self.mfu is not None:
            yield gauge("etrain_mfu_ratio", "Model FLOPs utilization of the last step (GPU)", self.mfu)
        if self.health:  # [health] (docs/operations.md#silent-faults)
            yield counter("etrain_health_checks", "Digest checks of the state ([health])", self.health.get("checks", 0))
            checked = SummaryMetricFamily("etrain_health_check_seconds", "Seconds spent in the digest checks "
                                          "(rank 0)", labels=["run_id"])
            checked.add_metric([rid], count_value=self.health.get("checks", 0),
                               sum_value=self.health.get("check_seconds", 0.0))
            yield checked
            yield gauge("etrain_verified_step", "Newest step the health checks verified", s.get("verified_step"))
        sdc = CounterMetricFamily("etrain_sdc", "Silent faults found, by verdict (transient, persistent, data)",
                                  labels=["run_id", "kind"])
        for kind, n in sorted(self.sdc.items()):
            sdc.add_metric([rid, kind], n)
        yield sdc
        yield counter("etrain_skipped_samples", "Samples skipped as the data's fault ([health])",
                      self.skipped_samples_total)

        # communication, per rank
        labels = ["run_id", "rank", "kind", "axis"]
        calls = CounterMetricFamily("etrain_comm_calls", "Collective calls", labels=labels)
        nbytes = CounterMetricFamily("etrain_comm_bytes", "Collective size in bytes (nccl-tests definition)",
                                     labels=labels)
        bus = CounterMetricFamily("etrain_comm_bus_bytes", "Bytes times the bus factor (nccl-tests busbw)",
                                  labels=labels)
        secs = HistogramMetricFamily("etrain_comm_seconds", "Seconds of one collective, call to completion",
                                     labels=labels)
        bw = GaugeMetricFamily("etrain_comm_bus_bandwidth_bytes_per_second",
                               "Bus bandwidth over the last report interval (nccl-tests busbw)", labels=labels)
        for (rank, kind, axis), a in sorted(self.comm.items()):
            lv = [rid, rank, kind, axis]
            calls.add_metric(lv, a["calls"])
            nbytes.add_metric(lv, a["bytes"])
            bus.add_metric(lv, a["bus_bytes"])
            secs.add_metric(lv, a["hist"].buckets(), a["hist"].sum)
            if (rank, kind, axis) in self.busbw:
                bw.add_metric(lv, self.busbw[(rank, kind, axis)])
        yield from (calls, nbytes, bus, secs, bw)

        mem = GaugeMetricFamily("etrain_memory_bytes", "Memory by kind on each rank", labels=["run_id", "rank", "kind"])
        for rank, kinds in sorted(self.memory.items()):
            for kind, v in sorted(kinds.items()):
                mem.add_metric([rid, rank, kind], v)
        yield mem
        tier = GaugeMetricFamily("etrain_recovery_tier_bytes", "Host bytes the memory tier holds on each rank "
                                 "(its snapshots and the copies it holds for peers)", labels=["run_id", "rank"])
        for rank, v in sorted(self.tier_bytes.items()):
            tier.add_metric([rid, rank], v)
        yield tier

        # checkpoints
        yield counter("etrain_checkpoint_saves", "Checkpoints committed", self.saves_total)
        yield counter("etrain_checkpoint_failures", "Checkpoint saves that failed", self.save_failures_total)
        yield counter("etrain_checkpoint_skipped", "Saves skipped because one was in flight (when_busy=skip)",
                      self.saves_skipped_total)
        yield counter("etrain_checkpoint_bytes", "Bytes written by committed checkpoints", self.ckpt_bytes_total)
        yield hist("etrain_checkpoint_blocking_seconds", "Seconds a save blocked training", self.ckpt_blocking)
        yield hist("etrain_checkpoint_persist_seconds", "Seconds from a save's upload start to its commit",
                   self.ckpt_persist)
        yield gauge("etrain_checkpoint_throughput_bytes_per_second", "Bytes per second of the last committed save",
                    self.ckpt_throughput)
        yield gauge("etrain_checkpoint_last_committed_step", "Step of the newest committed checkpoint",
                    self.last_committed_step)
        age = self.clock() - self.last_commit_time if self.last_commit_time is not None else None
        yield gauge("etrain_checkpoint_age_seconds", "Seconds since the newest checkpoint committed", age)

        # recovery and the run
        f = CounterMetricFamily("etrain_failures", "Failures by kind", labels=["run_id", "kind"])
        for kind, n in sorted(self.failures.items()):
            f.add_metric([rid, kind], n)
        yield f
        p = CounterMetricFamily("etrain_preemptions", "Preemptions by action and reason",
                                labels=["run_id", "action", "reason"])
        for (action, reason), n in sorted(self.preemptions.items()):
            p.add_metric([rid, action, reason], n)
        yield p
        yield counter("etrain_recoveries", "Recoveries completed (first step after a failure)", self.recoveries_total)
        yield counter("etrain_resizes", "Resizes completed", self.resizes_total)
        yield counter("etrain_steps_lost", "Steps trained again after recoveries", self.steps_lost_total)
        yield hist("etrain_steps_lost_per_failure", "Steps lost by one recovery (trained, then rolled back)",
                   self.steps_lost_per_failure)
        yield hist("etrain_time_to_detect_seconds", "Last completed step before a failure to its detection",
                   self.time_to_detect)
        yield hist("etrain_time_to_recover_seconds", "Detection of a failure to the first step after it",
                   self.time_to_recover)
        yield gauge("etrain_world_size", "Workers in the training group", self.world_size)
        yield gauge("etrain_epoch", "Group epoch (fencing token)", self.epoch)
        ph = GaugeMetricFamily("etrain_phase", "1 for the run's current phase", labels=["run_id", "phase"])
        for p in PHASES:
            ph.add_metric([rid, p], 1.0 if p == self.phase else 0.0)
        yield ph
        yield gauge("etrain_queue_wait_seconds", "Seconds the run has waited in QUEUED for its gang (or held "
                    "by the allocator), the current wait included", self.queue_wait_s)
        yield gauge("etrain_goodput_ratio", "Effective training time (steps the model holds) over wall time "
                    "since the start", self.goodput)
        yield gauge("etrain_step_time_ratio", "Time of every step trained (redone ones too) over wall time "
                    "since the start", self.step_time_ratio)
        yield gauge("etrain_start_time_seconds", "Unix time the controller (or rank 0) started", self.started)


def goodput_ratio(productive_s: float, wall_s: float) -> float:
    """``productive_s`` over ``wall_s``, at most 1 (both launchers report their goodput figures so)."""
    return min(1.0, max(0.0, productive_s) / max(1e-9, wall_s))


class StepLedger:
    """Which trained steps the model holds, and their time: the numerator of ``etrain_goodput_ratio``.

        ledger = StepLedger()
        for step, seconds in rows:          # every step trained, in the order trained (redone ones again)
            ledger.trained(step, seconds)
        lost = ledger.restored(140)          # a group restored step 140: later steps leave the model
        ledger.effective_s                   # time of the steps the model holds now (ETTR's numerator)
        ledger.step_time_s                   # time of every step trained (``etrain_step_time_ratio``)

    Effective training time counts each step of the model's lineage once: a step trained after
    the last commit before a failure and rolled back by the restore leaves it, and its new
    execution counts instead. A rollback is known either way: from the restore (``restored``),
    or from the history itself: after a restore to ``r`` the next step trained is ``r + 1``, and
    held steps numbered ``r + 1`` or later mean that those were rolled back. Checkpoint blocking,
    evaluation, forming, restoring and waiting are outside every step's own time, so they count in
    neither figure: only in the wall time they are divided by.

    A pure value: no clock, no I/O. Memory: 16 bytes per step held.
    """

    def __init__(self):
        self.steps = array("q")  # the steps the model holds, ascending
        self.seconds = array("d")  # their time
        self.effective_s = 0.0
        self.step_time_s = 0.0

    def trained(self, step: int, seconds: float) -> int:
        """Step ``step`` was trained in ``seconds``; returns how many held steps it rolled back."""
        seconds = max(0.0, float(seconds))
        self.step_time_s += seconds
        lost = self.restored(step - 1)
        self.steps.append(int(step))
        self.seconds.append(seconds)
        self.effective_s += seconds
        return lost

    def restored(self, step: int) -> int:
        """The model went back to ``step`` (a restore): every held step after it leaves the effective
        time. Returns how many did (the steps that restore lost, as far as they were reported)."""
        n = len(self.steps)
        keep = n
        while keep and self.steps[keep - 1] > step:
            keep -= 1
        if keep == n:
            return 0
        self.effective_s = max(0.0, self.effective_s - sum(self.seconds[keep:]))
        del self.steps[keep:]
        del self.seconds[keep:]
        return n - keep

    @property
    def held(self) -> int:
        """How many trained steps the model holds (reported ones)."""
        return len(self.steps)
