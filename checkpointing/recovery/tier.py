"""The memory tier: each rank's training state in host memory, its own and copies in its peers', in the
format durable checkpoints use, so a restore from memory reshards exactly as a restore from storage.

    tier = MemoryTier(rank, world_size, replicas=1, memory_budget_bytes=8 << 30, node_ids=nodes)
    res = tier.take(step, state_dict, trainer_state)     # collective; res.status "agreed", "failed" or "refused"
    fut = tier.replicate_async(res.snapshot)             # background thread, a gloo group of its own
    fut = tier.take_async(step, state_dict, trainer_state)   # or: waits for a host copy only, the rest (copies
                                                             # to peers included) in the background thread
    tier.held_bytes()                                    # own snapshots + the copies held for peers
    plan = plan_restore({0: tier.holdings(), ...}, tier.needed())   # None: use the durable checkpoint
    load_from_memory(state_dict, sources, snapshot)      # collective; resharded like a durable load

:meth:`MemoryTier.take` saves ``state_dict`` (what the checkpoint manager saves:
the optimizer's ``checkpoint_state()``) with ``dcp.save`` through the durable
writer (:class:`checkpointing.dcp.writer.EtrainWriter`) into a
:class:`checkpointing.recovery.snapshot.MemoryStorage`: the same shard files
(format 3, standard DCP) and the same DCP metadata, as ``{name: bytes}`` in
this rank's memory. Then one ``all_gather`` over the tier's own gloo group is
the agreement, as the manifest is for a durable save: every rank's (step, ok,
files with size and crc32c), and the coordinator's metadata (kept by every rank
once agreed, never sent again while the layout holds). A step is agreed
only when every rank copied its files completely for that same step; every
rank then holds the whole step's table, which a restore checks every byte
against. A snapshot that did not reach agreement is dropped and never used.
As the checkpoint manager does, a snapshot whose every rank still holds the
layout the last one was planned for reuses that plan: each rank lays its files
out by it (replaying the last layout's byte views, :mod:`.replay`, when the
state is the host copy's buffers), copies them, and the one vote is also the
agreement (no DCP planning, one ``all_gather``); a rank whose layout changed
makes every rank plan with ``dcp.save`` and agree in a second gather.
:meth:`MemoryTier.take_async` blocks training only for the copy into host
buffers kept from one snapshot to the next (the async durable checkpoint's
snapshot, indexed once per layout: :class:`checkpointing.host_copy.HostCopy`).

Memory: at most two own snapshots per rank (the newest restorable one and the
one being made or copied), the copies held for peers at those steps and, with
``take_async``, one host copy of the state. ``memory_budget_bytes`` (0: no bound;
``checkpointing.recovery.budget`` derives a run's default from the host) is checked
before a snapshot is taken, on every rank, and one refusal refuses it on all (the
result's reason names the rank and the bytes, ``over_budget`` has them). A step becomes restorable once agreed and, with
replicas, once every rank holds its peers' copies of it (:meth:`replicate_async`,
through :class:`~checkpointing.recovery.transport.PeerCopyTransport`, which ends
with one all-reduce on the replica group: every rank's copies complete).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_all
from typing import Any

from ..manifest import FileEntry
from .held import Entry, HeldView
from .replay import Patched, Replay, Replayed, place
from .results import ReplicationResult, SnapshotResult
from .restore import load_from_memory, plan_restore  # noqa: F401  (the tier's API: restore)
from .snapshot import MemorySnapshot, MemoryStorage, replica_peers, step_rel
from ..storage.retry import describe
from ..host_copy import HostCopy, PlannedLayout, layout_fingerprint
from .budget import state_bytes
from .local_copy import Arena, Region, host_keys
from .threads import lower_priority
from ..transaction import group_rank_errors

log = logging.getLogger("etrain")


class MemoryTier:
    """One rank's memory tier; when distributed, two gloo groups beside the training group, one for
    snapshots and their agreement, one for copies to peers (each used by one thread at a time: :meth:`take`
    runs in the caller's thread once the background work ended), made by the first snapshot (collective:
    every rank takes it at the same step), so a group forming for a recovery or a resize starts training
    without waiting for them."""

    def __init__(self, rank: int, world_size: int, *, replicas: int = 1, memory_budget_bytes: int = 0,
                 node_ids: list | None = None, group=None, replica_group=None, timeout_s: float = 300.0):
        import torch.distributed as dist

        if replicas < 0 or memory_budget_bytes < 0:
            raise ValueError("replicas and memory_budget_bytes must be >= 0 (0 bytes: no bound)")
        self.rank, self.world_size = rank, world_size
        self.replicas = min(replicas, world_size - 1)
        self.memory_budget_bytes = memory_budget_bytes
        self.peers = {r: replica_peers(r, world_size, self.replicas, node_ids) for r in range(world_size)}
        self.distributed = world_size > 1 and dist.is_initialized()
        self.replicating = self.distributed and self.replicas > 0  # a step is restorable once copied to peers
        # A rank that died mid-snapshot fails the others' agreement after timeout_s (never agreed).
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group  # made by the first snapshot (_make_groups) when None and distributed
        self.replica_group = replica_group if self.replicating else None
        self.snapshots: dict[int, MemorySnapshot] = {}  # own, by step (agreed only)
        self.copies: dict[int, dict[int, MemorySnapshot]] = {}  # step -> source rank -> its snapshot
        self.restorable: int | None = None  # newest step every rank holds completely (own + copies)
        self.last_reason = ""
        self._lock = threading.Lock()
        # Background threads yield the CPU to training (on a host whose cores the ranks keep busy).
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="etrain-memtier", initializer=lower_priority)
        self._inflight: Future | None = None
        self._io = ThreadPoolExecutor(2, thread_name_prefix="etrain-memcopy",  # the writer's copy threads
                                      initializer=lower_priority)
        self._token = uuid.uuid4().hex[:8]  # in every file name (each snapshot has a storage of its own)
        # The last planned snapshot of each of the last two layouts (the live state's, take; the host
        # copy's, take_async), reused while that layout holds.
        self._plans: dict[str, PlannedLayout] = {}
        self._replays: dict[str, Replay] = {}  # the files of each of those layouts, to lay out again
        self._host = HostCopy(slots=1)  # take_async waits for the previous snapshot: CUDA copies reuse one buffer set
        self._hosts: list[str] | None = None  # every rank's host key (copies by shared memory), once known
        # The memory files own snapshots are written into (.local_copy); the tensor bytes of each layout seen.
        self._arena, self._sizes = Arena(), {}

    # --- taking a snapshot -------------------------------------------------------------

    def take(self, step: int, state_dict: dict[str, Any], trainer_state: dict | None = None) -> SnapshotResult:
        """Copy this rank's ``state_dict`` to host memory as step ``step`` and agree on it with every rank,
        in the calling thread (training waits for all of it). Collective. Waits for the previous snapshot's
        background work first (bounded memory); copies to peers are :meth:`replicate_async`'s."""
        t0 = time.monotonic()
        self.wait()
        self._make_groups()
        waited = time.monotonic() - t0
        res = self._take(step, state_dict, trainer_state)
        res.phases["wait_previous"] = waited
        res.seconds = res.blocking_s = time.monotonic() - t0
        return res

    def take_async(self, step: int, state_dict: dict[str, Any], trainer_state: dict | None = None, *,
                   replicate: bool = True) -> Future:
        """Like :meth:`take`, but training waits only for the previous snapshot's background work if that is
        still running: the copy of this rank's tensors into host buffers kept from one snapshot to the next
        is the background thread's (CUDA: queued on a side stream; the first copy of a layout: made now), and
        the optimizer's next write waits for it (``fence_writes``). Laying the files out, the
        agreement and (``replicate``) the copies to peers run in the tier's background thread, in order.
        Collective: every rank calls it for the same steps in the same order. The future gives the
        :class:`SnapshotResult` (``blocking_s``: what training waited; ``replication``)."""
        t0 = time.monotonic()
        self.wait()
        self._make_groups()
        waited = time.monotonic() - t0
        self._prune()  # a free memory file whose bytes the host copy's buffers are placed in: copied there
        region = self._arena.take_placed(step, self._placed_now)
        # CUDA: on the side stream, host: in the thread (both overlapping the next step; fence_writes() orders)
        pending = self._host.copy_async(state_dict, into=region.placed.placement if region else None, defer=True)
        if pending.into is not None:  # the state lies in the memory file: no write of this step may land on it
            region.protect(region.placed.ranges)
        blocking = time.monotonic() - t0

        def run() -> SnapshotResult:
            cpu = time.thread_time()
            res = self._take(step, pending.wait(), trainer_state, pending.layout, region if pending.into else None)
            res.phases.update(wait_previous=waited, host_copy=blocking - waited)
            res.blocking_s = blocking
            if res.ok and replicate and self.replicating:
                res.replication = self._replicate(res.snapshot)
            res.seconds = time.monotonic() - t0
            res.phases["background_cpu"] = time.thread_time() - cpu  # this thread's CPU, waits excluded
            return res

        self._inflight = self._thread.submit(run)
        return self._inflight

    def _make_groups(self) -> None:
        """The tier's gloo groups, at its first snapshot (collective; see the class docstring)."""
        import torch.distributed as dist
        if self.distributed and self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=self._timeout)
        if self.replicating and self.replica_group is None:
            self.replica_group = dist.new_group(backend="gloo", timeout=self._timeout)

    @property
    def busy(self) -> bool:
        """Whether a snapshot or a copy is still running in the background (a caller may skip a step)."""
        return self._inflight is not None and not self._inflight.done()

    def _take(self, step: int, state_dict: dict[str, Any], trainer_state: dict | None,
              layout: str | None = None, lies_in: Region | None = None) -> SnapshotResult:
        """Lay out and copy by the last plan when this rank's layout still matches it, then one vote that is
        also the agreement when every rank did so; else lay out with ``dcp.save`` (planning) and agree in a
        second vote. ``layout``: the state's fingerprint when known (the host copy's); ``lies_in``: the memory
        file the state lies in (the host copy placed there). Collective on ``self.group``; never raises for one
        rank's failure."""
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        self._prune()
        layout = layout or layout_fingerprint(state_dict)
        size = self._sizes.get(layout) or self._sizes.setdefault(layout, state_bytes(state_dict))
        room = size + size // 32 + (1 << 20)  # the files: the tensors, their envelopes and small items
        storage = MemoryStorage(region=lies_in or self._arena.take(step, room))
        refusal, after = self._over_budget(size) if self.memory_budget_bytes else ("", 0)
        writer, plan_id = None, None
        if not refusal:
            writer, plan_id = self._lay_out_as_planned(storage, step, state_dict, layout, lies_in)
        ok, why, entries = True, "", []
        if writer is not None:  # laid out by the last plan: copied now, agreed by the vote
            ok, why, entries = self._copy(writer)
        # the files written where the state lies: by the placed buffers' replay, nothing refused
        replay = getattr(writer, "replay", None)
        in_place = bool(ok and lies_in and not lies_in.refused and replay is lies_in.placed.replay)
        if in_place:  # the placed replay's files lie there whole: the next snapshot there writes only items
            lies_in.laid_out = replay
        phases["lay_out"] = time.monotonic() - t0
        try:
            votes = self._gather((refusal, plan_id, (after, self.memory_budget_bytes), step, ok, why,
                                  [(e.path, e.size, e.crc32c) for e in entries]))
        except Exception as e:  # a rank gone: this step is never agreed
            what = "the agreement" if plan_id is not None else "the vote before it"
            return self._unagreed(step, writer, f"{what} failed ({describe(e)})", t0, phases)
        refusals = [v[0] for v in votes if v[0]]
        if refusals:
            if writer is not None:
                writer.release()
            self.last_reason = f"memory snapshot of step {step} not taken: {'; '.join(refusals)}"
            return SnapshotResult(step, "refused", self.last_reason, seconds=time.monotonic() - t0, phases=phases,
                                  over_budget={r: v[2] for r, v in enumerate(votes) if v[0]})
        reuse = plan_id is not None and all(v[1] == plan_id for v in votes)
        if reuse:
            everyone = [(s, o, w, files, None) for _, _, _, s, o, w, files in votes]
            md = self._plans[layout].metadata
        else:
            t1 = time.monotonic()
            storage = MemoryStorage(region=self._arena.take(step, room, avoid=lies_in))  # not the last plan's
            ok, why, entries, mine = self._plan_and_copy(writer, storage, step, state_dict, layout)
            phases["plan_and_copy"] = time.monotonic() - t1
            t2 = time.monotonic()
            try:
                everyone = self._gather((step, ok, why, [(e.path, e.size, e.crc32c) for e in entries], mine))
            except Exception as e:
                return self._unagreed(step, None, f"the agreement failed ({describe(e)})", t0, phases)
            phases["agree"] = time.monotonic() - t2
            md = everyone[0][4]
            if layout in self._plans and md is not None:  # every rank keeps the metadata: never sent again
                self._plans[layout] = dataclasses.replace(self._plans[layout], metadata=md)
        failed = {r: f"{w or 'not ok'}" for r, (s, o, w, _, _) in enumerate(everyone) if not o or s != step}
        if not failed and md is None:
            failed = {0: "the coordinator has no DCP metadata"}
        if failed:
            self.last_reason = f"memory snapshot of step {step} not agreed: {group_rank_errors(failed)}"
            return SnapshotResult(step, "failed", self.last_reason, seconds=time.monotonic() - t0, phases=phases)
        table, owners = {}, {}
        for r, (_, _, _, files, _) in enumerate(everyone):
            for path, size, crc in files:
                table[path], owners[path] = FileEntry(path, size, crc), r
        files = {e.path: storage.objects[f"{step_rel(step)}/{e.path}"] for e in entries}
        snap = MemorySnapshot(step, self.rank, self.world_size, files, md, table, owners,
                              dict(trainer_state or {}), agreed=True)
        region = storage.region  # written back to back by the layout's replay: the next copies go there
        if reuse and not lies_in and isinstance(writer, Replayed) and writer.replay is self._replays.get(layout) \
                and region is not None and not region.refused and not self._placed_now(region.placed):
            region.placed = place(writer.replay, region, self._host, layout)
        with self._lock:
            self.snapshots[step] = snap
            if not self.replicating:
                self.restorable = step
        if not self.replicating:
            self._prune()
        return SnapshotResult(step, "agreed", snapshot=snap, seconds=time.monotonic() - t0, phases=phases,
                              planned=not reuse, in_place=reuse and in_place)

    def _plan_and_copy(self, writer, storage: MemoryStorage, step: int, state_dict: dict, layout: str):
        """Lay out with ``dcp.save`` (DCP's planning: collective) and copy: (ok, why, entries, this rank's
        DCP metadata if it is the coordinator). Keeps the plan and its replay for the next snapshots."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.api import CheckpointException

        from ..dcp.writer import EtrainWriter, PlannedItems

        if writer is not None:
            writer.release()
        self._plans.pop(layout, None)
        self._replays.pop(layout, None)
        writer = EtrainWriter(storage, step_rel(step), token=self._token, executor=self._io)
        try:
            planner = DefaultSavePlanner()
            dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=self.group,
                     no_dist=self.group is None)
            paths = PlannedItems.paths_of(writer.plan, planner, state_dict)
            md = pickle.dumps(writer.metadata) if writer.is_coordinator else None
            if paths is not None:
                self._plans[layout] = PlannedLayout(f"planned at step {step}", layout, writer.plan, paths,
                                                     writer.results, writer.is_coordinator, md, ())
                replay = Replay.of(writer, paths)
                if replay is not None:
                    self._replays[layout] = replay
                while len(self._plans) > 2:
                    self._replays.pop(next(iter(self._plans)), None)
                    del self._plans[next(iter(self._plans))]
            return (*self._copy(writer), md)
        except (Exception, CheckpointException) as e:
            self._plans.pop(layout, None)
            self._replays.pop(layout, None)
            writer.release()
            return False, describe(e), [], None

    @staticmethod
    def _copy(writer) -> tuple[bool, str, list]:
        """The copy into this rank's memory (every file joined into bytes, checksummed): (ok, why, entries)."""
        try:
            return True, "", writer.upload()
        except Exception as e:
            return False, describe(e), []
        finally:
            writer.release()

    def _unagreed(self, step: int, writer, why: str, t0: float, phases: dict) -> SnapshotResult:
        if writer is not None:
            writer.release()
        self.last_reason = f"memory snapshot of step {step} not agreed: {why}"
        log.warning("%s", self.last_reason)
        return SnapshotResult(step, "failed", self.last_reason, seconds=time.monotonic() - t0, phases=phases)

    def _lay_out_as_planned(self, storage: MemoryStorage, step: int, state_dict: dict, layout: str,
                            lies_in: Region | None = None):
        """This rank's files laid out by the last plan (views of the state, nothing copied yet) when its
        layout still holds: (writer, plan id), else (None, None). Never raises: every rank must vote. The
        replay of the last layout's files first (no DCP, no per-item work; only the non-tensor items when the
        state ``lies_in`` the memory file its files were laid out in), else the writer's ``write_data``."""
        from ..dcp.writer import EtrainWriter, PlannedItems, same_results

        planned = self._plans.get(layout)
        if planned is None:
            return None, None
        region = storage.region
        placed = region.placed if region is not None and self._placed_now(region.placed) else None
        try:
            if placed is not None and region is lies_in and region.laid_out is placed.replay:
                patches = placed.replay.patches(state_dict)  # the files lie there: their non-tensor items
                if patches is not None:
                    return Patched(storage, step_rel(step), patches, placed.replay), planned.plan_id
            for replay in (placed.replay if placed else None, self._replays.get(layout)):  # the placed one first
                files = replay.files(state_dict) if replay is not None else None
                if files is not None:
                    return Replayed(storage, step_rel(step), files, replay), planned.plan_id
        except Exception as e:
            log.debug("memory snapshot of step %d: cannot replay the last layout (%s)", step, describe(e))
        writer = EtrainWriter(storage, step_rel(step), token=self._token, executor=self._io)
        try:
            writer.is_coordinator = planned.is_coordinator
            writer.write_data(planned.plan, PlannedItems(planned.paths, state_dict))
            if same_results(writer.results, planned.results):
                replay = Replay.of(writer, planned.paths)
                if replay is not None:
                    self._replays[layout] = replay
                return writer, planned.plan_id
        except Exception as e:
            log.debug("memory snapshot of step %d: cannot reuse the last plan (%s)", step, describe(e))
        writer.release()
        return None, None

    def _placed_now(self, placed) -> bool:
        """Whether a region's placed buffers (``Region.placed``) are the host copy's layout and its last plan's."""
        return (placed is not None and self._host.holds(placed.placement)
                and placed.base is self._replays.get(placed.layout))

    def _gather(self, value) -> list:
        import torch.distributed as dist

        if self.group is None:
            return [value]
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _over_budget(self, tensor_bytes: int) -> tuple[str, int]:
        """Why the next snapshot would take this rank's tier over the budget ("" when it fits or there is
        none), and the bytes it would then hold. Sized by the last snapshot and copies of each (the same
        layout, envelopes and metadata included), else by ``tensor_bytes`` for each."""
        if not self.memory_budget_bytes:
            return "", 0
        with self._lock:
            last = self.snapshots[max(self.snapshots)].nbytes if self.snapshots else 0
            copies = {src: c.nbytes for per in self.copies.values() for src, c in per.items()}
        new = max(tensor_bytes, last)
        incoming = sum(max(tensor_bytes, copies.get(s, 0)) for s, d in self.peers.items() if self.rank in d)
        kept = self.held_bytes()
        after = kept + new + incoming
        if after <= self.memory_budget_bytes:
            return "", after
        return (f"rank {self.rank} would hold {after} bytes (its snapshot {new}, copies for peers {incoming}, "
                f"kept {kept}), over memory_budget_bytes={self.memory_budget_bytes}"), after

    def forget_after(self, step: int) -> None:  # a [health] rollback undid the steps after it; every rank at once
        self.wait()
        with self._lock:
            self.snapshots = {s: v for s, v in self.snapshots.items() if s <= step}
            self.copies = {s: v for s, v in self.copies.items() if s <= step}
            self.restorable = self.restorable if self.restorable is not None and self.restorable <= step else None
            self._arena.hold(set(self.snapshots))

    def _prune(self) -> None:
        """Keep only the restorable step (before a new snapshot, and once a newer one became restorable)."""
        with self._lock:
            keep = {self.restorable}
            self.snapshots = {s: v for s, v in self.snapshots.items() if s in keep}
            self.copies = {s: v for s, v in self.copies.items() if s in keep}
            self._arena.hold(set(self.snapshots))  # the memory of the others' files may be rewritten

    # --- copies to peers -------------------------------------------------------------

    def replicate_async(self, snapshot: MemorySnapshot) -> Future:
        """Send ``snapshot`` to this rank's peers and take theirs, in the background; every rank calls it
        with its snapshot of the same agreed step, in the same order. The future gives a
        :class:`ReplicationResult`; when every rank got all its copies the step becomes restorable."""
        if not self.replicating or not snapshot.agreed:
            fut: Future = Future()
            fut.set_result(ReplicationResult(snapshot.step, snapshot.agreed, "" if snapshot.agreed else "not agreed"))
            return fut
        self._inflight = self._thread.submit(self._replicate, snapshot)
        return self._inflight

    def _replicate(self, snapshot: MemorySnapshot) -> ReplicationResult:
        from .transport import PeerCopyTransport

        t0 = time.monotonic()
        if self._hosts is None:  # a peer on this host maps its copy from shared memory (.local_copy)
            self._hosts = host_keys(self.replica_group, self.world_size)
        transport = PeerCopyTransport(self.replica_group, self.peers, self._hosts, self._arena)
        got: dict[int, MemorySnapshot] = {}
        why = ""
        try:
            got = transport.send(snapshot)
        except Exception as e:  # a failed copy leaves the previous restorable step in place
            why = describe(e)
        try:
            bad = transport.agree(why)
        except Exception as e:  # a rank gone: the copies of this step are not complete everywhere
            bad = {self.rank: why or f"the agreement on the copies failed ({describe(e)})"}
        if any("shared memory:" in w for w in bad.values()):
            self._hosts = []  # every rank saw it (the agreement's reasons): copies over the network from now on
        with self._lock:
            if not bad:
                self.copies[snapshot.step] = got
                self.restorable = snapshot.step
        if not bad:
            self._prune()
        sent = snapshot.nbytes * len(self.peers[self.rank])
        reason = group_rank_errors(bad)
        if reason:
            log.warning("copies of the memory snapshot of step %d failed (%s)", snapshot.step, reason)
        return ReplicationResult(snapshot.step, not bad, reason, time.monotonic() - t0, sent,
                                 sum(s.nbytes for s in got.values()))

    def wait(self) -> None:
        """Until the background work in flight (a snapshot, copies to peers) ended; its outcome, an error
        included, is its future's."""
        if self._inflight is not None:
            wait_all([self._inflight])

    def close(self) -> None:
        self.wait()
        self._arena.freeze()
        self._thread.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def detach(self, timeout_s: float = 2.0) -> dict[int, Entry]:
        """What this tier holds, per step (its own snapshot, the copies it holds for peers), for keeping past
        its process group: waits up to ``timeout_s`` for the background work (a snapshot whose peer died
        fails its agreement), then lets go of its threads without waiting for them (a copy still blocked on a
        dead peer ends on its own timeout and is never recorded: only agreed steps are held)."""
        if self._inflight is not None:
            wait_all([self._inflight], timeout=timeout_s)
        self._arena.freeze()  # what it holds outlives it: never rewritten
        self._thread.shutdown(wait=False)
        self._io.shutdown(wait=False)
        return self.held_steps()

    # --- what the tier holds -------------------------------------------------------------

    def held_bytes(self) -> int:
        """Host bytes held by this rank's tier: its own snapshots, the copies it holds for peers, and the host
        buffers :meth:`take_async` copies the state into (kept from one snapshot to the next)."""
        buffers = self._host.nbytes()
        return buffers + self.view().nbytes()

    def held_steps(self) -> dict[int, Entry]:
        """Per step, this rank's own snapshot (or None) and the copies it holds for peers."""
        with self._lock:
            return {s: (self.snapshots.get(s), dict(self.copies.get(s, {})))
                    for s in set(self.snapshots) | set(self.copies)}

    def view(self) -> HeldView:
        """What this tier holds, keyed by step (:class:`checkpointing.recovery.held.HeldView`)."""
        return HeldView(self.held_steps())

    def holdings(self) -> dict[int, set[str]]:
        """Per step, the files this rank can give a restore (its own, its copies, the metadata)."""
        return self.view().holdings()

    def needed(self) -> dict[int, set[str]]:
        """Per step this rank knows agreed, every file of that step (what plan_restore must find)."""
        return self.view().needed()

    def sources(self, step: int) -> dict[str, bytes]:
        """The files of ``step`` this rank holds, its own and its copies', for :func:`load_from_memory`."""
        return self.view().sources(step)
