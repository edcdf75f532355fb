"""A fake worker group with behaviour, for stepping the controller without Ray.

    clock = FakeClock()
    group = FakeGroup(clock, interval=5, capacity=4,
                      faults=[Fault(rank=1, step=7, kind="die")])
    ctl = Controller(spec, store, group, opts, clock=clock)
    while not ctl.state.terminal:
        ctl.step()

``FakeGroup`` implements ``orchestrator.workers.group.WorkerGroup``, the
interface ``RayWorkerGroup`` implements on Ray (``start``, ``ready``,
``placed``, ``info``, ``submit``, ``wait``, ``result``, ``alive``, ``kill``,
``shutdown`` and the ``workers`` dict), and returns the real ``Call`` and
``WorkerLost`` types. Its workers live in memory and behave
like ``orchestrator.workers.worker.TrainWorker``:

* Everything is deterministic: no threads, no sleeping. Calls other than
  ``train`` run when they are submitted. Training moves one step per
  ``wait()`` call, in lockstep for every member of an epoch, and only while
  all ``world`` ranks of that epoch are inside ``train`` (a collective).
* A wait or result that times out advances the fake clock by its timeout,
  exactly as a real blocking call would take that long.
* Every ``interval`` steps (and on ``save()``) a checkpoint is committed to
  the shared :class:`FakeStorage`; ``restore()`` returns its newest step.
* ``request_stop`` is a vote: the step in flight completes, then every rank's
  ``train`` returns ``TrainResult("stopped", step)`` at that step boundary.
* Faults are addressed by (rank, step), see :class:`Fault`: a rank dies (its
  calls raise ``WorkerLost``, peers' ``train`` returns a failed collective),
  hangs (its calls never return, ping times out, peers block), or raises an
  error (its ``train`` returns failed, peers' collective fails).
* ``capacity`` bounds the workers placed at once; workers started beyond it
  stay pending (not ready) until ``add_capacity`` or a kill frees a slot.
  A placed worker is up ``boot_s`` later (a new process importing torch).
* ``reserve_gang(n)`` takes ``n`` slots at once when that many are free
  (before any pending worker); the next workers started take its bundles and
  are placed as soon as the gang is; ``shutdown`` gives the gang back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from orchestrator.workers.group import Call, WorkerGroup, WorkerLost
from orchestrator.workers.results import Formed, Restored, TrainResult


class FakeClock:
    """The controller's clock: a callable returning seconds that only moves when told."""

    def __init__(self, start: float = 1000.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds


@dataclass
class FakeStorage:
    """Committed checkpoints by step: what the durable checkpoint tier holds."""

    committed: dict[int, dict] = field(default_factory=dict)

    def commit(self, step: int, epoch: int, world: int) -> None:
        self.committed[step] = {"epoch": epoch, "world_size": world}

    def latest(self) -> int | None:
        return max(self.committed) if self.committed else None


@dataclass
class Fault:
    """Inject a fault into the worker of ``rank`` when the group is at ``step``.

    during="train": fires when the group has completed ``step`` steps and is
    about to train the next one. during="restore" / "save": fires when that
    rank is asked to restore (and the newest checkpoint is ``step``, or any
    step if ``step`` is None) / to save at ``step``.

    kind: "die" (the process vanishes), "hang" (stops answering for good),
    "error" (train returns failed with ``message``; the process lives), or,
    for saves, "error" makes the save fail. ``times``: how often it fires
    (None: every time). ``lose_capacity``: a "die" takes its slot with it.
    """

    rank: int
    step: int | None
    kind: str = "die"
    during: str = "train"
    times: int | None = 1
    message: str = "RuntimeError: injected fault"
    lose_capacity: bool = False
    fired: list[float] = field(default_factory=list)  # clock times it fired

    def __post_init__(self) -> None:
        if self.kind not in ("die", "hang", "error"):
            raise ValueError(f"Fault.kind={self.kind!r}: use die, hang or error")
        if self.during not in ("train", "restore", "save"):
            raise ValueError(f"Fault.during={self.during!r}: use train, restore or save")

    def armed(self) -> bool:
        return self.times is None or len(self.fired) < self.times


class _Ref:
    """The fake of an ObjectRef: done with a value or an exception, or not yet."""

    def __init__(self):
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self.done:
            self.done, self.value, self.error = True, value, error


@dataclass
class FakeWorker:
    wid: str
    seq: int
    placed: bool = False
    up_at: float = 0.0  # fake-clock time its process is up (placed + boot_s)
    dead: bool = False  # the process is gone: every call raises WorkerLost
    hung: bool = False  # the process is stuck: no call ever returns
    killed: bool = False  # the controller killed it (it left ``workers``)
    epoch: int = -1
    rank: int = -1
    world: int = 0
    step: int = 0
    stop: bool = False
    train: Call | None = None  # the train call in flight
    until: int = 0
    last: dict = field(default_factory=dict)
    saves: list[dict] = field(default_factory=list)
    pending: list[Call] = field(default_factory=list)  # calls that have not returned (hung worker)
    bundle: int | None = None  # its bundle in the gang (reserve_gang)


class FakeGroup(WorkerGroup):
    """In-memory stand-in for ``RayWorkerGroup``; see the module docstring."""

    def __init__(self, clock: FakeClock, *, interval: int = 0, capacity: int | None = None,
                 faults: list[Fault] | tuple[Fault, ...] = (), storage: FakeStorage | None = None,
                 step_seconds: float = 0.1, wait_budget: int | None = None,
                 boot_s: float | list[float] = 0.0):
        self.clock = clock
        self.boot_s = boot_s  # a placed worker answers this long after it got its slot (a list: by start order)
        self.wait_budget = wait_budget  # a guard for ctl.run(): more wait() calls than this is a runaway loop
        self.interval = interval
        self.capacity = capacity
        self.faults = list(faults)
        self.storage = storage if storage is not None else FakeStorage()
        self.step_seconds = step_seconds
        self.workers: dict[str, FakeWorker] = {}
        self.all_workers: list[FakeWorker] = []  # every worker ever started, killed ones too
        self.steps_trained = 0  # group steps computed, recomputed ones included
        self.log: list[tuple[str, str, tuple]] = []  # (wid, method, args) of every submit
        self._ids = itertools.count()
        self._ports = itertools.count(29500)
        self.gang: int | None = None  # the gang's size (reserve_gang), and whether it holds its slots
        self.gang_placed = False
        self.gang_lost: set[int] = set()  # its bundles whose slot went with a lost node (placed again later)

    # --- capacity -----------------------------------------------------------------

    def add_capacity(self, n: int) -> None:
        assert self.capacity is not None, "capacity is unlimited"
        self.capacity += n
        self._place()

    def _place(self) -> None:
        """The gang takes its slots when they are all free, then pending workers take free slots in start order
        (a gang member only its gang's)."""
        placed = sum(1 for w in self.workers.values() if w.placed and w.bundle is None)
        if self.gang is not None and not self.gang_placed:
            self.gang_placed = self.capacity is None or self.capacity - placed >= self.gang
        for b in sorted(self.gang_lost):  # a bundle whose slot was lost is placed again where there is room
            if self.capacity is None or self.capacity - placed - (self.gang - len(self.gang_lost)) > 0:
                self.gang_lost.discard(b)
        placed += self.gang - len(self.gang_lost) if self.gang_placed else 0
        for w in sorted(self.workers.values(), key=lambda w: w.seq):
            if w.placed or (w.bundle is not None and (not self.gang_placed or w.bundle in self.gang_lost)):
                continue
            if w.bundle is None and self.capacity is not None and placed >= self.capacity:
                break
            w.placed = True
            boot = self.boot_s if not isinstance(self.boot_s, list) else self.boot_s[min(w.seq, len(self.boot_s) - 1)]
            w.up_at = self.clock() + boot
            placed += w.bundle is None

    def reserve_gang(self, n: int) -> None:
        if self.gang is None:
            self.gang, self.gang_placed = n, False
            self._place()

    def gang_ready(self, timeout: float) -> bool:
        self._place()
        if self.gang is not None and not self.gang_placed:
            self.clock.advance(timeout)
        return self.gang is not None and self.gang_placed

    # --- the WorkerGroup interface -------------------------------------------------

    def start(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            seq = next(self._ids)
            held = {w.bundle for w in self.workers.values()}
            free = [b for b in range(self.gang or 0) if b not in held]
            w = FakeWorker(wid=f"w{seq}-fake", seq=seq, bundle=free[0] if free else None)
            self.workers[w.wid] = w
            self.all_workers.append(w)
            out.append(w.wid)
        self._place()
        return out

    def ready(self, wids: list[str], timeout: float) -> list[str]:
        self._place()
        up = self._up(wids)
        if len(up) < len(wids):
            self.clock.advance(timeout)  # ray.wait blocks the whole timeout when some are not up
            up = self._up(wids)
        return up

    def _up(self, wids: list[str]) -> list[str]:
        return [w for w in wids if w in self.workers and self.workers[w].placed
                and self.workers[w].up_at <= self.clock()]

    def placed(self, wids: list[str]) -> list[str]:
        self._place()
        return [w for w in wids if w in self.workers and self.workers[w].placed]

    def info(self, wid: str) -> dict:
        w = self.workers[wid]
        return {"worker_id": wid, "pid": 1000 + w.seq, "node_id": f"node{w.seq:04d}-fake", "ip": "127.0.0.1"}

    def handle(self, wid: str) -> str:
        return wid

    def submit(self, wid: str, method: str, *args) -> Call:
        self.log.append((wid, method, args))
        if wid not in self.workers:
            raise WorkerLost(f"worker {wid} is gone")
        w = self.workers[wid]
        if not w.placed or w.up_at > self.clock():
            raise AssertionError(f"fake: {method} submitted to {wid}, which is not ready (the controller "
                                 "must only use workers that ready() returned)")
        call = Call(wid, method, _Ref())
        if w.dead:
            call.ref.set(error=self._lost(w))
        elif w.hung:
            w.pending.append(call)
        elif method == "train":
            assert w.train is None, f"fake: a second train call on {wid} while one is in flight"
            w.train, w.until = call, int(args[0])
        else:
            self._execute(w, call, method, args)
        return call

    def wait(self, calls: list[Call], timeout: float, *, first: bool = False) -> list[Call]:
        """One training step for every epoch whose ranks are all in train, then the calls that are done
        (the clock moves by ``timeout`` unless all are, or, with ``first``, any is)."""
        if self.wait_budget is not None:
            self.wait_budget -= 1
            if self.wait_budget < 0:
                raise AssertionError("fake: wait budget exhausted: the controller loops without ending")
        if not calls:
            return []
        self._advance()
        done = [c for c in calls if c.ref.done]
        if len(done) < len(calls) and not (first and done):
            self.clock.advance(timeout)
        return done

    def result(self, call: Call, timeout: float | None = None) -> Any:
        if not call.ref.done:
            if timeout is None:
                raise AssertionError(f"fake: result({call.method} on {call.wid}) without a timeout on a call "
                                     "that never returns: the controller would block forever")
            self.clock.advance(timeout)
            raise TimeoutError(f"worker {call.wid} did not answer {call.method} within {timeout} s")
        if call.ref.error is not None:
            raise call.ref.error
        return call.ref.value

    def kill(self, wid: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        w.killed = True
        self._die(w)
        self._place()

    def shutdown(self) -> None:
        for wid in list(self.workers):
            self.kill(wid)
        self.gang, self.gang_placed, self.gang_lost = None, False, set()
        self._place()

    # --- helpers for tests ---------------------------------------------------------

    def live(self) -> list[FakeWorker]:
        return [w for w in self.workers.values() if not w.dead]

    def by_rank(self) -> list[FakeWorker]:
        """Members of the newest epoch, by rank."""
        epoch = max((w.epoch for w in self.workers.values()), default=-1)
        return sorted((w for w in self.workers.values() if w.epoch == epoch and not w.dead), key=lambda w: w.rank)

    # --- worker behaviour ----------------------------------------------------------

    def _lost(self, w: FakeWorker) -> WorkerLost:
        return WorkerLost(f"worker {w.wid} died (ActorDiedError)")

    def _fault(self, rank: int, step: int | None, during: str) -> Fault | None:
        for f in self.faults:
            if f.during == during and f.rank == rank and f.step in (None, step) and f.armed():
                f.fired.append(self.clock())
                return f
        return None

    def _execute(self, w: FakeWorker, call: Call, method: str, args: tuple) -> None:
        if method == "rendezvous_port":
            call.ref.set(next(self._ports))
        elif method == "ping":
            call.ref.set(1000 + w.seq)
        elif method == "form":  # (epoch, rank, world, addr, port[, recovery, key, plan, restore])
            epoch, rank, world, _addr, _port, *rest = args
            w.epoch, w.rank, w.world = int(epoch), int(rank), int(world)
            w.stop, w.train, w.last, w.step = False, None, {}, 0
            if len(rest) < 4 or not rest[3]:
                call.ref.set(Formed(rank, 0.0))
            elif (restored := self._restore(w, call)) is not None:  # as the worker does: restored once formed
                call.ref.set(Formed(rank, 0.0, restored=restored))
        elif method == "memory_holdings":  # the fake keeps no memory tier: every restore is from storage
            call.ref.set({"holdings": {}, "needed": {}})
        elif method == "memory_flush":
            call.ref.set({"step": None, "seconds": 0.0, "reason": "no memory tier"})
        elif method == "restore":
            if (restored := self._restore(w, call)) is not None:
                call.ref.set(restored)
        elif method == "save":
            fault = self._fault(w.rank, w.step, "save")
            if fault is not None and self._apply_outside_train(w, fault, call):
                return
            self.storage.commit(w.step, w.epoch, w.world)
            call.ref.set({"status": "committed", "error": None, "step": w.step, "blocking_s": 0.0})
        elif method == "progress":
            saves, w.saves = w.saves, []
            call.ref.set({**w.last, "saves": saves})
        elif method == "flush_saves":  # the fake's saves commit at once: nothing in flight to wait for
            saves, w.saves = w.saves, []
            call.ref.set(saves)
        elif method == "request_stop":
            w.stop = True
            call.ref.set(None)
        elif method == "step":
            call.ref.set(w.step)
        elif method == "leave":
            w.epoch, w.rank = -1, -1
            call.ref.set(None)
        elif method == "abort_collectives":  # the fake has no communicators (CPU: gloo needs no abort)
            call.ref.set(False)
        else:
            raise AssertionError(f"fake: unknown worker method {method!r}")

    def _restore(self, w: FakeWorker, call: Call) -> Restored | None:
        """The newest checkpoint restored, or None when a restore fault decided the call's outcome."""
        latest = self.storage.latest()
        fault = self._fault(w.rank, latest, "restore")
        if fault is not None and self._apply_outside_train(w, fault, call):
            return None
        w.step = latest or 0
        saved = self.storage.committed.get(latest, {}) if latest is not None else {}
        return Restored(w.step, "durable" if latest is not None else "none", 0.0, from_step=latest,
                        world_size_at_save=saved.get("world_size"))

    def _apply_outside_train(self, w: FakeWorker, fault: Fault, call: Call) -> bool:
        """A fault during restore or save; True if it decided the call's outcome."""
        if fault.kind == "die":
            self._die(w, lose_capacity=fault.lose_capacity)
            call.ref.set(error=self._lost(w))
        elif fault.kind == "hang":
            w.hung = True
            w.pending.append(call)
        elif call.method == "save":
            call.ref.set({"status": "failed", "error": fault.message, "step": w.step, "blocking_s": 0.0})
        else:  # an exception inside the actor method reaches the caller as it does through ray.get
            call.ref.set(error=RuntimeError(fault.message))
        return True

    def _die(self, w: FakeWorker, lose_capacity: bool = False) -> None:
        """The process is gone: its calls raise WorkerLost, its peers' collective fails."""
        if lose_capacity and self.capacity is not None:
            self.capacity -= 1
            if w.bundle is not None:  # its gang bundle went with the node: Ray places it again elsewhere
                self.gang_lost.add(w.bundle)
        already = w.dead
        w.dead, w.hung = True, False
        for c in [*w.pending, *([w.train] if w.train is not None else [])]:
            c.ref.set(error=self._lost(w))
        w.pending, w.train = [], None
        if not already and w.epoch >= 0:
            self._fail_peers(w, "collective_failed",
                             f"DistBackendError: [gloo] connection closed by peer (rank {w.rank})")

    def _fail_peers(self, culprit: FakeWorker, kind: str, error: str) -> None:
        for p in self.workers.values():
            if p is not culprit and p.epoch == culprit.epoch and p.train is not None and not p.hung:
                self._finish(p, TrainResult("failed", p.step, error, kind))

    def _finish(self, w: FakeWorker, result: TrainResult) -> None:
        w.train.ref.set(result)
        w.train = None
        w.stop = False

    def _advance(self) -> None:
        """Every epoch whose ranks are all inside train computes one step."""
        epochs: dict[int, list[FakeWorker]] = {}
        for w in self.workers.values():
            if w.train is not None and not w.dead:
                epochs.setdefault(w.epoch, []).append(w)
        for ranks in epochs.values():
            self._advance_epoch(sorted(ranks, key=lambda w: w.rank))

    def _advance_epoch(self, ranks: list[FakeWorker]) -> None:
        if len(ranks) < ranks[0].world or any(w.hung for w in ranks):
            return  # a rank is missing from the collective: everybody waits
        steps = {w.step for w in ranks}
        assert len(steps) == 1, f"fake: ranks of epoch {ranks[0].epoch} are at different steps {steps}"
        step, until = ranks[0].step, ranks[0].until
        if step >= until:
            for w in ranks:
                self._finish(w, TrainResult("done", step))
            return
        for w in ranks:
            fault = self._fault(w.rank, step, "train")
            if fault is None:
                continue
            if fault.kind == "die":
                self._die(w, lose_capacity=fault.lose_capacity)
            elif fault.kind == "hang":
                w.hung = True  # its train never returns; peers block in the collective
            else:
                self._finish(w, TrainResult("failed", step, fault.message, "error"))
                self._fail_peers(w, "collective_failed",
                                 f"DistBackendError: [gloo] connection closed by peer (rank {w.rank})")
            return
        step += 1
        self.steps_trained += 1
        stop = any(w.stop for w in ranks)  # the vote rides on the step's all-reduce
        commit = bool(self.interval) and step % self.interval == 0 and step < until
        if commit:
            self.storage.commit(step, ranks[0].epoch, ranks[0].world)
        for w in ranks:
            w.step = step
            w.last = {"step": step, "step_seconds": self.step_seconds, "loss": 10.0 / step, "lr": 1e-3,
                      "epoch": w.epoch, "rank": w.rank}
            if commit:
                w.saves.append({"step": step, "status": "committed", "error": None, "bytes": 0,
                                "blocking_s": 0.0, "persist_s": 0.0})
        if stop:
            for w in ranks:
                self._finish(w, TrainResult("stopped", step))
        elif step >= until:
            for w in ranks:
                self._finish(w, TrainResult("done", step))
