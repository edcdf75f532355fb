"""The training step loop.

    init_distributed(world, device)
    trainer = Trainer(cfg, world)
    for stats in trainer.run_steps(last, ckpt):      # train_step(), and a checkpoint when save_due()
        print(stats.step, stats.loss)

Both launchers drive this one loop (:meth:`Trainer.run_steps`): ``python -m
trainer`` (:mod:`trainer.cli`) and the Ray worker (``orchestrator.workers.worker``);
:func:`save_due` is the one rule for when they checkpoint.

A step trains on a fixed global batch of ``train.global_batch`` samples: each
data-parallel rank takes its contiguous share, split into micro-batches of
``train.micro_batch`` (gradient accumulation absorbs the data-parallel
degree) or fed to the pipeline schedule. Per-step randomness (dropout) is
seeded from (seed, step, sample index) before each micro-batch, never from
per-rank RNG state, so nothing rank-specific has to be saved. The learning
rate is a pure function of the step (``train.lr_schedule``: linear warmup, then
cosine, linear, constant or warmup-stable-decay; :meth:`TrainConfig.lr_at`).
``[profile]`` traces a window of steps on some ranks (:mod:`trainer.observe.profile`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import xxhash

from checkpointing.errors import EtrainError
from checkpointing.host_copy import fence_writes
from checkpointing.manager import CheckpointManager, SaveResult
from checkpointing.manifest import Manifest

from .config import RunConfig
from .data.corpus import Batcher, Corpus, check_vocab, load_splits
from .health import HealthGuard
from .models.moe import balance_step, load_router_bias, router_bias_state
from .models.spec import fill_local
from .observe import device_memory as memory
from .observe.profile import step_profiler
from .parallel.dims import Axis, ParallelDims, resolve_device, resolve_precision
from .parallel.parallelize import build_model_parts
from .world import World
from .zero import build_optimizer

log = logging.getLogger("etrain")


@dataclass(frozen=True)
class StepStats:
    """What one step did; a line of the step log."""

    step: int  # steps completed, after this one
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_seconds: float
    data_seconds: float
    world_size: int
    samples_consumed: int
    stop: bool = False  # some rank asked to stop after this step (all ranks agree)
    eval_loss: float | None = None  # held-out loss after this step, on the steps that evaluate ([eval])
    # steps whose update this trainer skipped so far because their loss or gradient norm was not finite
    # (train.skip_nonfinite_steps); this step is one of them when the count grew with it
    skipped_nonfinite: int = 0
    # Mixture of Experts: the load-balancing loss (its coefficient applied; part of ``loss``) and the
    # largest load-imbalance ratio (max over mean slots per expert, over the MoE layers); None when dense.
    aux_loss: float | None = None
    moe_imbalance: float | None = None
    # routed slots per expert, by MoE layer (block index), over the data-parallel ranks; slots dropped by capacity
    moe_tokens_per_expert: dict[str, list[float]] | None = None
    moe_dropped: int | None = None
    # [health]: this step's batch was not trained on (data.skip_ranges, or found to be the data's fault);
    # the newest verified step; what the health checks did since the step before (events: sdc, spike, rollback)
    skipped_batch: bool = False
    verified_step: int | None = None
    health_events: list[dict] | None = None
    health_totals: dict | None = None  # checks, check_seconds, rollbacks, skipped_samples (this rank's)

    def to_dict(self) -> dict:
        return asdict(self)


class NonFiniteStep(EtrainError):
    """A step's loss or gradient norm is nan or inf (every rank raises it at the same step): the run
    stops, since training on would only spread the non-finite values; a recovery would repeat it."""


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate of step ``step`` (0-based) under ``train.lr_schedule`` (:meth:`TrainConfig.lr_at`)."""
    return cfg.train.lr_at(step)


def step_seed(seed: int, step: int, sample_index: int) -> int:
    """Seed for the randomness of one micro-batch, from (seed, step, first sample index)."""
    return xxhash.xxh64_intdigest(f"step:{seed}:{step}:{sample_index}".encode()) & ((1 << 63) - 1)


