"""The injector: drives a chaos plan against a live run and records what it injected.

    chaos = Chaos(run_id, store, load_plan("chaos.toml"))   # connected to the run's Ray cluster
    final = chaos.run(timeout_s=3600)                       # until the run ends; its final status
    chaos.injections                                        # [Injection]: what, when, on whom, errors

Faults fire only while the run is RUNNING (an ``after_fault`` one fires on time, whatever the phase).
Faults inside the trainer (``bitflip``, ``poison_batch``) are handed to the worker of a rank through the
run's controller (``set_health_faults``) and fire a few steps after the one the run is at (:meth:`Chaos.lead`).
Worker processes are found from the run's last ``formed`` event; signals reach other nodes through a Ray
task pinned to the node (:func:`on_node`). A fault that cannot be injected is recorded with its error
(it fails the verdict), never raised. Window faults (storage, etcd_outage, partition_node) are lifted
after ``duration_s``, and whatever ends the loop (Ctrl-C included) lifts every one still open: no link
stays cut and no etcd stopped.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field

from ..phase import Phase
from ..store.run_store import RunStore, StoreUnavailable
from . import procfs
from .etcd import EtcdControl
from .plan import ChaosPlan, FaultSpec

log = logging.getLogger("etrain")

# A fault inside the trainer fires at a step still to come: this many seconds of steps, past the two the run
# may be at already (:meth:`Chaos.lead`), cover the controller's progress poll and the calls that deliver it.
LEAD_S = 0.5


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


# --- processes and nodes ----------------------------------------------------------------------


def kill_node_of(pid: int) -> int:
    """SIGKILL the raylet that started ``pid`` (a Ray worker process) and every process it started.
    Runs on the node itself. Returns the raylet's pid."""
    raylet = procfs.parent(pid)
    if not any("raylet" in arg for arg in procfs.cmdline(raylet)):
        raise RuntimeError(f"process {pid}'s parent {raylet} is not a raylet")
    procfs.kill_tree(raylet, signal.SIGKILL)
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


# --- the injector -------------------------------------------------------------------------------


