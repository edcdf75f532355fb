"""``TrainWorker``: one rank of a run, a long-lived Ray actor around a ``trainer.Trainer``.

The controller drives every member of a group with the same calls at once:

    form(epoch, rank, world, addr, port, recovery, key, plan, restore=True)
                                           new process group + Trainer for this layout (at rank 0's
                                           rendezvous_port(), under the epoch's secret key), and its
                                           memory tier; then (restore) the step ``plan`` names from the
                                           memory tier, else the newest valid checkpoint, resharded (or
                                           a fresh start), as ``restore(plan)`` does
    train(until_step)                      the step loop; returns done / stopped / failed
    save()                                 a checkpoint now, committed before it returns
    memory_flush()                         the current step in the memory tier (a resize's)

and, from a second thread of the actor while ``train`` runs, ``progress()``
and ``request_stop()``; from any thread ``memory_holdings()``, ``memory_file()``
and ``memory_header()``, what this worker holds of the memory tier (its own
group's and earlier groups', see ``checkpointing.recovery.held``) for a restore
planned by the controller: the files a restoring rank does not hold come from
their holder by a Ray actor call. The calls that touch torch (those above,
``restore`` and ``leave``) run on one thread of their own, the actor's ``torch``
concurrency group: DTensor keeps per-thread caches that must be cleared when the
process joins a new group (``trainer.world.forget_meshes``). A stop request is a
vote carried by the step's own all-reduce, so every rank stops after the same
step. When a peer vanishes, the collective in ``train`` fails and ``train``
returns "failed" while this process lives on, ready to ``form`` the next epoch:
that is in-place recovery. The worker never talks to other workers except
through torch.distributed.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
import traceback

import ray
import torch
import torch.distributed as dist

from checkpointing.recovery.held import HeldSnapshots
from checkpointing.storage.retry import describe
from trainer.config import RunConfig
from trainer.config.load import config_from_dict
from trainer.data.corpus import load_splits
from trainer.heap import freeze_boot_heap
from trainer.checkpoints import checkpoint_manager
from trainer.health import PersistentFault
from trainer.loop import Trainer, snapshot_due
from trainer.parallel.dims import resolve_device
from trainer.observe.telemetry import StepMeter, comm_meter, mfu, rank_telemetry
from trainer.world import World, abort_groups, init_distributed, listening_store, shutdown_distributed

from ..config import GroupTier
from ..store.run_store import HistoryRow
from .tier_fetch import MemoryRestore, ask_header, everyone, restore_from_memory
from .tier_fetch import warm_up as warm_up_memory_tier
from .devices import ray_device_index
from .health_hooks import HealthHooks
from .results import Formed, Restored, TrainResult, failure_kind, refused_event

log = logging.getLogger("etrain")


# The actor's concurrency: ``torch`` is the one thread every call that touches torch runs on.
CONCURRENCY = {"max_concurrency": 4, "concurrency_groups": {"torch": 1}}
on_torch_thread = ray.method(concurrency_group="torch")


class TrainWorker(HealthHooks):
    """Wrapped with ``ray.remote(**CONCURRENCY)`` by the worker group."""

    def __init__(self, config: RunConfig | dict, worker_id: str, store_url: str = "", pg_timeout_s: float = 120.0):
        """``config``: the run's :class:`RunConfig`, or its dict form (``RunConfig.to_dict()``), parsed here."""
        self.cfg = config if isinstance(config, RunConfig) else config_from_dict(config)
        # NCCL: on a collective's timeout abort the communicators and raise in the caller, never end the
        # process (its memory tier copies would go with it); the controller aborts them sooner on notice.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.worker_id = worker_id
        self.store_url = store_url
        self.pg_timeout_s = pg_timeout_s
        self.corpus = self.val_corpus = None
        self._store: dist.TCPStore | None = None  # the rendezvous store of the epochs this worker is rank 0 of
        self.trainer: Trainer | None = None
        self.ckpt = None
        self.epoch = -1
        self.rank = -1
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last: dict = {}
        self._committed: list[dict] = []
        self.steps = StepMeter()
        self._storage_faults: dict | None = None  # injected by `etrain chaos` (None: the config's)
        self._health_faults: list | None = None  # bitflip / poison_batch by `etrain chaos` (None: the config's)
        self._fired: set = set()  # the transient ones that fired in this process (they do not fire again)
        self._health_events: list[dict] = []  # [health] events (rank 0), for the controller (progress)
        # [step, loss, world size, samples consumed, unix time, step seconds], rank 0 only
        self._history: list[HistoryRow] = []
        self.tier = None  # this group's checkpointing.recovery.tier.MemoryTier ([recovery])
        self.tier_every = 0  # its snapshot after every N-th step
        self.held = HeldSnapshots()  # what the tiers of earlier groups held
        self._snap = None  # the future of the tier's last snapshot
        self._asked: dict = {}  # the header of the snapshot the group restores next, asked for at the form
        self.tier_note = ""  # why the tier is off in this group, when it is
        self.tier_budget = None  # this group's checkpointing.recovery.budget.Budget
        self._tier_events: list[dict] = []  # the tier turned off (rank 0), for the controller (progress)
        # Collectives are timed from the first process group on (docs/metrics.md); off, torch is left as is.
        timed = self.cfg.metrics.enabled and self.cfg.metrics.comm
        self.meter = comm_meter(install=timed)
        self.meter.enabled = timed
        # One thread per CPU the actor holds (Ray sets OMP_NUM_THREADS to it).
        torch.set_num_threads(max(1, int(float(os.environ.get("OMP_NUM_THREADS", "1")))))
        self._warm_up()
        freeze_boot_heap()  # a full garbage collection inside a recovery or a step: under 1 ms, not 150

    def _warm_up(self) -> None:
        """Do at boot what the first ``form`` and ``restore`` would otherwise pay for on the critical path of a
        recovery or a grow: read the corpus, import the parallel and checkpoint machinery, use the tier's."""
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.pipelining  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        self.corpus, self.val_corpus = load_splits(self.cfg)
        try:  # and the memory tier's snapshot and restore, once (a standby's first restore is in a recovery)
            warm_up_memory_tier()
        except Exception as e:  # best effort: a cold first restore is only slower
            log.debug("memory tier warm-up: %s", describe(e))

    # --- identity -------------------------------------------------------------------

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"worker_id": self.worker_id, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def rendezvous_port(self) -> int:
        """The port of this worker's rendezvous store, where the group of an epoch whose rank 0 this
        worker is meets (started on first use; it lives as long as the process).

        Up before any peer dials it, unlike a store each ``init_process_group`` starts on its own:
        a peer that dials too early is refused and backs off for up to a second (0.4-0.8 s measured
        at 3 ranks here, on every re-formation). Every epoch keys its rendezvous under its own prefix,
        with a key only its members learn from the controller (``form``), so that whoever else can
        reach the port can neither read nor plant the group's addresses. It listens on this node's
        address in the cluster (``info()["ip"]``, where the controller sends the peers), which is
        127.0.0.1 for a local run, never on every interface.
        """
        if self._store is None:
            self._store = listening_store(ray.util.get_node_ip_address(), 0,
                                          datetime.timedelta(seconds=self.pg_timeout_s))
        return self._store.port

    def ping(self) -> int:
        return os.getpid()

    def abort_collectives(self) -> bool:
        """Release this rank from a collective that waits on a member that is gone (the controller's notice,
        after it killed that member; not on the torch thread, which is the one blocked): NCCL's communicators
        are aborted, so the blocked call raises instead of waiting out the group's timeout. gloo needs
        nothing: it notices a dead peer's closed connection at once. True when something was aborted."""
        if self.trainer is None or self.trainer.device.type != "cuda" or not dist.is_initialized():
            return False
        return abort_groups() > 0  # every group: the rank may be blocked in a mesh's TP, PP or HSDP group

    # --- group membership ----------------------------------------------------------

    @on_torch_thread
    def form(self, epoch: int, rank: int, world_size: int, master_addr: str, master_port: int,
             recovery: GroupTier | None = None, key: str = "", plan: MemoryRestore | None = None,
             restore: bool = False) -> Formed:
        """Leave the old process group (if any) and join epoch ``epoch`` as ``rank``. ``recovery``: the
        memory tier's settings (``[recovery]`` as the controller parsed it, and each rank's node), None for
        none.
        ``key``: the epoch's secret, which prefixes every key of its rendezvous (the controller draws one
        per epoch and tells only the members). ``plan``: the restore from memory that follows, if any;
        with ``restore``, made here as soon as this member formed (``Formed.restored``), each member on its
        own (a survivor reading its own memory need not wait for a standby's model to be built first)."""
        t0 = time.monotonic()
        self._asked = ask_header(self.memory_view(), plan)
        try:
            formed = self._join(t0, epoch, rank, world_size, master_addr, master_port, recovery, key)
            return dataclasses.replace(formed, restored=self.restore(plan)) if restore else formed
        except BaseException:  # leave the group: the peers' collectives of the restore fail now, not at a timeout
            self._teardown()
            raise

    def _join(self, t0: float, epoch: int, rank: int, world_size: int, master_addr: str, master_port: int,
              recovery: GroupTier | None, key: str) -> Formed:
        self._teardown()
        local = ray_device_index()
        world = World(rank=rank, size=world_size, local_rank=local, master_addr=master_addr, master_port=master_port)
        device = resolve_device(self.cfg.parallel, local)
        if rank == 0:  # at every size the group forms at: does the layout fit the device?
            from trainer.plan.fit import warn_if_not_fitting

            warn_if_not_fitting(self.cfg, world_size, device)
        t1 = time.monotonic()
        if rank == 0 and self._store is not None and self._store.port == master_port:
            store = self._store
        else:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.pg_timeout_s))
        init_distributed(world, device, store=dist.PrefixStore(f"etrain/epoch_{epoch}/{key}", store),
                         timeout_s=self.pg_timeout_s)
        t2 = time.monotonic()
        # The restore is next (memory, a checkpoint, or none: the weights are drawn at the first step).
        self.trainer = Trainer(self.cfg, world, corpus=self.corpus, val_corpus=self.val_corpus, device=device,
                               draw_weights=False)
        self.meter.name_axes(self.trainer.mesh)
        self.ckpt = checkpoint_manager(self.cfg, world, epoch=epoch, fence=self._fence())
        if self.ckpt is not None and rank == 0:
            # Each epoch's coordinator holds the run's writer lock; it takes it over from
            # the last epoch's (the same run store, an older epoch) at once.
            self.ckpt.take_writer_lock(owner=self.store_url or f"orchestrator:{self.cfg.run_id}")
        self._apply_storage_faults()
        self.attach_health()
        self.epoch, self.rank = epoch, rank
        t_tier = time.monotonic()
        self._start_tier(recovery, rank, world_size)
        tier_s = time.monotonic() - t_tier
        self._stop.clear()
        with self._lock:
            self._last = {}  # progress of the old epoch is no progress of this one
            if rank != 0:  # only rank 0's history is collected
                self._history = []
        t3 = time.monotonic()
        return Formed(rank, t3 - t0, {"teardown_s": t1 - t0, "process_group_s": t2 - t1,
                                      "trainer_s": t3 - t2 - tier_s, "memory_tier_s": tier_s})

    def _start_tier(self, recovery: GroupTier | None, rank: int, world_size: int) -> None:
        """This group's memory tier (its two gloo groups made by its first snapshot), when ``[recovery]`` asks, with
        its budget (``checkpointing.recovery.budget``: by default a share of this host's available memory)."""
        self.tier, self._snap, self.tier_note, self.tier_budget = None, None, "", None
        self.tier_every = recovery.settings.memory_every_steps if recovery is not None else 0
        if self.tier_every <= 0:
            return
        from checkpointing.recovery.budget import available_bytes, tier_budget
        from checkpointing.recovery.tier import MemoryTier

        s = recovery.settings
        self.tier_budget = tier_budget(s.memory_budget_bytes, s.memory_budget_fraction,
                                       recovery.ranks_on_host(rank, world_size), held_bytes=self.held.nbytes(),
                                       available=available_bytes() if s.memory_budget_bytes == 0 else None)
        self.tier = MemoryTier(rank, world_size, replicas=s.replicas, memory_budget_bytes=self.tier_budget.bytes,
                               node_ids=list(recovery.nodes) or None, timeout_s=min(60.0, self.pg_timeout_s))

    def _fence(self):
        if not self.store_url:
            return None
        from orchestrator.store.run_store import open_store

        store = open_store(self.store_url)
        run_id = self.cfg.run_id
        return lambda: store.current_epoch(run_id)

    @on_torch_thread
    def restore(self, plan: MemoryRestore | None = None) -> Restored:
        """Load the step ``plan`` names from the memory tier (see :func:`restore_from_memory`), else (no
        plan, or it failed on some rank: every rank falls back together) the newest valid checkpoint,
        resharded to this layout (collective). Step 0 if there is none. ``tier`` says which."""
        t0 = time.monotonic()
        fallback = ""
        if plan is not None:
            fallback, state = restore_from_memory(self, plan, self._asked)
            if not fallback:  # with the restored step's history row: a rank 0 that died may never have sent it
                return Restored(self.trainer.step, "memory", time.monotonic() - t0,
                                history_row=state.get("history_row"), memory_tier=self._tier_state())
            log.warning("restore from memory failed, restoring from the durable checkpoint: %s", fallback)
        manifest = self.trainer.load_checkpoint(self.ckpt) if self.ckpt is not None else None
        return Restored(self.trainer.step, "durable" if manifest else "none", time.monotonic() - t0,
                        from_step=manifest.step if manifest else None, fallback=fallback,
                        world_size_at_save=manifest.world_size if manifest else None, memory_tier=self._tier_state())

    # --- the memory tier ----------------------------------------------------------------

    def memory_view(self):
        return self.held.view(self.tier, self.epoch)

    def _tier_state(self) -> dict | None:
        """This rank's tier in this group: its budget (``Budget.to_dict``, and ``describe``), None when off."""
        if self.tier_budget is None:
            return None
        return {**self.tier_budget.to_dict(), "describe": self.tier_budget.describe(), "rank": self.rank}

    def memory_holdings(self) -> dict:
        """Per snapshot key (step, epoch), the files this worker holds and the files of that step."""
        view = self.memory_view()
        return {"holdings": view.holdings(), "needed": view.needed()}

    def memory_file(self, key: tuple, name: str) -> bytes:
        """One file of the snapshot ``key`` this worker holds (for a restoring rank that does not)."""
        return self.memory_view().file(tuple(key), name)

    def memory_header(self, key: tuple) -> bytes:
        """The snapshot ``key`` without files: its agreed table, DCP metadata and trainer state."""
        return self.memory_view().header(tuple(key))

    def _snapshot(self, step: int, row: HistoryRow) -> None:
        """The memory tier's snapshot of ``step``, when due: waits for the previous one (whose outcome
        may turn the tier off: over its budget), then copies this rank's state to host buffers; the rest
        runs in the tier's thread. The step's history row goes with it: a rank 0 that dies before
        reporting it takes it along, and the controller of the group restored from it records it."""
        tier = self.tier
        if tier is None or not snapshot_due(step, self.tier_every):
            return
        if self._snap is not None:
            res = self._snap.result()
            if res.status == "refused":  # every rank learns it from the same vote: all turn off together
                self.tier_note = f"memory tier off for this group: {res.reason}"
                log.warning("%s; recoveries restore from the durable checkpoint", self.tier_note)
                if self.rank == 0:  # the controller polls rank 0: one event for the group
                    with self._lock:
                        self._tier_events.append(refused_event(res, "off"))
                self.held.keep(self.epoch, tier.detach())
                self.tier = None
                return
            if tier.restorable is not None:  # this group's own step is restorable: earlier groups' are not needed
                self.held.clear()
        tr = self.trainer
        self._snap = tier.take_async(step, tr.optimizer.checkpoint_state(),
                                     {**tr.train_state(), "history_row": list(row)})

    @on_torch_thread
    def memory_flush(self) -> dict:
        """Make the current step a snapshot every rank holds (collective): wait for the snapshot in flight,
        take one now if the current step is not held. ``step``: the step held, None when it is not."""
        t0 = time.monotonic()
        tier, tr = self.tier, self.trainer
        if tier is not None:
            tier.wait()
        has_tier, held = everyone(tier is not None, tier is not None and tr.step in tier.snapshots, device=tr.device)
        if not has_tier:
            return {"step": None, "seconds": time.monotonic() - t0,
                    "reason": self.tier_note or "the memory tier is off on some rank"}
        ok, reason, refused = held, "", None
        if not held:
            tr.initial_weights()  # a group that has not stepped yet: its weights drawn (or init_from) first
            res = tier.take(tr.step, tr.optimizer.checkpoint_state(), tr.train_state())
            ok, reason = res.ok, res.reason
            refused = refused_event(res, "refused") if res.status == "refused" else None
        return {"step": tr.step if ok else None, "seconds": time.monotonic() - t0, "reason": reason,
                "refused": refused}

    def _teardown(self) -> None:
        if self.tier is not None:  # its process groups end here; what it holds is kept for a restore
            self.held.keep(self.epoch, self.tier.detach())
            self.tier, self._snap = None, None
        if self.ckpt is not None:
            self.ckpt.wait(timeout=0)  # a save of the old epoch dies with its group; never wait on it
            self.ckpt.close()
        self.trainer = None
        self.ckpt = None
        shutdown_distributed(background=True)  # the old groups are freed beside the next form

    @on_torch_thread
    def leave(self) -> None:
        self._teardown()

    # --- training -----------------------------------------------------------------------

    @on_torch_thread
    def train(self, until_step: int) -> TrainResult:
        """Train until ``until_step``, a stop vote, or a failure (returned, never raised). Checkpoints
        every ``checkpoint.interval_steps`` before ``until_step``; the controller saves that one."""
        tr = self.trainer
        try:
            for stats in tr.run_steps(until_step, self.ckpt, stop=self._stop.is_set, final_by_caller=True):
                row = self._record(stats)
                self._snapshot(stats.step, row)
                self._collect_saves()
                if stats.stop:
                    self._stop.clear()
                    return TrainResult("stopped", tr.step)
            return TrainResult("done", tr.step)
        except PersistentFault as e:  # every rank, at its verified step, the group intact: the controller decides
            self._health_events.extend(tr.health.take_events() if self.rank == 0 else [])
            return TrainResult("faulty", tr.step, str(e), "sdc",
                               {"rank": e.rank, "host": e.host, "step": e.step, "verified_step": e.verified_step})
        except Exception as e:  # a vanished peer, a timeout, a bug: the controller decides
            log.debug("train failed: %s", traceback.format_exc())
            failed = TrainResult("failed", tr.step, describe(e), failure_kind(e))
            # Leave the group now: closing this rank's connections fails the peers still blocked on
            # it at once, instead of at the collective timeout. The process stays for the next epoch.
            self._teardown()
            return failed

    def _record(self, stats) -> HistoryRow:
        """The step's progress and its history row (kept on rank 0; returned on every rank)."""
        self.steps.observe(stats.step_seconds, stats.data_seconds)
        util = mfu(self.cfg, self.trainer.device, stats.tokens_per_s, stats.world_size)
        with self._lock:
            self._last = {**stats.to_dict(), "time": time.time(), "epoch": self.epoch, "rank": self.rank,
                          "mfu": util}
            events = self._last.pop("health_events", None) or []  # kept apart, every one (progress: "health")
            self._health_events.extend(events if self.rank == 0 else [])
            if self.trainer.last_eval is not None:  # the newest held-out loss stays in view between evaluations
                self._last["eval_step"], self._last["eval_loss"] = self.trainer.last_eval
            row = HistoryRow(stats.step, stats.loss, stats.world_size, stats.samples_consumed, self._last["time"],
                             stats.step_seconds, stats.tokens_per_s, stats.eval_loss)
            if self.rank == 0:
                self._history.append(row)
        return row

    def _collect_saves(self) -> None:
        """Keep the results of finished saves for the controller: rank 0's (the coordinator) only,
        since only it knows whether a save committed; the others' are dropped."""
        if self.ckpt is None:
            return
        for r in self.ckpt.poll():
            if self.rank != 0:
                continue
            with self._lock:
                self._committed.append(r.to_dict())

    def telemetry(self) -> dict:
        """This rank's cumulative communication and step figures and its memory now (for the metrics)."""
        tier = self.tier
        return {**rank_telemetry(self.trainer, self.ckpt, self.meter), "rank": self.rank,
                "steps": self.steps.snapshot(),
                "recovery_tier_bytes": (tier.held_bytes() if tier is not None else 0) + self.held.nbytes()}

    def set_storage_faults(self, faults: dict | None) -> None:
        """Chaos: make this rank's checkpoint storage slow, failing or truncating (``StorageFaults``
        fields), from now on and in later epochs; None goes back to the config's ``checkpoint.faults``."""
        self._storage_faults = faults
        self._apply_storage_faults()

    def _apply_storage_faults(self) -> None:
        if self.ckpt is None:
            return
        from checkpointing.storage.faults import StorageFaults

        raw = self._storage_faults if self._storage_faults is not None else self.cfg.checkpoint.faults
        self.ckpt.storage.faults = StorageFaults.from_dict(raw) if raw else None

    def request_stop(self) -> None:
        self._stop.set()

    def progress(self) -> dict:
        """The last step this rank completed, and checkpoint results and steps (rank 0) not yet reported."""
        self._collect_saves()
        with self._lock:
            saves, self._committed = self._committed, []
            history, self._history = self._history, []
            tier_events, self._tier_events = self._tier_events, []
            health, self._health_events = self._health_events, []
            return {**self._last, "saves": saves, "history": history, "memory_tier": tier_events, "health": health}

    def flush_saves(self) -> list[dict]:
        """Wait for the save in flight (if any); return the results not yet reported (rank 0's)."""
        if self.ckpt is not None:
            self.ckpt.wait()
        self._collect_saves()
        with self._lock:
            saves, self._committed = self._committed, []
        return saves

    @on_torch_thread
    def save(self) -> dict:
        """Checkpoint the current step now and wait for its commit (collective)."""
        if self.ckpt is None:
            return {"status": "failed", "error": "checkpoint.url is not set", "step": self.trainer.step}
        self.ckpt.wait()
        self._collect_saves()
        res = self.trainer.save_checkpoint(self.ckpt)
        self.ckpt.wait()
        results = self.ckpt.poll()
        res = results[-1] if results else res
        if res is None:
            return {"status": "failed", "error": "no result", "step": self.trainer.step}
        return {**res.to_dict(), "step": self.trainer.step}

    def step(self) -> int:
        return self.trainer.step if self.trainer is not None else -1

    def memory(self) -> dict:
        tr = self.trainer
        if tr is None or tr.memory_measured is None:
            return {}
        return {"measured": tr.memory_measured, "predicted": tr.memory_predicted()}
