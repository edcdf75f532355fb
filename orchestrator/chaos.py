"""``etrain chaos``: inject faults into a live run, then judge it against a failure-free reference.

    etrain chaos RUN --plan chaos.toml [--reference [REF_RUN]] [--plot run.png] [--json]
    etrain chaos RUN --fault kind=kill_worker,at_step=10 --fault kind=hang_rank,every_s=60,max_count=2

A plan is a list of faults, each with a schedule::

    [chaos]
    seed = 1
    loss_rtol = 1e-3          # the loss curve must stay this close to the reference's, step by step

    [[fault]]
    kind = "kill_worker"      # SIGKILL one worker process
    at_step = 10              # once, when the run reaches step 10
    rank = 1                  # which rank (default: a random one)

    [[fault]]
    kind = "kill_node"        # the raylet of the node a rank runs on, and every process it started
    after_fault = 0           # 0.5 s after fault 0 was injected: a second fault during its recovery
    delay_s = 0.5

    [[fault]]
    kind = "hang_rank"        # SIGSTOP one worker: it stops answering and its peers block
    every_s = 60              # repeatedly (max_count bounds it)
    max_count = 2

    [[fault]]
    kind = "storage"          # checkpoint storage slow / failing / truncating for duration_s
    random = true             # at random times, gaps drawn from [min_gap_s, max_gap_s] (seeded)
    min_gap_s = 15
    max_gap_s = 30
    duration_s = 10
    error_rate = 0.5
    delay_s = 0.2

    [[fault]]
    kind = "etcd_outage"      # the run store's etcd stops serving for duration_s (this machine's etcd)
    at_step = 30
    duration_s = 8
    mode = "stop"             # "stop": SIGSTOP/SIGCONT; "restart": end it and start it again

    [[fault]]
    kind = "partition_node"   # cut the node a rank runs on off the network for duration_s (default 20)
    at_step = 50              # (a node in a network namespace of its own: orchestrator/netns.py)
    rank = 0

Faults fire only while the run is RUNNING (an ``after_fault`` one fires on
time, whatever the phase). Worker processes are found from the run's last
``formed`` event; signals reach other nodes through a Ray task pinned to the
node, so ``etrain chaos`` connects to the run's Ray cluster (``--address``).

The report, for every fault: when it was injected, detected and recovered
(time to detect: injection to the controller's failure event; time to
recover: injection to the first step after the recovery), steps lost and
committed steps lost; p50/p95 over faults; goodput; and the oracle's verdict
against a failure-free reference run of the same config: the same final
step; every step trained once in the final trajectory with its data cursor
at exactly step x global batch (no sample skipped or repeated); the loss at
every step within ``loss_rtol`` of the reference; every committed checkpoint
verifies; no checkpoint committed by an epoch after a newer one formed (a
stale writer the fence should have refused).

A partition needs a link to cut: the nodes of a one-machine Ray cluster share
one loopback interface, so ``partition_node`` works on nodes started in
network namespaces of their own on the machine where ``etrain chaos`` runs
(``python -m orchestrator.netns node ...``), and says so for any other node.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import time
import tomllib
from dataclasses import dataclass, field

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from . import netns
from .phase import Phase
from .store import RunStore, StoreUnavailable

log = logging.getLogger("etrain")

KINDS = ("kill_worker", "kill_node", "hang_rank", "storage", "etcd_outage", "partition_node")
# Faults that take a member out of the group: the controller must see a failure and re-form without it.
PROCESS_KINDS = ("kill_worker", "kill_node", "hang_rank", "partition_node")
WINDOW_S = {"partition_node": 20.0}  # duration_s when the plan leaves it out; 10 s for the other kinds


# --- the plan --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class FaultSpec:
    kind: str
    # schedule: exactly one of at_step, every_s, random, after_fault
    at_step: int | None = None
    every_s: float | None = None
    random: bool = False
    min_gap_s: float = 15.0
    max_gap_s: float = 30.0
    after_fault: int | None = None
    delay_s: float = 0.0  # after_fault: seconds after that fault; storage: added latency per request
    max_count: int = 1_000_000
    # targets and windows
    rank: int | None = None
    duration_s: float | None = None  # storage, etcd_outage, partition_node: how long the fault lasts
    error_rate: float = 0.0
    truncate_rate: float = 0.0
    mode: str = "stop"

    def __post_init__(self) -> None:
        where = f"fault kind={self.kind!r}"
        if self.kind in ("net_partition", "partition", "network_partition"):
            raise ConfigError(f"{where} is unknown; a network partition is kind=\"partition_node\" (cuts the link of "
                              "a node in a network namespace of its own; docs/chaos.md)")
        if self.kind not in KINDS:
            raise ConfigError(f"{where} is unknown; use one of {', '.join(KINDS)}")
        schedules = [self.at_step is not None, self.every_s is not None, self.random, self.after_fault is not None]
        if sum(schedules) != 1:
            raise ConfigError(f"{where} needs exactly one schedule: at_step = N, every_s = T, random = true "
                              "(with min_gap_s, max_gap_s) or after_fault = I (with delay_s)")
        if self.every_s is not None and self.every_s <= 0:
            raise ConfigError(f"{where}: every_s={self.every_s} must be > 0")
        if self.random and not 0 < self.min_gap_s <= self.max_gap_s:
            raise ConfigError(f"{where}: need 0 < min_gap_s <= max_gap_s (got {self.min_gap_s}, {self.max_gap_s})")
        if self.duration_s is None:
            self.duration_s = WINDOW_S.get(self.kind, 10.0)
        if self.duration_s <= 0:
            raise ConfigError(f"{where}: duration_s={self.duration_s} must be > 0")
        if self.mode not in ("stop", "restart"):
            raise ConfigError(f"{where}: mode={self.mode!r}; use \"stop\" (SIGSTOP/SIGCONT) or \"restart\"")
        if self.kind == "storage" and not (self.error_rate or self.truncate_rate or self.delay_s):
            raise ConfigError(f"{where}: set at least one of error_rate, truncate_rate, delay_s")

    def storage_faults(self, seed: int) -> dict:
        return {"error_rate": self.error_rate, "truncate_rate": self.truncate_rate, "delay_s": self.delay_s,
                "seed": seed}


@dataclass(kw_only=True)
class ChaosPlan:
    faults: list[FaultSpec]
    seed: int = 0
    loss_rtol: float = 1e-3
    loss_atol: float = 1e-6

    def __post_init__(self) -> None:
        if not self.faults:
            raise ConfigError("the chaos plan has no [[fault]]; add one, or pass --fault kind=...,at_step=N")
        for i, f in enumerate(self.faults):
            if f.after_fault is not None and not 0 <= f.after_fault < i:
                raise ConfigError(f"fault {i}: after_fault={f.after_fault} must name an earlier fault (0..{i - 1})")


def _parse_flag(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"--fault {text!r}: {part!r} must look like key=value")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = tomllib.loads(f"v = {v.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[k.strip()] = v.strip()
    return out


def load_plan(path: str | None, flags: list[str] | None = None) -> ChaosPlan:
    """A plan from a TOML file and/or ``--fault key=value,...`` flags; ConfigError names the field."""
    raw: dict = {}
    if path:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    unknown = set(raw) - {"chaos", "fault"}
    if unknown:
        raise ConfigError(f"chaos plan: unknown section(s) {', '.join(sorted(unknown))}; use [chaos] and [[fault]]")
    known = set(FaultSpec.__dataclass_fields__)
    faults = []
    for i, f in enumerate(list(raw.get("fault", [])) + [_parse_flag(t) for t in flags or []]):
        bad = set(f) - known
        if bad:
            raise ConfigError(f"fault {i}: unknown key(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(known))}")
        if "kind" not in f:
            raise ConfigError(f"fault {i}: kind is missing; use one of {', '.join(KINDS)}")
        try:
            faults.append(FaultSpec(**f))
        except TypeError as e:
            raise ConfigError(f"fault {i}: {e}") from None
    top = raw.get("chaos", {})
    bad = set(top) - {"seed", "loss_rtol", "loss_atol"}
    if bad:
        raise ConfigError(f"[chaos]: unknown key(s) {', '.join(sorted(bad))}; known: seed, loss_rtol, loss_atol")
    return ChaosPlan(faults=faults, **top)


# --- processes, nodes and etcd ----------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def kill_node_of(pid: int) -> int:
    """SIGKILL the raylet that started ``pid`` (a Ray worker process) and every process it started.
    Runs on the node itself. Returns the raylet's pid."""
    raylet = _parent(pid)
    with open(f"/proc/{raylet}/cmdline") as f:
        if "raylet" not in f.read():
            raise RuntimeError(f"process {pid}'s parent {raylet} is not a raylet")
    for child in _children(raylet):
        if child != os.getpid():
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(raylet, signal.SIGKILL)
    return raylet


