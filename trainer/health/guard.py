"""The run's response to silent faults, inside the trainer: detect, roll back in place, replay, attribute.

    guard = HealthGuard(trainer)          # in Trainer.__init__ (collective: its side group)
    # the step, in Trainer.train_step:
    guard.before_step(n)                  # chaos faults due at the boundary
    flag = guard.before_reduce(n, local_loss, local_norm_sq)   # seal and local windows; rides the step's all-reduce
    hold = guard.after_reduce(n, loss, grad_norm, flags)       # True: the update is not applied
    guard.after_update(n, applied)        # the seal: every leaf's digest after the update
    # between steps, in Trainer.run_steps:
    stats = guard.between_steps(stats)    # a due check; a pending finding answered (rollback, replay, verdict)

What is checked (docs/operations.md#silent-faults):

- **the seal**: each rank's digest of every leaf of its state after an update, checked again just before
  the next update: a change in between (a bit flipped at rest, in a parameter or the optimizer's moments)
  is found at once, on the rank it happened on;
- **replicas**: every ``check_every_steps`` the ranks that must hold the same bytes of a leaf (data-parallel
  replicas under ZeRO 0-2 and HSDP, tensor-parallel-replicated norms) compare digests on a gloo group of
  their own, never inside the training collectives; a step that passes is *verified* and copied into the
  ring (:mod:`.ring`);
- **spikes**: the loss and the gradient norm against a robust z-score of the last ``spike_window`` steps,
  and each rank's own loss and gradient contribution against its own window (a rank whose contribution
  is an outlier); non-finite values.

One number per rank (its local findings) rides the step's existing all-reduce, so every rank learns of a
finding at the same step, holds that step's update and takes the same path. The response: every rank
restores the newest verified snapshot (its own host copy: same layout, nothing to reshard) and replays
the steps since, deterministically (per-step randomness derives from the step and the samples). A clean
replay is a **transient** fault; the rank is the one the finding named, or where the replay first departs
from the records the faulty run left (a rank's own loss, gradient contribution or state). A fault that
comes back on one rank is **persistent** (:class:`PersistentFault`; the launcher evicts the rank or stops);
one that comes back on every rank, or on none in particular, is the **data's**: the step's samples are
skipped and listed (``skipped_ranges``). A finding the replay does not explain sends the rollback one
snapshot further back, down the ring.
"""

from __future__ import annotations

import logging
import math
import socket
import time

import torch
import torch.distributed as dist


from .detect import Finding, SpikeWindow, replica_findings, target_of_all
from .digest import combine, digest, identity, local, state_leaves
from .faults import Faults
from .response import Held, Response
from .ring import VerifiedRing

log = logging.getLogger("etrain")


