"""What a run does about a silent fault, once found: roll back in place, replay, attribute (a mixin of
:class:`trainer.health.guard.HealthGuard`, which holds the detectors and the state this reads).

    every rank:  restore the newest verified snapshot -> replay to the step that showed the fault
    clean replay                     -> "transient": the rank the findings or the replay's departure name
    back again, the state's evidence -> "persistent": PersistentFault (restored to the verified step first)
    back again, no rank's state      -> "data": the step's samples skipped and listed (non-finite values:
                                        what train.skip_nonfinite_steps says, as without [health])
    something else                   -> one snapshot further back, down the ring; none left: HealthStop
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from checkpointing.errors import EtrainError

from .detect import Finding, first_divergence

log = logging.getLogger("etrain")


class PersistentFault(EtrainError):
    """A fault that every replay brings back on the same rank: a bad device or host. The launcher decides:
    the Ray orchestrator evicts the rank (``health.on_persistent = "evict"``) or suspends the run; torchrun
    stops (exit 3). The trainer's state is back at its newest verified step when this is raised."""

    def __init__(self, message: str, rank: int | None, host: str = "", step: int = 0, verified_step: int | None = None):
        super().__init__(message)
        self.rank, self.host, self.step, self.verified_step = rank, host, step, verified_step

    def __reduce__(self):
        return (self.__class__, (str(self), self.rank, self.host, self.step, self.verified_step))


class HealthStop(EtrainError):
    """The run cannot go on safely: more batches skipped than ``health.max_skipped_batches``, or a fault no
    snapshot in the ring explains. The state is at its newest verified step."""


@dataclass
class Held:
    """A step computed but not applied: what its computation showed."""

    step: int
    findings: list[Finding]
    stats: object = None