def _signal(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _local_addresses() -> set[str]:
    out = {"127.0.0.1", "localhost"}
    try:
        out.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return out


def on_node(node_id: str, fn, *args):
    """Run ``fn(*args)`` on the node ``node_id``: here when the node is this machine, else in a Ray
    task pinned to the node."""
    import ray

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node["Alive"]:
        raise RuntimeError(f"node {node_id[:8]} is not alive")
    if node["NodeManagerAddress"] in _local_addresses():
        return fn(*args)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    ref = task.remote(*args)
    try:
        return ray.get(ref, timeout=30)
    except Exception as e:  # killing its own raylet ends the task too
        return f"(no answer: {type(e).__name__})"


def is_head(node_id: str) -> bool:
    import ray

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    return "node:__internal_head__" in node.get("Resources", {})


def pid_listening_on(port: int) -> int | None:
    """The local process that listens on TCP ``port`` (from /proc/net/tcp and the processes' fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(cols[9])
        except OSError:
            pass
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                link = os.readlink(f"/proc/{d}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(d)
        except OSError:
            continue
    return None


class EtcdControl:
    """Stops and restarts the etcd behind an ``etcd://host:port`` run store, when it runs on this machine."""

    def __init__(self, store_url: str):
        if not store_url.startswith("etcd://"):
            raise ConfigError(f"etcd_outage needs an etcd run store (--store etcd://host:port); this run's is "
                              f"{redact(store_url)}")
        hostport = store_url[len("etcd://"):].split("/", 1)[0]
        self.port = int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 2379
        self.pid: int | None = None
        self.cmdline: list[str] = []
        self.cwd = "/"

    def _find(self) -> int:
        pid = pid_listening_on(self.port)
        if pid is None:
            raise RuntimeError(f"no process on this machine listens on port {self.port}: etcd_outage can only "
                               "stop an etcd that runs where `etrain chaos` runs")
        return pid

    def stop(self, mode: str) -> None:
        self.pid = self._find()
        if mode == "stop":
            os.kill(self.pid, signal.SIGSTOP)
            return
        with open(f"/proc/{self.pid}/cmdline") as f:
            self.cmdline = [a for a in f.read().split("\0") if a]
        self.cwd = os.readlink(f"/proc/{self.pid}/cwd")
        os.kill(self.pid, signal.SIGTERM)
        for _ in range(100):
            if not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.1)

    def start(self, mode: str) -> None:
        if mode == "stop":
            os.kill(self.pid, signal.SIGCONT)
            return
        import subprocess

        subprocess.Popen(self.cmdline, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


# --- injection ---------------------------------------------------------------------------------


@dataclass
class Injection:
    fault: int  # index in the plan
    kind: str
    time: float  # unix
    step: int
    target: dict = field(default_factory=dict)
    ended: float | None = None  # windows (storage, etcd, partition): when the fault was lifted
    committed: int | None = None  # the newest committed step the driver knew of at injection
    error: str | None = None


class Chaos:
    """Drives a plan against a live run and records what it injected."""

    def __init__(self, run_id: str, store: RunStore, plan: ChaosPlan, *, poll_s: float = 0.2):
        self.run_id, self.store, self.plan, self.poll_s = run_id, store, plan, poll_s
        self.rng = random.Random(plan.seed)
        self.injections: list[Injection] = []
        self.counts = [0] * len(plan.faults)
        self.next_at: list[float | None] = [None] * len(plan.faults)
        self.open_windows: list[tuple[Injection, FaultSpec]] = []
        self.status: dict = {}
        self.etcd: EtcdControl | None = None
        self.next_node_check = 0.0
        self.started = time.time()

    # --- the loop ---

    def run(self, timeout_s: float = 3600.0) -> dict:
        """Inject until the run ends (or ``timeout_s``); returns the run's final status."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    self.status = self.store.get_status(self.run_id) or self.status
                except StoreUnavailable:
                    pass  # our own etcd outage, most likely: go on with the last status
                now = time.time()
                if Phase.of(self.status).terminal:
                    break
                self._close_windows(now)
                self._watch_partitions(now)
                for i, spec in enumerate(self.plan.faults):
                    if self._due(i, spec, now):
                        self.inject(i, spec)
                time.sleep(self.poll_s)
        finally:  # whatever ends the loop (Ctrl-C included), no link stays cut and no etcd stopped
            self._close_windows(float("inf"))
        return self.status

    def _due(self, i: int, spec: FaultSpec, now: float) -> bool:
        if self.counts[i] >= spec.max_count or Phase.of(self.status).terminal:
            return False
        if spec.after_fault is not None:
            first = next((j for j in self.injections if j.fault == spec.after_fault), None)
            return self.counts[i] == 0 and first is not None and now >= first.time + spec.delay_s
        if Phase.of(self.status) != Phase.RUNNING:
            return False
        if spec.at_step is not None:
            return self.counts[i] == 0 and int(self.status.get("step") or 0) >= spec.at_step
        if self.next_at[i] is None:
            self.next_at[i] = now + (spec.every_s if spec.every_s is not None
                                     else self.rng.uniform(spec.min_gap_s, spec.max_gap_s))
        if now < self.next_at[i]:
            return False
        self.next_at[i] = now + (spec.every_s if spec.every_s is not None
                                 else self.rng.uniform(spec.min_gap_s, spec.max_gap_s))
        return True

    def inject(self, i: int, spec: FaultSpec) -> Injection:
        self.counts[i] += 1
        inj = Injection(i, spec.kind, time.time(), int(self.status.get("step") or 0),
                        committed=self.status.get("latest_checkpoint"))
        try:
            getattr(self, f"_inject_{spec.kind}")(inj, spec)
        except Exception as e:  # recorded and reported: a fault that could not be injected fails the run's verdict
            inj.error = f"{type(e).__name__}: {e}"
            log.error("chaos: %s could not be injected: %s", spec.kind, inj.error)
        self.injections.append(inj)
        log.warning("chaos: injected %s at step %d %s", spec.kind, inj.step, inj.target or "")
        return inj

    def _close_windows(self, now: float) -> None:
        """Lift the window faults whose duration is over (all of them when ``now`` is infinite)."""
        ended = Phase.of(self.status).terminal
        for inj, spec in list(self.open_windows):
            if now >= inj.time + spec.duration_s:
                if ended:
                    inj.target["until_end"] = True
                try:
                    if spec.kind == "storage":
                        if not ended:  # a run that ended took its workers (and their faults) with it
                            self._controller().set_storage_faults.remote(None)
                    elif spec.kind == "partition_node":
                        netns.set_link(inj.target["link"], up=True)
                    else:
                        self.etcd.start(spec.mode)
                except Exception as e:
                    inj.error = f"lifting the fault: {type(e).__name__}: {e}"
                inj.ended = time.time()
                self.open_windows.remove((inj, spec))

    def _watch_partitions(self, now: float) -> None:
        """When Ray declares a cut-off node dead (its health checks fail): seconds after the cut."""
        open_cuts = [inj for inj, spec in self.open_windows
                     if spec.kind == "partition_node" and "node_dead_after_s" not in inj.target]
        if not open_cuts or now < self.next_node_check:
            return
        self.next_node_check = now + 0.5
        import ray

        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        for inj in open_cuts:
            if not alive.get(inj.target["node"], False):
                inj.target["node_dead_after_s"] = round(now - inj.time, 2)

    # --- targets ---

    def _members(self) -> list[dict]:
        """Rank -> {pid, node} from the newest ``formed`` event."""
        formed = [e for e in self.store.events(self.run_id) if e.get("kind") == "formed"]
        if not formed:
            raise RuntimeError("the run has not formed a group yet")
        last = formed[-1]
        return [{"rank": r, "pid": pid, "node": node} for r, (pid, node) in
                enumerate(zip(last["pids"], last.get("nodes") or [""] * len(last["pids"])))]

    def _target(self, spec: FaultSpec) -> dict:
        members = self._members()
        alive = [m for m in members if not any(j.target.get("pid") == m["pid"] for j in self.injections)]
        if spec.rank is not None:
            pick = next((m for m in members if m["rank"] == spec.rank), None)
            if pick is None:
                raise RuntimeError(f"rank {spec.rank} is not in the group (world size {len(members)})")
            if pick not in alive and alive:  # that rank's process was hit already: its successor in rank order
                pick = alive[spec.rank % len(alive)]
            return pick
        if not alive:
            raise RuntimeError("every member was hit already")
        return self.rng.choice(alive)

    def _inject_kill_worker(self, inj: Injection, spec: FaultSpec) -> None:
        t = inj.target = self._target(spec)
        on_node(t["node"], _signal, t["pid"], signal.SIGKILL)

    def _inject_hang_rank(self, inj: Injection, spec: FaultSpec) -> None:
        t = inj.target = self._target(spec)
        on_node(t["node"], _signal, t["pid"], signal.SIGSTOP)

    def _inject_kill_node(self, inj: Injection, spec: FaultSpec) -> None:
        t = inj.target = self._target(spec)
        if is_head(t["node"]):
            raise RuntimeError(f"rank {t['rank']} runs on the head node; killing it ends the cluster "
                               "(choose another rank)")
        import ray

        if t["node"] == ray.get(self._controller().node_id.remote(), timeout=30):
            raise RuntimeError(f"rank {t['rank']} runs on the node of the run's controller (the driver's node); "
                               "killing it ends the run (choose another rank)")
        t["raylet"] = on_node(t["node"], kill_node_of, t["pid"])

    def _inject_partition_node(self, inj: Injection, spec: FaultSpec) -> None:
        """Cut the link of the network namespace the rank's node runs in; healed after ``duration_s``."""
        t = inj.target = self._target(spec)
        import ray

        node = next((n for n in ray.nodes() if n["NodeID"] == t["node"]), None)
        if node is None or not node["Alive"]:
            raise RuntimeError(f"rank {t['rank']}'s node {t['node'][:8]} is not alive")
        if is_head(t["node"]) or t["node"] == ray.get(self._controller().node_id.remote(), timeout=30):
            raise RuntimeError(f"rank {t['rank']} runs on the node of the head or the run's controller; cutting it "
                               "off ends the run, not a member (choose another rank)")
        t["netns"], t["link"] = netns.node_link(t["pid"], node["NodeManagerAddress"])
        t["node_ip"] = node["NodeManagerAddress"]
        netns.set_link(t["link"], up=False)
        self.open_windows.append((inj, spec))

    def _inject_storage(self, inj: Injection, spec: FaultSpec) -> None:
        import ray

        faults = spec.storage_faults(self.plan.seed + inj.fault)
        inj.target = {"workers": ray.get(self._controller().set_storage_faults.remote(faults), timeout=30),
                      **faults}
        self.open_windows.append((inj, spec))

    def _inject_etcd_outage(self, inj: Injection, spec: FaultSpec) -> None:
        self.etcd = self.etcd or EtcdControl(self.store.url)
        self.etcd.stop(spec.mode)
        inj.target = {"port": self.etcd.port, "pid": self.etcd.pid, "mode": spec.mode}
        self.open_windows.append((inj, spec))

    def _controller(self):
        from .run import controller_actor

        actor = controller_actor(self.run_id)
        if actor is None:
            raise RuntimeError(f"no live controller for run {self.run_id!r} in this Ray cluster")
        return actor


# --- the report and the oracle -------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def assess(injections: list[Injection], events: list[dict], history: list[list]) -> list[dict]:
    """Detection and recovery of each injected fault, from the run's events and step history."""
    failures = [e for e in events if e.get("kind") == "failure"]
    recovered = [e for e in events if e.get("kind") == "recovered"]
    formed = [e for e in events if e.get("kind") == "formed"]
    ckpt_failed = [e for e in events if e.get("kind") == "checkpoint_failed"]
    # A window fault that outlived the run's last step (its final save may have run inside it) was
    # trained through when the run finished.
    finished = any(e.get("kind") == "finished" for e in events)
    used: set[int] = set()
    out = []
    for inj in injections:
        row = {"fault": inj.fault, "kind": inj.kind, "step": inj.step, "injected_unix": inj.time,
               "target": inj.target, "error": inj.error, "detected": False, "recovered": False,
               "time_to_detect_s": None, "time_to_recover_s": None, "steps_lost": None,
               "committed_steps_lost": None}
        if inj.kind in PROCESS_KINDS and not inj.error:
            det = next((k for k, e in enumerate(failures) if k not in used and e["time"] >= inj.time - 0.5), None)
            pid = inj.target.get("pid")
            # A second fault during a recovery may be absorbed by it: the victim is left out of the next group.
            dropped = next((e for e in formed if e["time"] >= inj.time and pid not in e.get("pids", [])), None)
            t_det = None
            if det is not None:
                used.add(det)
                t_det = failures[det]["time"]
            elif dropped is not None:
                t_det = dropped["time"]
            if t_det is not None:
                row.update(detected=True, time_to_detect_s=max(0.0, t_det - inj.time))
                rec = next((e for e in recovered if e.get("first_step_unix") and e["first_step_unix"] >= t_det), None)
                if rec is not None:
                    row.update(recovered=True, time_to_recover_s=rec["first_step_unix"] - inj.time,
                               steps_lost=rec.get("steps_lost"), restored_step=rec.get("restored_step"),
                               committed_steps_lost=max(0, (inj.committed or 0) - rec.get("restored_step", 0)))
            if inj.kind == "partition_node":  # how long the link was cut; when Ray gave the node up
                row.update(partition_s=None if inj.ended is None else round(inj.ended - inj.time, 2),
                           node_dead_after_s=inj.target.get("node_dead_after_s"))
        elif inj.kind == "storage" and not inj.error:
            end = inj.ended or float("inf")
            failed = [e for e in ckpt_failed if inj.time <= e["time"] <= end + 60]
            row.update(detected=True, checkpoint_failures=len(failed), time_to_detect_s=0.0,
                       note="faults absorbed by retries" if not failed else "saves failed and were reported")
            # recovered: training went on through the window (a step completed after it ended, or the
            # run reached its last step while the fault was still on)
            after = next((h for h in history if h[4] >= end), None)
            if after is not None:
                row.update(recovered=True, time_to_recover_s=after[4] - inj.time, steps_lost=0,
                           committed_steps_lost=0)
            elif (inj.target.get("until_end") or finished) and any(h[4] >= inj.time for h in history):
                row.update(recovered=True, steps_lost=0, committed_steps_lost=0,
                           note=row["note"] + "; the run finished with the fault still on")
        elif inj.kind == "etcd_outage" and not inj.error:
            end = inj.ended or float("inf")
            during = [h for h in history if inj.time <= h[4] <= end]
            after = next((h for h in history if h[4] >= end), None)
            row.update(detected=True, time_to_detect_s=0.0, steps_during_outage=len(during))
            if after is not None:
                row.update(recovered=True, time_to_recover_s=after[4] - inj.time, steps_lost=0,
                           committed_steps_lost=0)
        out.append(row)
    return out


def final_trajectory(history: list[list]) -> dict[int, list]:
    """Step -> its last row: a step redone after a restore replaces the lost one."""
    out: dict[int, list] = {}
    for row in history:
        out[int(row[0])] = row
    return out


def oracle(run: dict, ref: dict | None, *, total_steps: int, global_batch: int, rtol: float, atol: float,
           verify_problems: dict[int, list[str]], final_cursor: int | None, restored_up_to: int = 0) -> list[str]:
    """Reasons the run fails the oracle (empty: it passes). ``run``/``ref``: {"status", "history"}.

    A step missing from the history is accepted only when a group restored a checkpoint at or after
    it (its rank 0 died before reporting it, but the checkpoint proves it was trained)."""
    reasons = []
    st = run["status"]
    if Phase.of(st) != Phase.FINISHED:
        reasons.append(f"the run ended {st.get('phase')} ({st.get('reason', '')}), not FINISHED")
    if st.get("step") != total_steps:
        reasons.append(f"final step {st.get('step')}, expected {total_steps}")
    traj = final_trajectory(run["history"])
    missing = [s for s in range(restored_up_to + 1, total_steps + 1) if s not in traj]
    if missing:
        reasons.append(f"steps never trained: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    bad_cursor = [s for s, row in traj.items() if int(row[3]) != s * global_batch]
    if bad_cursor:
        s = bad_cursor[0]
        reasons.append(f"data cursor off at step {s}: {traj[s][3]} samples consumed, expected {s * global_batch} "
                       "(a sample skipped or repeated)")
    if final_cursor is not None and final_cursor != total_steps * global_batch:
        reasons.append(f"the final checkpoint's cursor is {final_cursor}, expected {total_steps * global_batch}")
    for step, problems in sorted(verify_problems.items()):
        if problems:
            reasons.append(f"committed checkpoint step {step} does not verify: {problems[0]}")
    if ref is not None:
        if ref["status"].get("step") != st.get("step"):
            reasons.append(f"final step {st.get('step')} differs from the reference's {ref['status'].get('step')}")
        rt = final_trajectory(ref["history"])
        worst = max(((abs(traj[s][1] - rt[s][1]) / max(abs(rt[s][1]), 1e-12), s) for s in traj if s in rt),
                    default=(0.0, None))
        over = [s for s in traj if s in rt and abs(traj[s][1] - rt[s][1]) > atol + rtol * abs(rt[s][1])]
        if over:
            s = over[0]
            reasons.append(f"loss at step {s} is {traj[s][1]:.6g}, the reference's {rt[s][1]:.6g}: beyond "
                           f"rtol {rtol:g} (worst relative difference {worst[0]:.3g} at step {worst[1]})")
    return reasons


def report(run_id: str, plan: ChaosPlan, rows: list[dict], status: dict, reasons: list[str],
           ref_id: str | None, loss_diff: float | None) -> dict:
    ttd = [r["time_to_detect_s"] for r in rows if r["time_to_detect_s"] is not None and r["kind"] in PROCESS_KINDS]
    ttr = [r["time_to_recover_s"] for r in rows if r["time_to_recover_s"] is not None]
    problems = list(reasons)
    for r in rows:
        if r["error"]:
            problems.append(f"fault {r['fault']} ({r['kind']}) was not injected: {r['error']}")
        elif not r["recovered"]:
            problems.append(f"fault {r['fault']} ({r['kind']}) at step {r['step']}: "
                            + ("detected but not recovered" if r["detected"] else "never detected"))
        elif r.get("committed_steps_lost"):
            problems.append(f"fault {r['fault']} ({r['kind']}): {r['committed_steps_lost']} committed steps lost")
    return {
        "run_id": run_id, "reference": ref_id, "passed": not problems, "reasons": problems,
        "faults_injected": sum(1 for r in rows if not r["error"]),
        "faults_detected": sum(1 for r in rows if r["detected"]),
        "faults_recovered": sum(1 for r in rows if r["recovered"]),
        "time_to_detect_s": {"p50": _pct(ttd, 0.5), "p95": _pct(ttd, 0.95)},
        "time_to_recover_s": {"p50": _pct(ttr, 0.5), "p95": _pct(ttr, 0.95)},
        "steps_lost": sum(r["steps_lost"] or 0 for r in rows),
        "committed_steps_lost": sum(r["committed_steps_lost"] or 0 for r in rows),
        "goodput": status.get("goodput"), "final_step": status.get("step"), "phase": status.get("phase"),
        "max_loss_rel_diff": loss_diff, "loss_rtol": plan.loss_rtol, "faults": rows,
    }


def loss_rel_diff(history: list[list], ref_history: list[list]) -> float | None:
    a, b = final_trajectory(history), final_trajectory(ref_history)
    diffs = [abs(a[s][1] - b[s][1]) / max(abs(b[s][1]), 1e-12) for s in a if s in b]
    return max(diffs) if diffs else None


def verify_committed(ckpt_url: str, run_id: str) -> tuple[dict[int, list[str]], int | None]:
    """Every committed checkpoint's problems (empty lists when it verifies), and the newest one's cursor."""
    from checkpointing.manager import CheckpointManager

    if not ckpt_url:
        return {}, None
    mgr = CheckpointManager(ckpt_url, run_id)
    steps = mgr.committed_steps()
    problems = {s: mgr.verify(s) for s in steps}
    cursor = mgr.read_manifest(steps[-1]).trainer_state.get("samples_consumed") if steps else None
    return problems, cursor


def stale_commits(ckpt_url: str, run_id: str, events: list[dict]) -> list[str]:
    """Committed checkpoints whose commit came after a newer epoch formed: writers the fence should have
    refused (a partitioned or hung rank that lived on). A manifest's time is taken after its writer read
    the fence, and an epoch's ``formed`` event is written after the fence moved to it."""
    from checkpointing.manager import CheckpointManager

    formed = [(e["epoch"], e["time"]) for e in events if e.get("kind") == "formed" and "epoch" in e]
    if not ckpt_url or not formed:
        return []
    mgr = CheckpointManager(ckpt_url, run_id)
    out = []
    for step in mgr.committed_steps():
        m = mgr.read_manifest(step)
        newer = min((t for epoch, t in formed if epoch > m.epoch), default=None)
        if newer is not None and m.created_unix > newer:
            out.append(f"checkpoint step {step} was committed by epoch {m.epoch} {m.created_unix - newer:.2f} s after "
                       "a newer epoch formed: a stale writer got past the fence")
    return out


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}".rstrip()


def format_report(r: dict) -> str:
    s = _fmt
    lines = [f"chaos report for run {r['run_id']}" + (f" (reference {r['reference']})" if r["reference"] else ""),
             f"  faults: {r['faults_injected']} injected, {r['faults_detected']} detected, "
             f"{r['faults_recovered']} recovered",
             f"  time to detect  p50 {s(r['time_to_detect_s']['p50'])}  p95 {s(r['time_to_detect_s']['p95'])}",
             f"  time to recover p50 {s(r['time_to_recover_s']['p50'])}  p95 {s(r['time_to_recover_s']['p95'])}",
             f"  steps lost {r['steps_lost']} (committed {r['committed_steps_lost']}); goodput "
             f"{'-' if r['goodput'] is None else format(r['goodput'], '.3f')}; final step {r['final_step']} "
             f"({r['phase']})"]
    if r["max_loss_rel_diff"] is not None:
        lines.append(f"  loss vs reference: max relative difference {r['max_loss_rel_diff']:.3g} "
                     f"(tolerance {r['loss_rtol']:g})")
    for f in r["faults"]:
        lines.append(f"  - fault {f['fault']} {f['kind']} at step {f['step']}: "
                     + (f"not injected ({f['error']})" if f["error"] else
                        f"detected {s(f['time_to_detect_s'])}, recovered {s(f['time_to_recover_s'])}, "
                        f"steps lost {f['steps_lost']}" + _partition_note(f)))
    lines.append("  PASS" if r["passed"] else "  FAIL: " + "; ".join(r["reasons"]))
    return "\n".join(lines)


def _partition_note(f: dict) -> str:
    if f["kind"] != "partition_node" or f["error"]:
        return ""
    dead = f.get("node_dead_after_s")
    ray_view = "the node still alive for Ray when healed" if dead is None else f"node declared dead after {dead:.2f} s"
    t = f["target"]
    return f"; link {t.get('link')} ({t.get('netns')}) cut for {_fmt(f.get('partition_s'))}, {ray_view}"


def plot(path: str, history: list[list], rows: list[dict], ref_history: list[list] | None = None,
         title: str = "") -> None:
    """Loss and world size over time, each fault (red) and recovery (green) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("the run has no step history to plot")
    t0 = min(h[4] for h in history)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot([h[4] - t0 for h in history], [h[1] for h in history], ".-", ms=3, label="loss")
    if ref_history:
        traj = final_trajectory(history)
        rt = final_trajectory(ref_history)
        xs = [traj[s][4] - t0 for s in sorted(traj) if s in rt]
        ax1.plot(xs, [rt[s][1] for s in sorted(traj) if s in rt], "--", lw=1, label="reference (by step)")
    ax2.step([h[4] - t0 for h in history], [h[2] for h in history], where="post", label="world size")
    for r in rows:
        for ax in (ax1, ax2):
            ax.axvline(r["injected_unix"] - t0, color="red", lw=1, alpha=0.7)
            if r["time_to_recover_s"] is not None:
                ax.axvline(r["injected_unix"] + r["time_to_recover_s"] - t0, color="green", lw=1, ls=":")
        ax1.annotate(r["kind"], (r["injected_unix"] - t0, ax1.get_ylim()[1]), fontsize=7, rotation=90,
                     va="top", color="red")
    ax1.set_ylabel("loss")
    ax2.set_ylabel("world size")
    ax2.set_xlabel("seconds since the first step")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title or "chaos run: faults (red), recoveries (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the command --------------------------------------------------------------------------------


def reference_run(spec, store: RunStore, ref_id: str, address: str | None) -> dict:
    """The failure-free reference: reuse ``ref_id`` when it FINISHED, else run the same config
    under that id (same workers, same checkpoint root) to the end."""
    from .run import launch
    from .store import RunSpec, UnknownRun

    try:
        store.get_spec(ref_id)
        st = store.get_status(ref_id) or {}
        if Phase.of(st) == Phase.FINISHED:
            return st
        raise ConfigError(f"reference run {ref_id!r} exists but is {st.get('phase', 'PENDING')}; "
                          "name a finished one, or another id for a new reference")
    except UnknownRun:
        pass
    config = json.loads(json.dumps(spec.config))
    config["run_id"] = ref_id
    ref = RunSpec(run_id=ref_id, config=config, workers=spec.workers, min_workers=spec.min_workers,
                  max_workers=spec.max_workers)
    store.create_run(ref)
    log.warning("chaos: running the reference %s (the same config, no faults)", ref_id)
    return launch(ref, store, address=address, progress=False)


def judge(run_id: str, store: RunStore, plan: ChaosPlan, chaos: Chaos | None, final: dict,
          ref_id: str | None = None) -> dict:
    """The report of a run that ended: detection and recovery of every fault, and the oracle."""
    from trainer.config import config_from_dict

    cfg = config_from_dict(store.get_spec(run_id).config)
    history = store.get_history(run_id)
    ref = None
    if ref_id is not None:
        ref = {"status": store.get_status(ref_id) or {}, "history": store.get_history(ref_id)}
    problems, cursor = verify_committed(cfg.checkpoint.url, run_id)
    events = store.events(run_id)
    restored = max((e.get("restored_from") or 0 for e in events if e.get("kind") == "formed"), default=0)
    reasons = oracle({"status": final, "history": history}, ref, total_steps=cfg.train.steps,
                     global_batch=cfg.train.global_batch, rtol=plan.loss_rtol, atol=plan.loss_atol,
                     verify_problems=problems, final_cursor=cursor, restored_up_to=restored)
    reasons += stale_commits(cfg.checkpoint.url, run_id, events)
    rows = assess(chaos.injections if chaos else [], events, history)
    diff = loss_rel_diff(history, ref["history"]) if ref else None
    out = report(run_id, plan, rows, final, reasons, ref_id, diff)
    out["checkpoints_verified"] = len(problems)
    out["steps_without_history"] = sum(1 for s in range(1, cfg.train.steps + 1)
                                       if s not in final_trajectory(history))
    return out


def main(args, store: RunStore) -> int:
    """``etrain chaos``: exit 0 when the run passed, 1 when it failed the oracle, 2 for a bad plan."""
    import ray

    plan = load_plan(args.plan, args.fault)
    spec = store.get_spec(args.run)  # UnknownRun names the fix
    if not ray.is_initialized():
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="etrain",
                 log_to_driver=False, logging_level="warning")
    chaos = Chaos(args.run, store, plan)
    print(f"etrain: chaos on run {args.run!r}: {len(plan.faults)} fault(s) planned", flush=True)
    final = chaos.run(timeout_s=args.timeout)
    ref_id = None
    if args.reference is not None:
        ref_id = args.reference or f"{args.run}-reference"
        reference_run(spec, store, ref_id, args.address)
    result = judge(args.run, store, plan, chaos, final, ref_id)
    if args.plot:
        plot(args.plot, store.get_history(args.run), result["faults"],
             store.get_history(ref_id) if ref_id else None, title=f"chaos: run {args.run}")
        result["plot"] = args.plot
    print(format_report(result), flush=True)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str), flush=True)
    return 0 if result["passed"] else 1
