"""Draining nodes: a run shrinks off a node that Ray is about to take away, at a step boundary, losing no step.

    drains = DrainWatch(source=ray_draining_nodes)       # what the controller actor gives its controller
    decision = drains.check(ctl)                          # RUNNING, every poll: None, DrainShrink or DrainCommit

Ray 2.60 marks a node *draining* when it is about to go: a spot or preemption
notice, ``ray drain-node``, the autoscaler's scale-down, the SIGTERM a KubeRay
pod gets (``ray start`` drains its own node for ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``).
Ray then places nothing new there, and the node's raylet exits once it is
idle or at the deadline. The GCS answers which nodes drain and until when
(:func:`orchestrator.service.drains.ray_draining_nodes`, the read Ray Train's and Serve's own drain
watchers make, one small RPC); the controller asks it every ``poll_s``.

What a run does (:func:`decide`, pure):

* members on a draining node and enough members elsewhere (at least
  ``min_workers``, at a valid size): shrink off the node through the resize
  path at the next step boundary (:class:`DrainShrink`; from memory or a
  boundary checkpoint, no step lost). It is not a failure: ``max_failures``
  does not count it. The run's requested size is unchanged, so replacements
  start at once and Ray places them elsewhere; the group grows back when
  they are up, as after any shrink.
* too few members elsewhere: keep training on the draining node while
  replacements start (:class:`DrainHold`); shrink onto them once they are up.
  When the deadline comes within ``commit_margin_s`` first, commit a durable
  checkpoint at the next boundary (:class:`DrainCommit`), then train on until
  the node goes: its loss is then a failure like any other, recovered from
  the memory tier's copies on other nodes or from that checkpoint.

Spares (started, not in the group) on a draining node are stopped and
replaced at once. Every notice is told as a ``preempted`` event with
``reason: "drain"`` and ``action`` ``shrink``, ``hold`` or ``commit``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .run_policy import ScalingPolicy, ScalingStatus
from .protocols import DrainContext

log = logging.getLogger("etrain")

# {node_id (hex): the drain's deadline (unix seconds), or None when it has none}
DrainSource = Callable[[], Mapping[str, float | None]]

# --- the decision ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainShrink:
    """Re-form at ``size`` without ``leaving`` (the members on draining nodes), at the next step boundary."""

    size: int
    leaving: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class DrainHold:
    """Keep the members on draining nodes for now; ``replacements`` more workers should be starting."""

    replacements: int
    reason: str


@dataclass(frozen=True)
class DrainCommit:
    """Commit a durable checkpoint at the next step boundary: the deadline is near and the run cannot shrink."""

    reason: str


def decide(*, members: list[str], node_of: Mapping[str, str], draining: Mapping[str, float | None],
           ready_elsewhere: int, started_elsewhere: int, desired: int, scaling: ScalingPolicy,
           valid_sizes: tuple[int, ...], now_unix: float, commit_margin_s: float,
           committed: bool = False) -> DrainShrink | DrainHold | DrainCommit | None:
    """What the run does about ``draining`` nodes (module docstring); None when no member is on one.

    ``ready_elsewhere``: spares that are up on nodes not draining; ``started_elsewhere``: every spare not
    on a draining node (booting or pending too); ``committed``: a checkpoint was committed since the notice."""
    leaving = tuple(w for w in members if node_of.get(w) in draining)
    if not leaving:
        return None
    nodes = sorted({node_of[w] for w in leaving})
    deadlines = [draining[n] for n in nodes if draining[n]]
    deadline = min(deadlines) if deadlines else None
    where = ", ".join(n[:8] for n in nodes)
    staying = len(members) - len(leaving)
    size = scaling.target(ScalingStatus(len(members), desired, staying + ready_elsewhere, valid_sizes))
    if size is not None:
        return DrainShrink(size, leaving, f"node {where} is draining: {len(members)} -> {size} workers")
    if deadline is not None and deadline - now_unix <= commit_margin_s and not committed:
        return DrainCommit(f"node {where} drains within {max(0.0, deadline - now_unix):.0f} s and "
                           f"{staying} workers elsewhere are below min_workers={scaling.min_workers}: "
                           "committing a checkpoint before it goes")
    missing = max(0, desired - staying - started_elsewhere)
    return DrainHold(missing, f"node {where} is draining, but {staying} workers elsewhere are below "
                              f"min_workers={scaling.min_workers}: training on there while {missing} "
                              "replacement(s) start")


# --- the watch ---------------------------------------------------------------------------------


@dataclass
class DrainWatch:
    """Reads the cluster's draining nodes for the controller and turns them into a decision (module docstring).

    ``source`` None: the run does not watch drains (a controller built by hand, most unit tests)."""

    source: DrainSource | None = None
    poll_s: float = 1.0
    commit_margin_s: float = 30.0  # below min_workers, commit a checkpoint when the deadline is this near
    draining: dict[str, float | None] = field(default_factory=dict)  # the last read
    told: set[tuple[str, str]] = field(default_factory=set)  # (node, action) events written
    committed_for: set[str] = field(default_factory=set)  # nodes a checkpoint was committed for
    next_poll: float = 0.0

    def poll(self, now: float) -> dict[str, float | None]:
        """The draining nodes, read at most every ``poll_s`` (the last read in between)."""
        if self.source is None or now < self.next_poll:
            return self.draining
        self.next_poll = now + self.poll_s
        try:
            self.draining = dict(self.source())
        except Exception as e:  # a GCS hiccup: keep the last read, try again next time
            log.warning("draining nodes not read: %s", e)
        return self.draining

    def check(self, c: DrainContext) -> DrainShrink | DrainCommit | None:
        """RUNNING's look at draining nodes: spares there stopped, replacements started, events written;
        what the state must do now (a shrink or a checkpoint at the boundary), or None."""
        draining = self.poll(c.clock())
        if not draining:
            return None
        node_of = {w: c.group.info(w).get("node_id", "") for w in c.members + c.spares if w in c.group.workers}
        doomed = [w for w in c.spares if node_of.get(w) in draining]
        for w in doomed:  # not in the group: let it go now (Ray places its replacement elsewhere)
            c.group.kill(w)
        c.spares = [w for w in c.spares if w not in doomed]
        elsewhere = [w for w in c.spares if w in c.group.workers]
        ready = c.group.ready(elsewhere, timeout=0)
        nodes = {node_of[w] for w in c.members if node_of.get(w) in draining}
        decision = decide(members=c.members, node_of=node_of, draining=draining, ready_elsewhere=len(ready),
                          started_elsewhere=len(elsewhere), desired=c.desired(), scaling=c.scaling,
                          valid_sizes=c.valid_sizes, now_unix=time.time(), commit_margin_s=self.commit_margin_s,
                          committed=bool(nodes) and nodes <= self.committed_for)
        if decision is None:
            if doomed:
                c.ensure_workers(c.desired(), standby=False)
            return None
        if isinstance(decision, DrainHold):
            if decision.replacements:
                c.spares += c.group.start(decision.replacements)
            self.tell(c, nodes, "hold", decision.reason, draining)
            return None
        if isinstance(decision, DrainCommit):
            self.committed_for |= nodes
        self.tell(c, nodes, "shrink" if isinstance(decision, DrainShrink) else "commit", decision.reason, draining,
                  **({"from_workers": len(c.members), "to_workers": decision.size,
                      "ranks": [c.members.index(w) for w in decision.leaving]}
                     if isinstance(decision, DrainShrink) else {}))
        return decision

    def tell(self, c: DrainContext, nodes: set[str], action: str, why: str, draining: Mapping[str, float | None],
             **fields) -> None:
        """The ``preempted`` event of a notice, once per node and action."""
        new = sorted(n for n in nodes if (n, action) not in self.told)
        if not new:
            return
        self.told |= {(n, action) for n in new}
        deadlines = [draining[n] for n in new if draining.get(n)]
        deadline = min(deadlines) if deadlines else None
        log.warning("drain: %s", why)
        c.event("preempted", reason="drain", action=action, node=new[0], nodes=new, deadline_unix=deadline,
                deadline_in_s=None if deadline is None else round(deadline - time.time(), 1),
                step=c.last_completed_step(), message=why, **fields)