class HealthGuard(Response):
    def __init__(self, trainer):
        tr = self.tr = trainer
        self.cfg = tr.cfg.health
        self.enabled = self.cfg.enabled
        self.active = False  # once run_steps started it: a step driven alone (a bench, a test) is not checked
        self.rank, self.world_size = tr.world.rank, tr.world.size
        self.faults = Faults(self.cfg.faults, self.rank, tr.cfg.train.seed) if self.cfg.faults else None
        w, z = self.cfg.spike_window, self.cfg.spike_zscore
        # the reduced loss and gradient norm, and this rank's own loss (its gradient share has no window: a
        # shard's norm wanders with its shard; only a non-finite one is a finding of its own)
        self.windows = {"loss": SpikeWindow(w, z), "grad_norm": SpikeWindow(w, z), "local_loss": SpikeWindow(w, z)}
        self.ring = VerifiedRing(self.cfg.rollback_depth, self.cfg.check_every_steps)
        self.group = dist.new_group(backend="gloo") if self.enabled and self.world_size > 1 else None
        self.host = socket.gethostname()
        self.verified_step: int | None = None
        self.verified_checks: list[str] = []
        self.records: dict[int, tuple] = {}  # step -> (local loss, local_norm_sq, state digest | None)
        self.seal: list[int] | None = None
        self.held: Held | None = None
        self.replaying = False
        self.skipped: list[list[int]] = [list(r) for r in tr.cfg.data.skip_ranges]
        self.events: list[dict] = []  # since the launcher last took them (take_events)
        self.totals = {"checks": 0, "check_seconds": 0.0, "skipped_samples": 0, "rollbacks": 0}
        self._leaves: list | None = None
        self._ids: list | None = None
        self._local_flags: list[dict] = []
        self._hook = None
        self.on_rollback: list = []  # called with the step rolled back to (the launcher's own copies of later steps)
        self.on_replay: list = []  # called with each replayed step's stats (the launcher's history of it)
        self.nonfinite_known: set[int] = set()  # cursors of batches whose every replay was non-finite
        self._step_local: tuple = (None, 0.0)

    # --- the state -----------------------------------------------------------------

    def leaves(self) -> list[tuple[str, torch.Tensor]]:
        if self._leaves is None:
            self._leaves = state_leaves(self.tr.optimizer.checkpoint_state())
            self._ids = [identity(k, t, self.rank) for k, t in self._leaves]
        return self._leaves

    def digests(self) -> list[int]:
        return [digest(local(t)) for _, t in self.leaves()]

    def seal_breaks(self, now: list[int]) -> list[str]:
        """The leaves whose digests ``now`` differ from the seal (changed since this rank's last update)."""
        if self.seal is None:
            return []
        return [k for (k, _), a, b in zip(self.leaves(), self.seal, now) if a != b]

    def extra_state(self) -> dict:
        """What a rollback restores besides the tensors: the trainer's cursor and the windows."""
        return {"train": self.tr.train_state(), "skipped_nonfinite": self.tr.skipped_nonfinite,
                "windows": {k: w.state() for k, w in self.windows.items()}}

    # --- inside a step -------------------------------------------------------------

    def before_step(self, n: int) -> None:
        if self.faults is not None:
            self.faults.at_boundary(n, self.leaves())
            hook = self.faults.activation_hook(n)
            if hook is not None:
                self._hook = self.tr.parts.modules[0].register_forward_hook(hook)

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        opt = self.tr.optimizer
        out = []
        for o in getattr(opt, "_both", (opt,)):
            for gi, g in enumerate(o.optimizer.param_groups):
                for pi, p in enumerate(g["params"]):
                    if p.grad is not None:
                        out.append((f"grad.{gi}.{pi}", local(p.grad)))
        return out

    def after_backward(self, n: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.faults is not None:
            self.faults.on_grads(n, self.grads())

    def before_reduce(self, n: int, local_loss: float | None, local_norm_sq: float) -> int:
        """This rank's findings before the step's all-reduce (1 if any): the seal, its own windows."""
        self._local_flags = []
        self._step_local = (local_loss, local_norm_sq)
        if not self.active:
            return 0
        bad = self.seal_breaks(self.digests()) if self.seal is not None else []
        if bad:
            self._local_flags.append({"kind": "seal", "rank": self.rank, "leaves": bad[:8], "n_leaves": len(bad),
                                      "target": target_of_all(bad)})
        for name, v in (("local_loss", local_loss), ("local_grad", local_norm_sq)):
            if v is None:
                continue
            if not math.isfinite(v):
                self._local_flags.append({"kind": "local", "rank": self.rank, "signal": name, "value": v})
                continue
            if name not in self.windows:
                continue
            spike, z = self.windows[name].is_spike(v)
            if spike:
                self._local_flags.append({"kind": "local", "rank": self.rank, "signal": name, "value": v,
                                          "zscore": round(z, 2)})
        return 1 if self._local_flags else 0

    def after_reduce(self, n: int, loss: float, grad_norm: float, flags: float) -> bool:
        """Whether step ``n``'s update is held: a finding on some rank, a spike or a non-finite value.
        The same answer on every rank (its inputs are all-reduced)."""
        if not self.active or (self.verified_step is None and not self.replaying):
            return False  # nothing to roll back to (a step driven outside run_steps): the usual rules
        findings: list[Finding] = []
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and self.tr.samples_consumed in self.nonfinite_known:
            return False  # a replay of a step already found to be non-finite every time: the usual rules
        if not finite:
            findings.append(Finding("nonfinite", n, evidence={"loss": loss, "grad_norm": grad_norm}))
        else:
            for name, v in (("loss", loss), ("grad_norm", grad_norm)):
                spike, z = self.windows[name].is_spike(v)
                if spike:
                    findings.append(Finding("spike", n, evidence={"signal": name, "value": v, "zscore": round(z, 2),
                                                                   "window": len(self.windows[name].values)}))
        if flags > 0:
            findings.extend(self._gather_local(n))
        if not findings:
            self.windows["loss"].accept(loss)
            self.windows["grad_norm"].accept(grad_norm)
            if self._step_local[0] is not None:
                self.windows["local_loss"].accept(self._step_local[0])
            return False
        self.held = Held(n, findings)
        return True

    def _gather_local(self, n: int) -> list[Finding]:
        every = self._all_gather(self._local_flags)
        out = []
        for flags in every:
            for f in flags:
                f = dict(f)
                out.append(Finding(f.pop("kind"), n, f.pop("rank"), f.pop("target", None), f))
        return out

    def after_update(self, n: int, applied: bool) -> None:
        ll, lg = self._step_local
        if not self.active:
            return
        if applied:
            self.seal = self.digests()
        self.records[n] = (ll, lg, combine(self.seal) if applied and self.seal is not None else None)

    # --- between steps ---------------------------------------------------------------

    def start(self) -> None:
        """Before the first step of run_steps: the state it starts from is checked and becomes the first
        verified snapshot (collective)."""
        if self.enabled and self.verified_step is None:
            self.active = True
            self.check()

    def check_due(self, step: int) -> bool:
        return self.active and step % self.cfg.check_every_steps == 0 and self.verified_step != step

    def check(self) -> list[Finding]:
        """Compare replicas' digests (collective on the side group); a clean step becomes verified. Each rank
        hashes its state afresh: a change since its seal is a finding too (its own, at rest)."""
        t0 = time.monotonic()
        step = self.tr.step
        now = self.digests()
        sealed_bad = self.seal_breaks(now)
        every = self._all_gather({"digests": dict(zip(self._ids, now)), "seal": sealed_bad[:8],
                                  "n_seal": len(sealed_bad)})
        findings = replica_findings(step, {r: e["digests"] for r, e in enumerate(every)})
        for r, e in enumerate(every):
            if e["n_seal"]:
                findings.append(Finding("seal", step, r, target_of_all(e["seal"]),
                                        {"leaves": e["seal"], "n_leaves": e["n_seal"]}))
        self.totals["checks"] += 1
        if not findings:
            self.verified_step = step
            self.verified_checks = ["seal", "replicas", "spike", "finite"]
            self.ring.add(step, self.leaves(), self.extra_state())
            self.records = {s: r for s, r in self.records.items() if s > step}
            self.seal = now
        self.totals["check_seconds"] += time.monotonic() - t0
        return findings

    def between_steps(self, stats):
        """After a step (or a held one): answer a pending finding, then a due check. Returns the stats of the
        step the run completed last, or None when none was completed (a held step replayed into a skip is
        still returned, as the step it became)."""
        if self.held is not None:
            stats = self.respond()
        if stats is not None and self.check_due(self.tr.step):
            findings = self.check()
            if findings:
                self.held = Held(self.tr.step, findings, stats)
                stats = self.respond()
        return stats

    def verify_now(self) -> None:
        """Before a durable save of an unverified step: check it (and answer what the check finds)."""
        if self.active and self.verified_step != self.tr.step:
            findings = self.check()
            if findings:
                self.held = Held(self.tr.step, findings)
                self.respond()
                if self.verified_step != self.tr.step:
                    self.check()

    # --- plumbing -------------------------------------------------------------------------

    def _all_gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _gather_records(self) -> dict[int, dict]:
        return dict(enumerate(self._all_gather(dict(self.records))))

    def _event(self, kind: str, **fields) -> None:
        e = {"kind": kind, "step": fields.pop("step", self.tr.step), **fields}
        self.events.append(e)

    def take_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def set_faults(self, specs: list | None, fired: set | None = None) -> None:
        """Chaos faults from now on (``[health] faults`` entries, checked as the config checks them); ``fired``:
        the transient faults that fired already (shared, so that a new trainer does not fire them again)."""
        from ..config.health import check_fault

        for i, f in enumerate(specs or []):
            check_fault(f, f"health.faults[{i}]")
        self.faults = Faults(list(specs), self.rank, self.tr.cfg.train.seed, fired=fired) if specs else None

    def load_skipped(self, ranges) -> None:
        """A checkpoint's skipped ranges (its data state), with ``data.skip_ranges``: merged, sorted."""
        if not isinstance(ranges, list):
            return
        good = [[int(a), int(b)] for a, b in (r for r in ranges if isinstance(r, (list, tuple)) and len(r) == 2)
                if isinstance(a, int) and isinstance(b, int) and 0 <= a < b]
        merged: list[list[int]] = []
        for a, b in sorted(good + [list(r) for r in self.tr.cfg.data.skip_ranges]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.skipped = merged

    def is_skipped(self, start: int) -> bool:
        return any(s <= start < e for s, e in self.skipped)

    def summary(self) -> dict:
        t = self.totals
        return {"checks": t["checks"], "check_seconds": round(t["check_seconds"], 6), "rollbacks": t["rollbacks"],
                "skipped_samples": t["skipped_samples"]}