class Response:
    # --- the response -------------------------------------------------------------------

    def respond(self):
        held, self.held = self.held, None
        n = held.step
        for f in held.findings:
            if f.kind == "spike":
                self._event("spike", step=n, signal=f.evidence.get("signal"), value=f.evidence.get("value"),
                            zscore=f.evidence.get("zscore"))
        before = self._gather_records()
        tried = 0
        for snap in self.ring.newest_first():
            if not all(self._all_gather(snap.intact())):  # every rank takes the same snapshot, or none
                self._event("health", note=f"verified snapshot of step {snap.step} failed its digest check in "
                                           "host memory; trying an older one")
                continue
            tried += 1
            t0 = time.monotonic()
            from_step = self.tr.step
            self._restore(snap)
            self.totals["rollbacks"] += 1
            replay = self._replay(n, held)
            self._event("rollback", step=n, from_step=from_step, to_step=snap.step,
                        seconds=round(time.monotonic() - t0, 3),
                        steps_reworked=max(0, min(n, self.tr.step) - snap.step), cause=held.findings[0].kind)
            new, stats = replay
            if not new:
                self._verdict("transient", held, self._localize(held.findings, before))
                return stats
            if new.step == n and {f.kind for f in new.findings} & {f.kind for f in held.findings}:
                # Persistent only on the state's evidence: a loss that spikes again on one rank may be that
                # rank's samples (the data's), and evicting a healthy rank for it would be worse than skipping.
                rank = self._rank_of(new.findings, state_only=True)
                if rank is not None:
                    self._verdict("persistent", new, rank)
                    self._restore(snap)  # a state the bad rank has not touched, for the eviction or the stop
                    raise PersistentFault(
                        f"a fault on rank {rank} ({self._host_of(rank)}) came back at step {n} after a rollback to "
                        f"verified step {snap.step}: {self._describe(new.findings)}", rank, self._host_of(rank), n,
                        snap.step)
                if any(f.kind in ("seal", "replica") for f in new.findings):  # the state's, on no one rank
                    self._verdict("persistent", new, None)
                    self._restore(snap)
                    raise PersistentFault(f"a fault in the state came back at step {n} after a rollback to verified "
                                          f"step {snap.step}, on no one rank ({self._describe(new.findings)})",
                                          None, "", n, snap.step)
                if any(f.kind == "nonfinite" for f in new.findings):
                    return self._nonfinite_again(new)
                return self._skip(new)
            held = new  # something else: a fault older than this snapshot's check; one further back
            n = new.step
        raise HealthStop(f"a fault at step {held.step} ({self._describe(held.findings)}) is not explained by any "
                         f"verified snapshot ({tried} tried); the run stops at step {self.tr.step}")

    def _replay(self, n: int, held: Held):
        """Train again up to step ``n`` (its computation included); the first step held on the way, or None,
        and the stats of step ``n`` when it completed. A check that found the fault is run again at ``n``."""
        self.replaying = True
        try:
            stats = None
            while self.tr.step < n:
                stats = self.tr.train_step()
                if self.held is not None:
                    new, self.held = self.held, None
                    return new, None
                if self.tr.step < n:
                    for hook in self.on_replay:
                        hook(stats)
            if any(f.kind == "replica" for f in held.findings) and self.tr.step == n:
                findings = self.check()
                if findings:
                    return Held(n, findings), None
            return None, stats
        finally:
            self.replaying = False

    def _restore(self, snap) -> None:
        snap.restore(self.leaves())
        extra = snap.extra
        skipped = self.skipped  # what is known of the data is never rolled back: a replay skips those batches
        self.tr.load_train_state(extra["train"])
        self.skipped = skipped
        self.tr.skipped_nonfinite = extra["skipped_nonfinite"]
        for k, w in self.windows.items():
            w.load(extra["windows"][k])
        self.tr.optimizer.zero_grad()
        self.tr.optimizer.after_load()
        self.seal = self.digests()
        self.records = {}
        self.ring.drop_after(snap.step)
        self.verified_step = snap.step
        for hook in self.on_rollback:
            hook(snap.step)

    def _nonfinite_again(self, held: Held):
        """Non-finite values that every replay brings back: what ``train.skip_nonfinite_steps`` says (the
        update skipped and counted, or NonFiniteStep: the run stops), as without [health]."""
        tr, st = self.tr, held.stats
        self._verdict("data", held, None)
        self.nonfinite_known.add(tr.samples_consumed)
        tr._nonfinite(st.loss if st else math.nan, st.grad_norm if st else math.nan)
        tr.step += 1
        tr.samples_consumed += tr.cfg.train.global_batch
        self.records[tr.step] = (None, None, None)
        if st is None:
            return None
        return dataclasses.replace(st, step=tr.step, samples_consumed=tr.samples_consumed,
                                   skipped_nonfinite=tr.skipped_nonfinite)

    def _skip(self, held: Held):
        """The data's fault: step ``held.step``'s samples are not trained on; the cursor moves past them."""
        tr = self.tr
        start = tr.samples_consumed
        end = start + tr.cfg.train.global_batch
        if self.skipped and self.skipped[-1][1] == start:
            self.skipped[-1][1] = end
        else:
            self.skipped.append([start, end])
        self.totals["skipped_samples"] += end - start
        self._verdict("data", held, None, samples=[start, end])
        tr.step += 1
        tr.samples_consumed = end
        self.records[tr.step] = (None, None, None)
        batches = sum((e - s) for s, e in self.skipped) // tr.cfg.train.global_batch
        if batches > self.cfg.max_skipped_batches:
            raise HealthStop(f"{batches} batches skipped as the data's fault (health.max_skipped_batches="
                             f"{self.cfg.max_skipped_batches}): the last at step {tr.step}, samples [{start}, {end}) "
                             f"({self._describe(held.findings)}); look at the data there, lower train.lr, or raise "
                             "health.max_skipped_batches")
        if held.stats is None:
            return None
        return dataclasses.replace(held.stats, step=tr.step, samples_consumed=tr.samples_consumed, skipped_batch=True)

    # --- attribution ----------------------------------------------------------------------

    def _rank_of(self, findings: list[Finding], *, state_only: bool = False) -> int | None:
        """The one rank the findings point at: a seal or a replica minority (exact, the state's evidence), else
        (unless ``state_only``) the one rank whose own loss left its window, or whose gradient share is not
        finite; None when they point at none or at several."""
        exact = {f.rank for f in findings if f.kind in ("seal", "replica") and f.rank is not None}
        if exact:
            return exact.pop() if len(exact) == 1 else None
        if self.world_size == 1 or state_only:
            return None
        for signal in ("local_loss", "local_grad"):
            ranks = {f.rank for f in findings if f.kind == "local" and f.evidence.get("signal") == signal}
            if ranks:
                return ranks.pop() if len(ranks) == 1 else None
        return None

    def _localize(self, findings: list[Finding], before: dict) -> tuple[int | None, str]:
        rank = self._rank_of(findings)
        if rank is not None:
            return rank, findings[0].kind
        after = self._gather_records()
        where = first_divergence(before, after)
        if where is not None and len(where[2]) == 1:
            return where[2][0], f"replay departs at step {where[0]} ({where[1]})"
        return None, "not localized" if where is None else f"replay departs at step {where[0]} on ranks {where[2]}"

    def _verdict(self, verdict: str, held: Held, where, **extra) -> None:
        rank, how = where if isinstance(where, tuple) else (where, "")
        target = next((x.target for x in held.findings if x.target), None)
        if self.faults is not None and target is None:
            fired = [e for e in self.faults.log if e.get("rank") == rank]
            target = fired[-1]["target"] if fired and "target" in fired[-1] else None
        self._event("sdc", verdict=verdict, rank=rank, node=self._host_of(rank) if rank is not None else None,
                    step=held.step, target=target, localized_by=how,
                    evidence=[x.to_dict() for x in held.findings][:6], **extra)
        on = f" on rank {rank} ({self._host_of(rank)})" if rank is not None else ""
        log.warning("health: %s fault at step %d%s: %s", verdict, held.step, on, self._describe(held.findings))

    def _host_of(self, rank: int | None) -> str:
        if rank is None:
            return ""
        if getattr(self, "_hosts", None) is None:
            self._hosts = self._all_gather(self.host) if self.group is not None else [self.host]
        return self._hosts[rank] if rank < len(self._hosts) else ""

    @staticmethod
    def _describe(findings: list[Finding]) -> str:
        parts = []
        for f in findings[:3]:
            ev = f.evidence
            what = ev.get("signal") or (", ".join(ev.get("leaves", [])[:2]) if ev.get("leaves") else "")
            parts.append(f"{f.kind}{f' on rank {f.rank}' if f.rank is not None else ''}{f' ({what})' if what else ''}")
        return "; ".join(parts) + (f" and {len(findings) - 3} more" if len(findings) > 3 else "")
