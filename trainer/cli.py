"""``python -m trainer``: train one config under any launcher.

    torchrun --nproc_per_node=2 -m trainer --config examples/tiny.toml \\
        --set parallel.tp=2 --log-file steps.jsonl

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun
sets them; a lone process needs none), validates the config against the world
size and loads the corpus before any process group starts, then trains,
printing progress on rank 0 and writing one JSON line per step to
``--log-file``. Exit status: 0 done, 2 invalid config, 1 anything else.

Checkpoints (``[checkpoint] url``): before any process group starts, rank 0
probes the URL with a write, refuses a run that does not resume where its run
id already has committed checkpoints, and takes the run's writer lock (a
second live writer of the same run is refused, naming the holder). Saves go
every ``interval_steps`` and at the last step (only the last without an
interval). ``checkpoint.max_consecutive_failures`` failed saves in a row stop
the run with exit 1, and so does a failed final save: a run whose work is not
durable says so.

``[health]`` (trainer.health): a silent fault found is rolled back in place and
replayed from the process's own verified snapshots, each verdict and rollback on
stderr (rank 0) and in its step's row of the log file; a fault that follows one rank stops the run
with exit 3, naming the rank and its host (torchrun cannot evict a rank: resume
without that host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import CheckpointError, ConfigError, EtrainError

from .config import RunConfig
from .config.load import load_config
from .heap import freeze_boot_heap, thaw_heap
from .host import usable_cpus

if TYPE_CHECKING:  # torch: imported only once the arguments are parsed, so that --help is instant
    from .loop import StepStats
    from .world import World


def parse_args(argv: list[str] | None, prog: str = "python -m trainer") -> argparse.Namespace:
    ap = ArgumentParser(prog=prog, description="Train one etrain run config, as one rank of a run "
                                 "under torchrun (or any launcher that sets RANK/WORLD_SIZE), or alone.")
    ap.add_argument("config", nargs="?", metavar="CONFIG", help="run config (TOML); the built-in defaults if omitted")
    ap.add_argument("--config", dest="config_opt", metavar="CONFIG", help="the same as CONFIG (the torchrun habit)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set parallel.tp=2 (repeatable)")
    ap.add_argument("--log-file", help="write one JSON line per step here (rank 0)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest committed checkpoint under checkpoint.url (any world size)")
    ap.add_argument("--quiet", action="store_true", help="print only the summary")
    args = ap.parse_args(argv)
    if args.config and args.config_opt and args.config != args.config_opt:
        ap.error(f"two configs given: {args.config} and --config {args.config_opt}; give one")
    args.config = args.config or args.config_opt
    return args


def pick_threads(quiet: bool = False) -> int | None:
    """Set OMP_NUM_THREADS when no launcher did (torchrun and Ray do): the cores per local process,
    less one left for the Python thread, checkpoint persistence and communication. Says so on rank 0.
    Returns the count chosen, or None when the environment already set one."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = usable_cpus()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    n = max(1, cores // local - 1)
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:  # too late for the variable alone
        sys.modules["torch"].set_num_threads(n)
    if not quiet and os.environ.get("RANK", "0") == "0":
        print(f"etrain: {n} compute thread{'s' if n > 1 else ''} per process ({cores} cores, {local} local "
              f"process{'es' if local > 1 else ''}); set OMP_NUM_THREADS to choose", flush=True)
    return n


def human(n: float, unit: str) -> str:
    """``n`` with a k/M/G prefix and three significant figures: 850 tok/s, 12.3k tok/s, 1.52M tokens."""
    for div, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}{prefix} {unit}"
    return f"{n:.3g} {unit}" if n < 10 else f"{n:.0f} {unit}"