def save_due(step: int, interval: int, last: int, *, final_by_caller: bool = False) -> bool:
    """Whether a loop that trains up to step ``last`` checkpoints after completing ``step``.

    Every ``interval`` steps (0: none by interval) and at ``last``, unless the caller saves that
    one itself (``final_by_caller``: under Ray the controller commits the final checkpoint once
    every rank has stopped)."""
    if step == last:
        return not final_by_caller
    return bool(interval) and step % interval == 0


def snapshot_due(step: int, every: int) -> bool:
    """Whether the memory tier snapshots after completing ``step`` (``[recovery] memory_every_steps``; 0:
    never): the tier's cadence, beside the durable checkpoint's (:func:`save_due`)."""
    return every > 0 and step % every == 0


class Trainer:
    """Model parts, optimizer and data for this rank; one call trains one step.

    Expects the default process group to exist (``trainer.world.init_distributed``).
    """

    def __init__(self, cfg: RunConfig, world: World, *, corpus: Corpus | None = None,
                 val_corpus: Corpus | None = None, device: torch.device | None = None, draw_weights: bool = True):
        """``draw_weights=False``: the initial weights are drawn only if no checkpoint is loaded before their
        first use (:meth:`initial_weights`): a group re-formed to restore draws no model only to load over it."""
        self.cfg = cfg
        self.world = world
        self.dims = ParallelDims.from_config(cfg, world.size)
        self.device = device or resolve_device(cfg.parallel, world.local_rank)
        if corpus is None:
            corpus, val_corpus = load_splits(cfg)  # checks the vocabulary itself
        else:
            check_vocab(cfg, corpus.vocab_size, "the training data's vocabulary")
        self.corpus = corpus
        self.coords = self.dims.coords(world.rank)
        self.dp_rank = self.dims.dp_rank(world.rank)
        self.batcher = Batcher(self.corpus, cfg.data.seq_len, cfg.train.seed, cfg.train.global_batch,
                               self.dp_rank, self.dims.dp)
        self.val_corpus = val_corpus
        self.val_batcher = None if val_corpus is None else Batcher(
            val_corpus, cfg.data.seq_len, cfg.train.seed, cfg.train.global_batch, self.dp_rank, self.dims.dp)
        self.last_eval: tuple[int, float] | None = None  # (step, held-out loss) of the newest evaluation
        self.mesh = self.dims.build_mesh(self.device.type)
        self.parts = build_model_parts(cfg, self.dims, self.mesh, world.rank, self.device, draw=draw_weights)
        self.optimizer = build_optimizer(self.parts, cfg, self.dims, self.mesh, world.rank)
        self.health = HealthGuard(self)  # [health]: checks, verified snapshots, rollback (collective: its group)
        self.mixed = resolve_precision(cfg.parallel, self.device) != torch.float32
        self.step = 0
        self.samples_consumed = 0
        self.skipped_nonfinite = 0
        self.memory_measured: dict[str, int] | None = None
        self.parts.train()
        # The initial weights (undrawn ones, then model.init_from) at first use, unless a checkpoint was loaded.
        self.weights_from: str | None = None
        self._draw_pending = self.parts.undrawn is not None
        self._init_from_pending = bool(cfg.model.init_from)
        self.pp_router_bias: dict = {}  # pipelined MoE: every stage's routing biases (balance_step gathers them)
        if world.is_main and (inert := cfg.train.inert_keys()):
            log.warning("%s: no effect with train.lr_schedule=%r; remove them or choose the schedule that reads "
                        "them", ", ".join(inert), cfg.train.lr_schedule)

    # --- state the checkpoint carries ----------------------------------------

    def train_state(self) -> dict:
        """Everything besides tensors needed to resume: the step and the data cursor."""
        return {
            "step": self.step,
            "samples_consumed": self.samples_consumed,
            "epoch": self.batcher.order.epoch_of(self.samples_consumed),
            "corpus_digest": self.corpus.digest,
            **({"weights_from": self.weights_from} if self.weights_from else {}),
            **({"skipped_ranges": [list(r) for r in self.health.skipped]} if self.health.skipped else {}),
            **({"verified": {"step": self.step, "checks": list(self.health.verified_checks)}}
               if self.health.verified_step == self.step and self.health.enabled else {}),
            **({"router_bias": bias} if (bias := self.pp_router_bias if self.dims.pp > 1
                                         else router_bias_state(self.parts.modules[0])) else {}),
        }

    def load_train_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.samples_consumed = int(state["samples_consumed"])
        # The checkpoint's weights, never drawn ones or model.init_from over them.
        self._draw_pending = self._init_from_pending = False
        self.weights_from = state.get("weights_from") if isinstance(state.get("weights_from"), str) else None
        self.health.load_skipped(state.get("skipped_ranges"))
        if self.cfg.model.is_moe:
            load_router_bias(self.parts.modules, state.get("router_bias") or {})
            self.pp_router_bias = state.get("router_bias") or {}

    @torch.no_grad()
    def initial_weights(self) -> None:
        """The weights a run starts from (unless a checkpoint was loaded), once, before their first use: those
        the build left undrawn, drawn into the optimizer's weights as a checkpoint's are loaded (each rounded
        through its parameter's dtype: ZeRO 0-2 made their fp32 masters from the cast parameters), then
        ``model.init_from`` over them. Collective under ZeRO 0-2 (``after_load``)."""
        if self._draw_pending:
            self._draw_pending = False
            dtypes = {fqn: p.dtype for m in self.parts.modules for fqn, p in m.named_parameters()}
            for fqn, t in self.optimizer.checkpoint_state()["model"].items():
                if (full := self.parts.undrawn(fqn, tuple(t.shape))) is not None:
                    fill_local(t, full.to(dtypes.get(fqn, full.dtype)))
            self.optimizer.after_load()
        self._apply_init_from()

    def _apply_init_from(self) -> None:
        """Load ``model.init_from`` into this layout (collective-free, once, before anything uses the
        weights): optimizer state starts fresh; the manifest's trainer_state records weights_from."""
        if not self._init_from_pending:
            return
        self._init_from_pending = False
        from .export.convert import WeightSource, load_weights

        source = WeightSource(self.cfg.model.init_from, self.cfg.model)
        load_weights(self.optimizer.checkpoint_state()["model"], source)
        self.optimizer.after_load()
        self.weights_from = source.where
        if self.world.is_main:
            log.info("weights from model.init_from=%s", source.where)

    def layout(self) -> dict:
        d = self.dims
        return {"world_size": self.world.size, "pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard,
                "tp": d.tp, "cp": d.cp, "zero_stage": self.cfg.parallel.zero_stage,
                "pp_stages_per_rank": self.cfg.parallel.pp_stages_per_rank}

    def save_checkpoint(self, manager: CheckpointManager) -> SaveResult | None:
        """Checkpoint the current step (collective). Blocks only for staging when the manager is async.
        Under ``[health]`` an unverified step is checked first (and rolled back and replayed if it fails)."""
        self.initial_weights()
        self.health.verify_now()
        return manager.save(self.step, self.optimizer.checkpoint_state(), layout=self.layout(),
                            config_hash=self.cfg.config_hash(), trainer_state=self.train_state(),
                            config=self.cfg.to_dict())

    def load_checkpoint(self, manager: CheckpointManager, step: int | None = None) -> Manifest | None:
        """Restore the newest valid checkpoint (or ``step``), resharded to this layout (collective)."""
        manifest = manager.load(self.optimizer.checkpoint_state(), step=step)
        if manifest is None:
            return None
        self.optimizer.after_load()
        self.load_train_state(manifest.trainer_state)
        if manager.on_committed is not None:  # a due step resumed from is exported unless its export is complete
            manager.on_committed(manifest.step)
        from checkpointing.manifest import config_changes
        from checkpointing.names import redact_config

        # What the training math depends on (the config hash's sections); a layout change is a reshard.
        changed = config_changes(manifest.config, redact_config(self.cfg.to_dict()), ("model", "data", "train"),
                                 ignore=("train.log_every", "train.skip_nonfinite_steps"))
        if changed:
            what = ", ".join(f"{k} {str(old)[:40]} -> {str(new)[:40]}" for k, old, new in changed)
            what += self.cfg.train.schedule_moves({k[6:]: v for k, v, _ in changed if k.startswith("train.")},
                                                  self.step)
            log.warning("checkpoint step %d was written with a different config: %s; resuming with the current one",
                        manifest.step, what)
        elif not manifest.config_hash:
            log.warning("checkpoint step %d records no config (adopted): resuming with the current one, whose "
                        "model must match it", manifest.step)
        elif manifest.config_hash != self.cfg.config_hash():
            log.warning("checkpoint step %d was written with a different config (hash %s, now %s); "
                        "resuming with the current one", manifest.step, manifest.config_hash, self.cfg.config_hash())
        if manifest.trainer_state.get("corpus_digest") not in (None, self.corpus.digest):
            log.warning("checkpoint step %d trained on another corpus (digest %s, now %s): the data order differs",
                        manifest.step, manifest.trainer_state.get("corpus_digest"), self.corpus.digest)
        return manifest

    def memory_predicted(self) -> dict[str, int]:
        if self.parts.local_params:
            per = memory.bytes_per_param(self.dims.zero_stage, self.dims.zero_shards, self.mixed)
            # ZeRO 0-2 under expert parallelism: the experts are FSDP's, sharded over dp_shard (ep x the rest) x cp
            ex = sum(p.numel() for m in self.parts.expert_units for p in m.parameters())
            fsdp = memory.bytes_per_param(3, self.dims.shard_ranks, self.mixed)
            return {k: round(v * (self.parts.local_params - ex) + fsdp[k] * ex) for k, v in per.items()}
        return memory.predict(self.cfg, self.dims, self.world.rank, mixed=self.mixed)

    # --- the step ------------------------------------------------------------

    def train_step(self, stop: bool | Callable[[], bool] = False) -> StepStats:
        """Train one step. ``stop``: this rank votes to stop after it; the vote rides on the
        step's own all-reduce, so every rank learns the outcome at the same step boundary.
        A callable is asked at the all-reduce, after the backward pass: a stop requested
        while the step computes still ends this step, not the next one."""
        self.initial_weights()
        cfg, t0 = self.cfg, time.monotonic()
        health, n = self.health, self.step + 1
        if health.is_skipped(self.samples_consumed):
            return self._skip_batch(t0)
        lr = lr_at(cfg, self.step)
        positions = self.batcher.local_positions(self.samples_consumed)
        inputs, targets = self.batcher.tokens(positions)
        health.before_step(n)
        if health.faults is not None:
            targets = health.faults.poison(n, targets, self.corpus.vocab_size)
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        t_data = time.monotonic() - t0

        aux_sum = None
        if self.parts.pipeline is not None:
            self._seed(positions.start)
            self.optimizer.before_backward(final=True)
            loss_sum = self.parts.pipeline_step(inputs, targets)
            self.optimizer.after_backward(final=True)
            aux_sum = self.parts.pipeline_aux()  # every stage's MoE layers' (the last stage's loss has none)
        else:
            mb = cfg.train.micro_batch
            n_micro = len(positions) // mb
            loss_sum = torch.zeros((), device=self.device)
            aux_sum = torch.zeros((), device=self.device)
            for i in range(n_micro):
                self._seed(positions.start + i * mb)
                self.optimizer.before_backward(final=i == n_micro - 1)
                logits = self.parts.forward(inputs[i * mb : (i + 1) * mb])
                loss = self.parts.loss(logits, targets[i * mb : (i + 1) * mb]) / n_micro
                aux = self.parts.aux_loss()
                if aux is not None:
                    aux_sum += aux.detach().float() / n_micro
                loss.backward()
                loss_sum += loss.detach()
                self.optimizer.after_backward(final=i == n_micro - 1)

        moe = self.parts.is_moe
        health.after_backward(n)  # chaos: a gradient flip lands before the norms see the gradients
        local_sq = self.optimizer.local_norm_sq().to(self.device)
        flag = 0
        if health.enabled or health.faults is not None:
            local_loss = float(loss_sum) if self._counts_loss and loss_sum is not None else None
            flag = health.before_reduce(n, local_loss, float(local_sq))
        norm_sq, loss, stop_votes, aux_mean, flags = self._reduce_norm_and_loss(
            loss_sum, stop, aux_sum if moe else None, local_sq, flag)
        if moe and self.parts.pipeline is not None:
            loss += aux_mean
        grad_norm = math.sqrt(norm_sq) if norm_sq >= 0 else math.nan
        if health.after_reduce(n, loss, grad_norm, flags):  # a finding: this step's update is held
            self.optimizer.zero_grad()
            dt = time.monotonic() - t0
            health.held.stats = StepStats(
                step=n, loss=loss, lr=lr, grad_norm=grad_norm,
                tokens_per_s=cfg.train.global_batch * cfg.data.seq_len / dt, step_seconds=dt, data_seconds=t_data,
                world_size=self.world.size, samples_consumed=self.samples_consumed + cfg.train.global_batch,
                stop=stop_votes > 0, skipped_nonfinite=self.skipped_nonfinite)
            health.after_update(n, applied=False)
            return None
        applied = math.isfinite(loss) and math.isfinite(grad_norm)
        if applied:
            clip = cfg.train.grad_clip
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
            fence_writes()  # a device-to-host copy of the state still reading it on its side stream (CUDA)
            self.optimizer.step(lr, coef)
        else:  # every rank sees the same reduced values: all skip, or all stop, at this step
            self._nonfinite(loss, grad_norm)
        health.after_update(n, applied=applied)
        # the ranks routing different tokens through one layer: data-parallel and cp; under pp, each stage's
        balance = balance_step(self.parts.modules, cfg.model.router_bias_update_rate,
                               self.dims.group(self.mesh, self.dims.loss_mesh),
                               self.dims.group(self.mesh, Axis.PP)) if moe else None
        if balance is not None and balance.router_bias is not None:
            self.pp_router_bias = balance.router_bias
        if self.memory_measured is None:
            self.memory_measured = self.optimizer.memory_bytes()
        self.optimizer.zero_grad()

        self.step += 1
        self.samples_consumed += cfg.train.global_batch
        dt = time.monotonic() - t0
        return StepStats(
            step=self.step, loss=loss, lr=lr, grad_norm=grad_norm,
            tokens_per_s=cfg.train.global_batch * cfg.data.seq_len / dt, step_seconds=dt,
            data_seconds=t_data, world_size=self.world.size, samples_consumed=self.samples_consumed,
            stop=stop_votes > 0, skipped_nonfinite=self.skipped_nonfinite,
            aux_loss=aux_mean if moe else None, moe_imbalance=balance.imbalance if balance else None,
            moe_tokens_per_expert=balance.tokens_per_expert if balance else None,
            moe_dropped=balance.dropped if balance else None,
        )

    def _skip_batch(self, t0: float) -> StepStats:
        """A step whose batch lies in a skipped range (``data.skip_ranges``, or the run's own): no update, the
        cursor moves past it; its loss is nan (nothing was computed)."""
        cfg = self.cfg
        lr = lr_at(cfg, self.step)
        self.step += 1
        self.samples_consumed += cfg.train.global_batch
        self.health.after_update(self.step, applied=False)
        dt = max(time.monotonic() - t0, 1e-9)
        return StepStats(step=self.step, loss=math.nan, lr=lr, grad_norm=math.nan, tokens_per_s=0.0, step_seconds=dt,
                         data_seconds=0.0, world_size=self.world.size, samples_consumed=self.samples_consumed,
                         skipped_nonfinite=self.skipped_nonfinite, skipped_batch=True)

    def _nonfinite(self, loss: float, grad_norm: float) -> None:
        """A step whose loss or gradient norm is not finite: NonFiniteStep, or with
        ``train.skip_nonfinite_steps`` no update (parameters and optimizer state untouched; the
        gradients are dropped by ``zero_grad``), counted and logged. The data cursor still moves on:
        the batch was consumed, and training it again would give the same values."""
        step = self.step + 1  # as the step log numbers it
        what = f"the loss is {loss:.6g} and the gradient norm {grad_norm:.6g} at step {step}"
        if not self.cfg.train.skip_nonfinite_steps:
            raise NonFiniteStep(f"{what}: training diverged or its weights or data hold nan/inf; resume from an "
                                "earlier checkpoint with a lower train.lr, or set train.skip_nonfinite_steps = true "
                                "to skip such steps")
        self.skipped_nonfinite += 1
        log.warning("%s: its update is skipped (train.skip_nonfinite_steps; %d skipped so far)", what,
                    self.skipped_nonfinite)

    def run_steps(self, until: int, ckpt: CheckpointManager | None = None, *, stop: bool | Callable[[], bool] = False,
                  final_by_caller: bool = False, save_when_stopping: bool = True) -> Iterator[StepStats]:
        """The step loop of every launcher: train until step ``until`` or a stop vote, checkpointing
        by :func:`save_due`; yields each step's stats once its save (if due) has started.

        ``stop``: this rank's vote (see :meth:`train_step`); the loop ends after the step that carried
        it. That step's checkpoint is still taken if due, unless ``save_when_stopping`` is off (the
        trainer stops on failed saves: another one would not help). ``final_by_caller``: the caller
        commits step ``until`` itself (the controller does under Ray)."""
        interval = self.cfg.checkpoint.interval_steps
        every = self.cfg.eval.every_steps
        prof = step_profiler(self.cfg, self.world, self.device, done=self.step, until=until)  # None unless [profile]
        self.initial_weights()  # before the first check: the state it verifies is the one trained from
        self.health.start()  # the state this loop starts from becomes the first verified snapshot
        try:
            while self.step < until:
                if prof:
                    prof.before(self.step + 1)
                # a held step (a [health] finding) comes back from between_steps as the step it became
                s = self.health.between_steps(self.train_step(stop=stop))
                if s is None:
                    continue
                if prof:
                    prof.after(s.step)
                if every and self.val_batcher is not None and (s.step % every == 0 or s.step == until):
                    s = dataclasses.replace(s, eval_loss=self.evaluate())
                if ckpt is not None and (save_when_stopping or not s.stop) and save_due(
                        s.step, interval, until, final_by_caller=final_by_caller):
                    self.save_checkpoint(ckpt)
                if self.health.enabled:
                    s = dataclasses.replace(s, verified_step=self.health.verified_step,
                                            health_events=self.health.take_events() or None,
                                            health_totals=self.health.summary())
                yield s
                if s.stop:
                    return
        finally:
            if prof:
                prof.close()

    def evaluate(self) -> float:
        """Mean loss over ``eval.batches`` global batches of the validation split (collective;
        :func:`trainer.evaluation.evaluate`)."""
        from .evaluation import evaluate

        return evaluate(self)

    @property
    def _counts_loss(self) -> bool:
        """Whether this rank's loss enters the all-reduce: the last pipeline stage's first tensor-parallel
        rank, so the loss counts once per data-parallel and cp rank (each cp rank's share of the sequence)."""
        return self.parts.has_last_stage and self.coords[Axis.TP] == 0

    def _seed(self, sample_index: int) -> None:
        # Whether the forward pass draws random numbers is the model's spec's to say (a model a user brings
        # may drop out whatever model.dropout says).
        if self.parts.draws_random:
            torch.manual_seed(step_seed(self.cfg.train.seed, self.step, sample_index))

    def _reduce_norm_and_loss(self, loss_sum: torch.Tensor | None, stop: bool | Callable[[], bool],
                              aux_sum: torch.Tensor | None = None, local_sq: torch.Tensor | None = None,
                              flag: int = 0) -> tuple[float, float, float, float, float]:
        """One all-reduce for the global gradient norm, the mean loss, the stop votes and the ranks with a
        [health] finding of their own (their count).

        The loss is counted once per data-parallel rank: by the last pipeline
        stage's first tensor-parallel rank.
        """
        counts = self._counts_loss and loss_sum is not None
        contrib = loss_sum.float() if counts else torch.zeros((), device=self.device)
        vote = torch.full((), 1.0 if (stop() if callable(stop) else stop) else 0.0, device=self.device)
        if local_sq is None:
            local_sq = self.optimizer.local_norm_sq().to(self.device)
        parts = [local_sq, contrib.to(self.device), vote, torch.full((), float(flag), device=self.device)]
        if aux_sum is not None:  # a Mixture of Experts: its aux loss rides along (a dense model's stays 3 numbers)
            # counted once per data-parallel, cp and pipeline rank (each stage's MoE layers)
            mine = self.coords[Axis.TP] == 0
            parts.append((aux_sum.float() if mine else torch.zeros((), device=self.device)).to(self.device))
        reduced = torch.stack(parts)
        if self.world.size > 1:
            dist.all_reduce(reduced)
        norm_sq, loss, votes, flags, *aux_total = reduced.tolist()
        return norm_sq, loss / self.dims.grad_ranks, votes, sum(aux_total) / self.dims.grad_ranks, flags