class Chaos:
    """Drives a plan against a live run and records what it injected."""

    def __init__(self, run_id: str, store: RunStore, plan: ChaosPlan, *, poll_s: float = 0.2,
                 add_node=None):
        self.run_id, self.store, self.plan, self.poll_s = run_id, store, plan, poll_s
        # add_node: cpus -> the new node's id; default `ray start` on this machine (tests add a LocalCluster node)
        self.add_node = add_node or ray_start_node
        self.rng = random.Random(plan.seed)
        self.injections: list[Injection] = []
        self.counts = [0] * len(plan.faults)
        self.next_at: list[float | None] = [None] * len(plan.faults)
        self.open_windows: list[tuple[Injection, FaultSpec]] = []
        self.status: dict = {}
        self.etcd: EtcdControl | None = None
        self.next_node_check = 0.0
        self.started = time.time()
        self.health_faults: dict[str, list[dict]] = {}  # worker id -> the [health] faults given to it
        self.step_marks: list[tuple[float, int]] = []  # (unix, step) as the status moved: the run's pace

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
                self._mark_step(now)
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
                        _netns().set_link(inj.target["link"], up=True)
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

    def _mark_step(self, now: float) -> None:
        step = int(self.status.get("step") or 0)
        if Phase.of(self.status) != Phase.RUNNING:
            self.step_marks = []  # a recovery's pause is not the run's pace
        elif not self.step_marks or step > self.step_marks[-1][1]:
            self.step_marks = [m for m in self.step_marks if m[0] >= now - 10.0] + [(now, step)]

    def lead(self) -> int:
        """How many steps ahead of the controller's step a fault inside the trainer is set to fire. The
        controller's step is rank 0's last completed one, polled every 0.1 s: by the time the fault reaches
        the worker, the step after it may be computing already (its boundary, where param and optimizer flips
        land, passed), so the one after that is the first that surely has not begun when a step outlasts
        the poll and the calls; a faster run gets the steps it makes in ``LEAD_S`` on top (its pace over the
        last 10 s of status). A fault set for a step already begun would never fire."""
        (t0, s0), (t1, s1) = (self.step_marks[0], self.step_marks[-1]) if self.step_marks else ((0, 0), (0, 0))
        pace = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        return 2 + math.ceil(pace * LEAD_S)

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
        netns = _netns()
        t["netns"], t["link"] = netns.node_link(t["pid"], node["NodeManagerAddress"])
        t["node_ip"] = node["NodeManagerAddress"]
        netns.set_link(t["link"], up=False)
        self.open_windows.append((inj, spec))

    def _inject_drain_node(self, inj: Injection, spec: FaultSpec) -> None:
        """Ray drains the rank's node, as a spot notice or `ray drain-node` does (orchestrator/controller/drain.py)."""
        from ..service.drains import drain_node

        t = inj.target = self._target(spec)
        import ray

        if is_head(t["node"]) or t["node"] == ray.get(self._controller().node_id.remote(), timeout=30):
            raise RuntimeError(f"rank {t['rank']} runs on the node of the head or the run's controller; draining "
                               "it ends the run, not a member (choose another rank)")
        accepted, why = drain_node(t["node"], deadline_s=spec.deadline_s, message=f"etrain chaos fault {inj.fault}")
        if not accepted:
            raise RuntimeError(f"Ray refused to drain node {t['node'][:8]}: {why}")
        t["deadline_s"] = spec.deadline_s

    def _inject_add_node(self, inj: Injection, spec: FaultSpec) -> None:
        inj.target = {"cpus": spec.cpus, "node": self.add_node(spec.cpus)}

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

    # --- faults inside the trainer ([health]: trainer/health/faults.py) ---

    def _inject_bitflip(self, inj: Injection, spec: FaultSpec) -> None:
        world, step = self._live()
        rank = spec.rank if spec.rank is not None else self.rng.randrange(max(world, 1))
        if not 0 <= rank < world:
            raise RuntimeError(f"rank {rank} is not in the group (world size {world})")
        entry = spec.health_fault(step + self.lead(), self.plan.seed + inj.fault)
        wid = self._give_health_fault(entry, rank)
        inj.target = {"rank": rank, "worker": wid, "fires_at_step": entry["step"],
                      **{k: v for k, v in entry.items() if k not in ("kind", "step")}}

    def _inject_poison_batch(self, inj: Injection, spec: FaultSpec) -> None:
        """Every rank's share of the step's batch: each rank's own Faults poisons its targets, so each gets it."""
        world, step = self._live()
        if world < 1:
            raise RuntimeError("the run has no group now")
        entry = spec.health_fault(step + self.lead(), self.plan.seed + inj.fault)
        inj.target = {"fires_at_step": entry["step"], "ranks": world,
                      "workers": [self._give_health_fault(entry, r) for r in range(world)]}

    def _live(self) -> tuple[int, int]:
        """(world size, step) as the controller holds them now: the store's status is written about once a
        second, the controller's step is at most one progress poll old."""
        import ray

        snap = ray.get(self._controller().snapshot.remote(), timeout=30)
        return int(snap.get("world_size") or 0), int(snap.get("step") or 0)

    def _give_health_fault(self, entry: dict, rank: int) -> str:
        """Hand ``entry`` to the worker that is rank ``rank`` now; its id. A worker's faults are replaced
        whole, so one given faults before gets them again with the new one."""
        import ray

        ctl = self._controller()
        wid = ray.get(ctl.set_health_faults.remote([entry], rank), timeout=30)
        if wid is None:
            raise RuntimeError(f"rank {rank} is not in the group now")
        given = self.health_faults.setdefault(wid, [])
        given.append(entry)
        if len(given) > 1:
            ray.get(ctl.set_health_faults.remote(list(given), rank), timeout=30)
        return wid

    def _controller(self):
        from ..driver.run import controller_actor

        actor = controller_actor(self.run_id, self.store.url)
        if actor is None:
            raise RuntimeError(f"no live controller for run {self.run_id!r} in this Ray cluster")
        return actor


def ray_start_node(cpus: int, timeout_s: float = 120.0) -> str:
    """A node joins the connected cluster from this machine (``ray start --address=GCS --num-cpus=N``);
    its node id once Ray sees it alive."""
    import subprocess
    import sys

    import ray

    before = {n["NodeID"] for n in ray.nodes()}
    address = ray.get_runtime_context().gcs_address
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={address}",
                    f"--num-cpus={cpus}"], check=True, capture_output=True, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]
        if new:
            return new[0]
        time.sleep(0.5)
    raise RuntimeError(f"the node started with `ray start --address={address}` did not join within {timeout_s:.0f} s")


def _netns():
    """The partition machinery, imported when a partition is cut or healed: importing it with the package
    would put it in sys.modules before ``python -m orchestrator.chaos.netns`` runs it (runpy warns)."""
    from . import netns

    return netns