def clock(seconds: float) -> str:
    """A duration: 4.2 s under a minute, else m:ss or h:mm:ss."""
    if seconds < 59.95:
        return f"{max(0.0, seconds):.1f} s"
    m, sec = divmod(round(max(0.0, seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Throughput:
    """The rates a progress line shows, both over one window: the steps since the line before.

        window = Throughput(tokens_per_step=cfg.train.global_batch * cfg.data.seq_len)
        window.start(first.step)                        # after the first step: its warm-up is left out
        steps_per_s, tokens_per_s = window.rates(s.step)   # at each line: since the last line; None, None if no time
    """

    def __init__(self, tokens_per_step: int, clock: Callable[[], float] = time.monotonic):
        self.tokens_per_step = tokens_per_step
        self.clock = clock
        self._since: tuple[float, int] | None = None

    def start(self, step: int) -> None:
        self._since = (self.clock(), step)

    def rates(self, step: int) -> tuple[float | None, float | None]:
        """Steps/s and tokens/s from the last :meth:`rates` (or :meth:`start`) to now, at ``step``; the window
        then starts again here."""
        now = self.clock()
        if self._since is None:
            self._since = (now, step)
            return None, None
        t, s0 = self._since
        if now <= t or step <= s0:
            return None, None
        self._since = (now, step)
        rate = (step - s0) / (now - t)
        return rate, rate * self.tokens_per_step


def format_step(s: StepStats, total: int, steps_per_s: float | None = None, tokens_per_s: float | None = None) -> str:
    """One progress line: loss, learning rate, throughput in human units, and the time left at
    ``steps_per_s``. Tokens/s and steps/s are of one window: ``steps_per_s`` and ``tokens_per_s`` over the
    same steps (:class:`Throughput`), or, not given, both of this step alone."""
    if steps_per_s is None or tokens_per_s is None:
        steps_per_s = tokens_per_s = None
    rate = steps_per_s or (1.0 / s.step_seconds if s.step_seconds > 0 else 0.0)
    tokens = s.tokens_per_s if tokens_per_s is None else tokens_per_s
    eta = f" | ETA {clock((total - s.step) / rate)}" if rate > 0 and s.step < total else ""
    moe = ""
    if s.aux_loss is not None:  # a Mixture of Experts: its balancing loss (part of the loss), imbalance, drops
        moe = f" (aux {s.aux_loss:.4f}) | imbalance {s.moe_imbalance:.2f}"
        moe += f" | dropped {s.moe_dropped}" if s.moe_dropped else ""
    return (f"step {s.step:>{len(str(total))}}/{total} | loss {s.loss:.4f}{moe} | lr {s.lr:.2e} | "
            f"{human(tokens, 'tok/s')} | {rate:.2f} steps/s | world {s.world_size}{eta}")


def describe_corpus(d: dict) -> str:
    """The corpus as one readable phrase (``Corpus.describe()`` is a dict for logs and tools)."""
    rest = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("kind", "files", "tokens", "digest"))
    return (f"{d.get('kind')}, {d.get('files')} file{'s' if d.get('files') != 1 else ''}, "
            f"{human(d.get('tokens') or 0, 'tokens')}" + (f", {rest}" if rest else "") + f", digest {d.get('digest')}")


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_memory(measured: dict[str, int], predicted: dict[str, int], rank: int) -> str:
    parts = [f"{k} {_mb(measured[k])} (predicted {_mb(predicted[k])})" for k in ("params", "grads", "optimizer")]
    return f"memory rank {rank}: " + ", ".join(parts)


def report_saves(ckpt, world: World) -> list[dict]:
    """Print the saves that finished; return them (as dicts) for the metrics."""
    if ckpt is None:
        return []
    done = ckpt.poll()
    for r in done:
        if world.is_main and r.ok:
            print(f"etrain: checkpoint step {r.step} committed: {ckpt.url_of(r.step)} ({r.bytes / 2**20:.1f} MiB, "
                  f"blocked {r.blocking_s * 1e3:.0f} ms, persisted in {r.persist_s:.2f} s)", flush=True)
    return [r.to_dict() for r in done]


def start_metrics(cfg, world: World):
    """The run's Prometheus endpoint on rank 0 (docs/metrics.md), or None when ``metrics.enabled`` is off."""
    if not cfg.metrics.enabled:
        return None
    import torch.distributed as dist

    from .observe.launcher import LauncherMetrics

    store = dist.distributed_c10d._get_default_store() if world.size > 1 else None
    m = LauncherMetrics(cfg, world, store)
    if m.url:
        print(f"etrain: metrics at {m.url}" + (f" (Prometheus target file {m.endpoint.file_sd_path})"
                                                if m.endpoint.file_sd_path else ""), flush=True)
    return m


def setup_logging(world: World) -> None:
    """Warnings from rank 0 only: every rank would say the same thing."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("etrain: %(levelname)s: %(message)s"))
    root = logging.getLogger("etrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if world.is_main else logging.ERROR)
    root.propagate = False


def _open_log(path: str | None, world: World):
    """The step log (rank 0), appended to; ConfigError when ``path`` cannot be a log file."""
    if not path or not world.is_main:
        return None
    if os.path.isdir(path):
        raise ConfigError(f"--log-file {path!r} is a directory; give a file name such as {path.rstrip('/')}/steps.jsonl")
    try:
        return open(path, "a")
    except OSError as e:
        raise ConfigError(f"--log-file {path!r} cannot be written: {e.strerror}") from None


def _writer_lock_owner(world: World) -> tuple[str, int]:
    """Who may take the run's writer lock over by epoch: the same torchrun job after a restart."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return "", 0


def _agree_on(verdict: str, world: World) -> str:
    """Rank 0's verdict on the run's checkpoints, for every rank (only the coordinator knows it)."""
    if world.size == 1:
        return verdict
    import torch.distributed as dist

    box = [verdict]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def say_health(events: list[dict], world: World, *, quiet: bool = False) -> None:
    """[health] rollbacks and spikes, one line each on stderr (rank 0); the guard's own warning says each
    verdict, and every event is also in its step's row of the log file (``health_events``)."""
    if not world.is_main or quiet:
        return
    for e in events:
        if e.get("kind") == "rollback":
            what = (f"rolled back from step {e['from_step']} to verified step {e['to_step']} in {e['seconds']} s "
                    f"({e['steps_reworked']} steps replayed)")
        elif e.get("kind") == "spike":
            what = f"{e.get('signal')} spike at step {e['step']} (robust z {e.get('zscore')})"
        else:
            continue
        print(f"etrain: health: {what}", file=sys.stderr, flush=True)


def say_tracker_notices(notices) -> None:
    """A tracker's change of health (stalled, dropping records, recovered, disabled, not flushed), on stderr."""
    for n in notices:
        print(f"etrain: warning: {n.text()}", file=sys.stderr, flush=True)


def _track_resume(trackers, manifest, world: World) -> None:
    """A restart that resumed from a checkpoint, for the trackers: a recovery when torchrun restarted the
    job, a resize when the world size changed since the save."""
    if not trackers or manifest is None:
        return
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts:
        trackers.log_event(manifest.step, "recovery", {"restored_step": manifest.step, "restarts": restarts})
    if manifest.world_size != world.size:
        trackers.log_event(manifest.step, "resize", {"from_workers": manifest.world_size, "to_workers": world.size})


def summary_line(first_step: int, last_step: int, seconds: float, tokens_per_step: int, first_loss: float,
                 last_loss: float) -> str:
    """The end of a run: the steps this process ran (not the run's total after a resume), their rate, the loss."""
    n = last_step - first_step + 1
    which = f"{n} steps" if first_step == 1 else f"steps {first_step}-{last_step} ({n} after resuming)"
    rate = f", {n / seconds:.2f} steps/s, {human(n * tokens_per_step / seconds, 'tok/s')}" if seconds > 0 else ""
    return f"etrain: trained {which} in {clock(seconds)}{rate}; loss {first_loss:.4f} -> {last_loss:.4f}"


@dataclass
class Outcome:
    """How a run of :func:`train_config` ended: ``exit_code`` 0 done, 2 invalid config, 3 a persistent silent
    fault on one rank ([health]: its host should leave), 1 anything else."""

    exit_code: int
    error: str = ""
    step: int = 0
    first_loss: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    seconds: float = 0.0


def main(argv: list[str] | None = None, prog: str = "python -m trainer") -> int:
    args = parse_args(argv, prog)
    pick_threads(args.quiet)
    overrides = args.set + (["checkpoint.resume=true"] if args.resume else [])
    return train_config(lambda: load_config(args.config, overrides), log_file=args.log_file,
                        quiet=args.quiet).exit_code


def train_config(load: Callable[[], RunConfig], *, log_file: str | None = None, quiet: bool = False) -> Outcome:
    """Train the config ``load()`` returns, as this process's rank (everything ``python -m trainer`` does)."""
    from .data.corpus import load_splits
    from .export.every import report_exports, wait_for_exports
    from .checkpoints import checkpoint_manager, checkpoint_preflight
    from .health import PersistentFault
    from .loop import Trainer
    from .observe.telemetry import comm_meter
    from .observe.trackers import Trackers, memory_values, open_trackers, step_values
    from .parallel.dims import resolve_device
    from .preflight import preflight
    from .world import World, init_distributed, shutdown_distributed

    args = argparse.Namespace(log_file=log_file, quiet=quiet)
    world = None
    ckpt = None
    log = None
    try:
        world = World.from_env()
        setup_logging(world)
        cfg = load()
        device = resolve_device(cfg.parallel, world.local_rank)
        model_info = preflight(cfg, world_size=world.size, rank=world.rank, device=device)
        if world.is_main and not args.quiet:
            from .plan.fit import warn_if_not_fitting

            warn_if_not_fitting(cfg, world.size, device)
        corpus, val_corpus = load_splits(cfg)  # the model's vocabulary checked against the tokenizer's first
        log = _open_log(args.log_file, world)
        ckpt = checkpoint_manager(cfg, world)
        if ckpt is not None and world.is_main:
            checkpoint_preflight(cfg, resume=cfg.checkpoint.resume)
            owner, generation = _writer_lock_owner(world)
            ckpt.take_writer_lock(owner=owner, epoch=generation)
            if not cfg.checkpoint.interval_steps and not args.quiet:
                print("etrain: checkpoint.url is set without checkpoint.interval_steps: only the final step is "
                      "saved", flush=True)
    except (ConfigError, CheckpointError) as e:
        # One message, from rank 0 only: every rank sees the same config.
        if world is None or world.is_main:
            print(f"etrain: invalid config: {e}" if isinstance(e, ConfigError) else f"etrain: {e}", file=sys.stderr)
        if log:
            log.close()
        if ckpt is not None:
            ckpt.close()
        return Outcome(2, str(e))

    meter = comm_meter(install=cfg.metrics.enabled and cfg.metrics.comm)
    meter.enabled = cfg.metrics.enabled and cfg.metrics.comm
    init_distributed(world, device)
    metrics = None
    trackers = Trackers([])
    try:
        freeze_boot_heap()  # a full garbage collection in a step: under 1 ms, not 150 (trainer.heap)
        trainer = Trainer(cfg, world, corpus=corpus, val_corpus=val_corpus, device=device)
        meter.name_axes(trainer.mesh)
        metrics = start_metrics(cfg, world)
        trackers = open_trackers(cfg, cfg.run_id) if world.is_main else trackers
        if ckpt is not None and cfg.checkpoint.resume:
            manifest = trainer.load_checkpoint(ckpt)
            _track_resume(trackers, manifest, world)
            if world.is_main:
                print(f"etrain: resumed from step {manifest.step} (saved at world {manifest.world_size})"
                      if manifest else "etrain: no checkpoint to resume from; starting at step 0", flush=True)
        total = cfg.train.steps
        if world.is_main and not args.quiet:
            what = model_info.describe() if model_info else f"{cfg.model.preset} model"
            print(f"etrain: {what}, world {world.size} "
                  f"(pp {trainer.dims.pp} x dp {trainer.dims.dp_replicate}x{trainer.dims.dp_shard} "
                  f"{f'x cp {trainer.dims.cp} {cfg.parallel.cp_style} ' if trainer.dims.cp > 1 else ''}"
                  f"x tp {trainer.dims.tp}{f', ep {trainer.dims.ep}' if trainer.dims.ep > 1 else ''}), "
                  f"zero stage {cfg.parallel.zero_stage}"
                  f"{' (no effect at dp 1)' if trainer.dims.zero_requested and not trainer.dims.zero_stage else ''}, "
                  f"{trainer.device.type}; corpus {describe_corpus(corpus.describe())}", flush=True)
        limit = cfg.checkpoint.max_consecutive_failures
        undurable = (lambda: ckpt.failed_in_a_row >= limit) if ckpt is not None else False
        first = last = None
        comm_totals = meter.bytes_since(None)[1]  # the first step's comm_bytes leaves set-up traffic out
        final_save = None
        t0 = time.monotonic()
        window = Throughput(cfg.train.global_batch * cfg.data.seq_len)
        for s in trainer.run_steps(total, ckpt, stop=undurable, save_when_stopping=False):
            if first is None:
                first = s
                window.start(s.step)  # the rates leave the first step's warm-up out
            last = s
            if s.health_events:
                say_health(s.health_events, world, quiet=args.quiet)
            if log:
                # This step's bytes per collective kind, from the comm meter (absent when it is off).
                comm, comm_totals = meter.bytes_since(comm_totals)
                extra = {"comm_bytes": comm} if meter.enabled else {}
                log.write(json.dumps({**s.to_dict(), **extra, "time": time.time()}) + "\n")
                log.flush()
            if trackers:
                trackers.log_step(s.step, step_values(s) | (memory_values(trainer.memory_measured) if first is s
                                                            else {}))
                say_tracker_notices(trackers.notices())
            if world.is_main and not args.quiet and (s.step == 1 or s.step % cfg.train.log_every == 0
                                                      or s.step == total):
                # Steps/s and tokens/s of the same window, the steps since the line before (the first: its own).
                print(format_step(s, total, *(window.rates(s.step) if s is not first else (None, None))),
                      flush=True)
            if world.is_main and not args.quiet and s.eval_loss is not None:
                print(f"eval at step {s.step}: loss {s.eval_loss:.4f} ({cfg.eval.batches} batches)", flush=True)
            if first is s and world.is_main and not args.quiet:
                print(format_memory(trainer.memory_measured, trainer.memory_predicted(), world.rank), flush=True)
            if s.stop:  # a rank saw max_consecutive_failures failed saves: stop at this boundary
                break
            if ckpt is not None and s.step == total:
                final_save = s.step
            saves = report_saves(ckpt, world)
            report_exports(ckpt, trackers, s.step)
            if metrics is not None:
                metrics.after_step(s, trainer, ckpt, saves)
        verdict = ""
        if ckpt is not None:
            ckpt.wait()
            saves = report_saves(ckpt, world)
            if metrics is not None:
                metrics.record_saves(saves)
            if ckpt.failed_in_a_row >= limit:
                verdict = (f"{ckpt.failed_in_a_row} checkpoints in a row failed (last: {ckpt.last_error}); the run "
                           f"stops at step {trainer.step} because its work is not being made durable: fix the "
                           f"storage at {ckpt.storage.join(ckpt.prefix)} and run again with --resume, or raise "
                           "checkpoint.max_consecutive_failures")
            elif final_save is not None and ckpt.failed_in_a_row:
                verdict = f"the final checkpoint (step {final_save}) failed: {ckpt.last_error}"
            verdict = _agree_on(verdict if world.is_main else "", world)
            wait_for_exports(ckpt, quiet=args.quiet)  # after the last collective: rank 0 alone waits
            report_exports(ckpt, trackers, trainer.step)
        done = Outcome(0, step=trainer.step, first_loss=first.loss if first else None,
                       loss=last.loss if last else None, seconds=time.monotonic() - t0,
                       eval_loss=trainer.last_eval[1] if trainer.last_eval else None)
        if verdict:
            if world.is_main:
                print(f"etrain: error: {verdict}", file=sys.stderr, flush=True)
            return dataclasses.replace(done, exit_code=1, error=verdict)
        if world.is_main and last is not None:
            print(summary_line(first.step, last.step, done.seconds, cfg.train.global_batch * cfg.data.seq_len,
                               first.loss, last.loss), flush=True)
        return done
    except ConfigError as e:
        if world.is_main:
            print(f"etrain: invalid config: {e}", file=sys.stderr)
        return Outcome(2, str(e))
    except PersistentFault as e:
        say_health(trainer.health.take_events(), world, quiet=args.quiet)
        saved = ""
        if ckpt is not None:  # every rank is back at the verified step: make it durable (collective)
            try:
                trainer.save_checkpoint(ckpt)
                ckpt.wait()
                saved = f", checkpoint committed at step {trainer.step}" if not ckpt.failed_in_a_row else ""
            except EtrainError as save_error:
                saved = f" (its checkpoint failed: {save_error})"
        if world.is_main:
            where = f"without host {e.host}" if e.host else "once its hosts are checked"
            print(f"etrain: error: {e}; the run stopped at its last verified step {e.verified_step}{saved}: "
                  f"resume it (--set checkpoint.resume=true) {where}", file=sys.stderr)
        return Outcome(3, str(e), step=trainer.step)
    except EtrainError as e:
        if world.is_main:
            print(f"etrain: error: {e}", file=sys.stderr)
        return Outcome(1, str(e))
    finally:
        thaw_heap()  # a process that goes on (tests run many runs in one) frees what this run made
        say_tracker_notices(trackers.close(cfg.logging.flush_timeout_s) if trackers else [])
        if metrics is not None:
            metrics.close()
        if log:
            log.close()
        if ckpt is not None:
            ckpt.close()
        shutdown_distributed()
