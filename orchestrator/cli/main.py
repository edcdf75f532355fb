"""The ``etrain`` command.

    etrain run CONFIG.toml [--detach] [--workers N] [--min-workers N] [--max-workers N] [--store URL] [--run-id ID]
                           [--set section.field=value ...] [--address RAY_ADDRESS] [--no-progress]
    etrain submit CONFIG.toml --address http://HEAD:8265 [--store URL] [...]   (as a Ray job; the same options as run)
    etrain logs RUN [-f]                  (the output of a run started or resumed with --detach)
    etrain status [RUN] [--json]          etrain events RUN [--json]
    etrain suspend RUN                    etrain resume RUN [--workers N] [--detach | --submit DASHBOARD_URL]
    etrain resize RUN --workers N         etrain stop RUN         (these four: [--token TOKEN])
    etrain admin-token [--store URL]      (the store's admin token, kept in ~/.etrain/admin_tokens/)
    etrain quota [TEAM] [--max-workers N | --remove] [--json]   (teams' quotas on a shared cluster; setting: admin)
    etrain service {init,show} [--store URL] [--address GCS]    (a shared cluster's service store)
    etrain grant OWNER [--max-priority N] [--teams a,b] [--nonpreemptible] [--revoke] | --list   (admin)
    etrain nodes [--json] | nodes release NODE|--all | nodes limits   (the cluster's nodes, quarantine; admin)
    etrain top RUN [--once]               (live metrics: loss, throughput, communication, memory, recovery)
    etrain chaos RUN --plan chaos.toml [--reference] [--plot F.png] [--token TOKEN]   (faults, then the oracle)
    etrain plot RUN [-o run.png]          (loss, eval loss, throughput, world size; failures, resizes marked)
    etrain train CONFIG.toml              (one rank of a run under torchrun; same as python -m trainer)
    etrain plan CONFIG.toml [--workers 8..64] [--device h100|a100|cpu|custom] [--json] [--explain] [--calibrate]
    etrain data prepare CONFIG.toml [--set ...]   (tokenize a run's text into its token cache ahead of time)
    etrain ckpt {ls,inspect,verify} URL
    etrain ckpt export URL[/step] OUT [--format hf|safetensors|torch] [--dtype fp32|bf16]
    etrain generate URL --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
    etrain demo                           (a local run with a failure, a resize, a suspend and a resume)

``run`` and ``train`` also take the config as ``--config CONFIG.toml``;
``etrain --version`` prints the installed version.

``run`` starts a run on the Ray cluster at ``--address`` / ``$RAY_ADDRESS``
(under ``ray job submit`` that is the job's cluster), or on a local Ray on
127.0.0.1 when there is none, and follows it to the end. The control
commands talk only to the run store (``--store``, ``$ETRAIN_STORE``, the
store ``etrain run`` recorded for the run in the run registry
``$ETRAIN_HOME/runs`` (default ``~/.etrain/runs``, :mod:`orchestrator.store.user_runs`),
or ``file://$PWD/runs``), so they work from any machine that reaches it: they
write the desired state and the run's controller carries it out. Suspend,
resume, resize and stop need the run's token (kept in the run registry of the
user who started it, or ``--token`` / ``$ETRAIN_RUN_TOKEN``) or the store's
admin token (``$ETRAIN_ADMIN_TOKEN``): :mod:`orchestrator.service.auth`.

Exit status: 0 when the run FINISHED or was SUSPENDED, 1 when it FAILED,
2 for a mistake in the command or config (the message names the fix), 141 (quietly) when the reader of its
output went away (``etrain status | head -1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import ConfigError, EtrainError
from checkpointing.names import redact, redact_text, validate_run_id

from .control import (
    EXIT_FAILED,
    EXIT_USAGE,
    cmd_admin,
    cmd_chaos,
    cmd_data,
    cmd_events,
    cmd_logs,
    cmd_plot,
    cmd_resize,
    cmd_status,
    cmd_stop,
    cmd_suspend,
    cmd_top,
    looked_where,
    store_url,
)
from .nodes import add_nodes_parser, cmd_nodes
from .queue import cmd_queue
from .service import add_service_parsers, cmd_grant, cmd_quota, cmd_service


def _run_id(field: str):
    """An argparse ``type`` that refuses an unsafe run id (exit 2, naming ``field`` and the rule)."""
    def check(value: str) -> str:
        try:
            return validate_run_id(value, field)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return check


def _add_run(p: argparse.ArgumentParser, **kw) -> None:
    kw.setdefault("help", "run id (found through --store, $ETRAIN_STORE, the run registry ~/.etrain/runs, ./runs)")
    p.add_argument("run", type=_run_id("RUN"), metavar="RUN", **kw)


def _add_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=None, help="the run's token (default: $ETRAIN_RUN_TOKEN, else the one the run "
                                                 "registry kept for the user who started it, else the admin token "
                                                 "$ETRAIN_ADMIN_TOKEN)")


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="run store: etcd://host:port[/prefix] or the runs' storage URL "
                                                 "(default: $ETRAIN_STORE, else the run's entry in the run "
                                                 "registry ~/.etrain/runs, else file://$PWD/runs)")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="etrain", description="Fault-tolerant, elastic training on Ray.")
    ap.add_argument("--version", action="version", version=f"etrain {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="one rank of a run, under torchrun or alone: etrain train CONFIG "
                                 "(same as python -m trainer)",
                   add_help=False)
    sub.add_parser("ckpt", help="list, inspect and verify checkpoints", add_help=False)
    sub.add_parser("generate", help="sample text from a checkpoint or an export: etrain generate URL --prompt TEXT",
                   add_help=False)
    sub.add_parser("demo", help="a local run with a killed worker, a resize, a suspend and a resume",
                   add_help=False)
    sub.add_parser("plan", help="memory, communication and step time of the best layouts at every size a run can "
                                "take: etrain plan CONFIG [--workers 8..64] [--device h100]", add_help=False)

    for name, what in (("run", "start a run on Ray (a local Ray on 127.0.0.1 without a cluster) and follow it"),
                       ("submit", "submit a run to a Ray cluster as a Ray job (ray job submit with the working "
                                  "directory and the run store filled in)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("config", nargs="?", metavar="CONFIG", help="run config (TOML)")
        p.add_argument("--config", dest="config_opt", metavar="CONFIG", help="the same as CONFIG")
        p.add_argument("--workers", type=int, help="group size to run at (default [elastic].workers, 2)")
        p.add_argument("--min-workers", type=int, help="smallest size to keep training at after failures")
        p.add_argument("--max-workers", type=int, help="largest size to grow to")
        p.add_argument("--run-id", type=_run_id("--run-id"), help="name of the run (default: run_id in the config)")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
        _add_store(p)
    p.add_argument("--address", metavar="DASHBOARD_URL", help="the cluster's dashboard, http://HEAD:8265 "
                                                              "(default $RAY_ADDRESS)")
    p.add_argument("--working-dir", default=".", help="directory uploaded as the job's working directory; "
                                                      "CONFIG must be inside it (default .)")
    p = sub.choices["run"]
    # Under a job `etrain submit` started: the submitter owns the run and kept its token; the job gets its hash.
    p.add_argument("--owner", help=argparse.SUPPRESS)
    p.add_argument("--token-hash", help=argparse.SUPPRESS)
    p.add_argument("--address", help="Ray cluster address (default $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live bar")
    p.add_argument("--detach", action="store_true", help="run in the background and return once it started; "
                                                         "`etrain logs RUN -f` follows it")

    p = sub.add_parser("logs", help="the output of a run started (or resumed) with etrain run --detach "
                                    "(etrain resume --detach)")
    _add_run(p, help="run id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the run's driver ends")

    p = sub.add_parser("status", help="a run's status, or every run in the store")
    _add_run(p, nargs="?", help="run id (default: every run in the store)")
    p.add_argument("--json", action="store_true", help="the status document(s) as JSON")
    _add_store(p)

    p = sub.add_parser("queue", help="the queued and admitted runs: priority, team, owner, min..max, allocated, "
                                     "target, waiting time and why a queued run waits")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    _add_store(p)

    p = sub.add_parser("events", help="a run's failures, recoveries and resizes, with their timings")
    _add_run(p)
    p.add_argument("--json", action="store_true", help="every event as JSON, all fields")
    _add_store(p)

    for name, what in (("suspend", "stop at the next step boundary, commit a checkpoint, release every worker"),
                       ("stop", "end the run at the next step boundary after a final checkpoint")):
        p = sub.add_parser(name, help=what)
        _add_run(p)
        p.add_argument("--no-wait", action="store_true", help="return once the request is recorded")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run to get there")
        _add_token(p)
        _add_store(p)

    p = sub.add_parser("resume", help="continue a suspended or interrupted run, on any valid size")
    _add_run(p)
    p.add_argument("--workers", type=int, help="group size to continue at (default: the size it had)")
    p.add_argument("--address", help="Ray cluster address for a run in the foreground (default $RAY_ADDRESS)")
    p.add_argument("--submit", metavar="DASHBOARD_URL", help="submit it as a new Ray job to this cluster instead")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live bar")
    p.add_argument("--detach", action="store_true", help="run in the background and return once it resumed; "
                                                         "`etrain logs RUN -f` follows it")
    _add_token(p)
    _add_store(p)

    p = sub.add_parser("admin-token", help="make the run store's admin token (it may control every run there) and "
                                           "keep it in ~/.etrain/admin_tokens/; replacing one needs the current one")
    _add_store(p)

    p = sub.add_parser("top", help="a live view of a run's metrics: loss, throughput, communication, memory, "
                                   "checkpoints, recoveries")
    _add_run(p, nargs="?", help="run id (its endpoint is read from the run store)")
    p.add_argument("--url", help="the metrics endpoint itself, e.g. a torchrun job's http://HOST:PORT/metrics")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    _add_store(p)

    p = sub.add_parser("chaos", help="inject faults into a live run, then judge it against a failure-free reference")
    _add_run(p)
    p.add_argument("--plan", help="chaos plan (TOML: [chaos] and [[fault]] tables; see docs/chaos.md)")
    p.add_argument("--fault", action="append", default=[], metavar="KEY=VALUE,...",
                   help="a fault, e.g. kind=kill_worker,at_step=10 (repeatable; adds to --plan)")
    p.add_argument("--reference", nargs="?", const="", default=None, metavar="REF_RUN", type=_run_id("--reference"),
                   help="compare with a failure-free run: REF_RUN if it finished, else run one (RUN-reference)")
    p.add_argument("--plot", metavar="FILE.png", help="draw loss and world size over time, faults marked")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line too")
    p.add_argument("--address", help="the run's Ray cluster (default $RAY_ADDRESS, else the local one)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow the run at most")
    _add_token(p)  # faults into a run are a control action: its token or the admin token
    _add_store(p)

    p = sub.add_parser("data", help="prepare a run's token caches ahead of time, on one machine")
    p.add_argument("action", choices=["prepare"], help="prepare: tokenize [data] (and eval.source) into the cache")
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")

    p = sub.add_parser("resize", help="change a live run's size at its next step boundary")
    _add_run(p)
    p.add_argument("--workers", type=int, help="the new group size (a valid size for the run; beyond its "
                   "max_workers raises that): it sticks, the cluster's allocator grows the run no further")
    p.add_argument("--allow-growth", action="store_true", help="let the cluster's allocator grow the run into "
                   "idle capacity again, up to max_workers (alone, or with --workers)")
    _add_token(p)
    _add_store(p)

    add_service_parsers(sub, _add_store, _add_token)
    add_nodes_parser(sub)

    p = sub.add_parser("plot", help="draw a run, live or finished: loss, eval loss, throughput and world size over "
                                    "steps and time, every failure, recovery, resize, suspend and resume marked")
    p.add_argument("run", nargs="?", type=_run_id("RUN"), metavar="RUN",
                   help="run id (its store found as `etrain status` finds it)")
    p.add_argument("-o", "--output", metavar="FILE.png", help="where to write the picture (default RUN.png)")
    p.add_argument("--log-file", metavar="STEPS.jsonl", help="draw a torchrun run's step log (--log-file) instead")
    _add_store(p)
    return ap


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("etrain")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "plan":  # parses its own arguments before importing torch
        from trainer.plan.cli import main as plan_main

        return plan_main(argv[1:], elastic=_elastic_range)
    if argv and argv[0] == "generate":
        from trainer.generate import main as generate_main

        return generate_main(argv[1:])
    if argv and argv[0] in ("train", "ckpt"):
        if argv[0] == "train":
            from trainer.cli import main as train_main

            return train_main(argv[1:], prog="etrain train")
        if argv[1:2] == ["export"]:  # needs the model's config: lives in the trainer
            from trainer.export.convert import main as export_main

            return export_main(argv[2:])
        from checkpointing.cli import main as ckpt_main
        from checkpointing.cli import quiet_when_pipe_closes

        return quiet_when_pipe_closes(ckpt_main, argv[1:])
    args = ap.parse_args(argv)
    args.argv = argv
    if args.command in ("run", "submit"):
        if args.config and args.config_opt and args.config != args.config_opt:
            ap.error(f"two configs given: {args.config} and --config {args.config_opt}; give one")
        args.config = args.config or args.config_opt
        if not args.config:
            ap.error(f"etrain {args.command} needs a CONFIG (a TOML file), e.g. etrain {args.command} "
                     "examples/tiny.toml")
    from checkpointing.cli import quiet_when_pipe_closes

    from ..driver.progress import printable
    from ..store.run_store import UnknownRun

    try:
        return quiet_when_pipe_closes(COMMANDS[args.command], args)  # `etrain status | head -1`: no traceback
    except UnknownRun as e:
        print(printable(redact_text(f"etrain: {e}\n  {looked_where(args)}"), multiline=True), file=sys.stderr)
        return EXIT_USAGE
    except EtrainError as e:  # a URL given on the command line keeps its secrets; stored text its escapes
        print(printable(redact_text(f"etrain: {e}"), multiline=True), file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a file this user may not read or write, a disk that is full: said, not a traceback
        print(printable(redact_text(f"etrain: {e}"), multiline=True), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("etrain: interrupted; the run's controller stops with this process "
              "(`etrain resume RUN` continues it from its last checkpoint)", file=sys.stderr)
        return 130


# --- commands --------------------------------------------------------------------


def _elastic_range(raw: dict) -> tuple[int, int]:
    """[elastic] min_workers..max_workers of a run document, validated (for etrain plan)."""
    from ..config import elastic_from_raw

    e = elastic_from_raw(raw)
    return e.min_workers, e.max_workers


def cmd_run(args) -> int:
    from ..driver.run import connect, prepare_run

    if args.detach:
        return _detach(args)
    # A cluster to join is joined before the run is recorded, so its grants are checked first (a local Ray is
    # started by launch: it has no service store).
    join = (lambda: connect(args.address, 0)) if args.address or os.environ.get("RAY_ADDRESS") else None
    spec, store = prepare_run(args.config, args.set, workers=args.workers, min_workers=args.min_workers,
                              max_workers=args.max_workers, run_id=args.run_id, store=args.store,
                              token_hash=args.token_hash, owner=args.owner, join=join)
    print(f"etrain: run {spec.run_id!r} on {spec.workers} workers (min {spec.min_workers}, max {spec.max_workers});"
          f" store {redact(store.url)}", flush=True)
    return _report(_launch(spec, store, args, by="etrain run"))


def _launch(spec, store, args, by: str) -> dict:
    """``launch`` of a run just recorded (or marked to resume); a start that fails before the run's controller
    ever ran marks the run FAILED, saying so and that `etrain resume` starts it, instead of leaving it PENDING."""
    from ..driver.run import launch, mark_start_failed

    try:
        return launch(spec, store, address=args.address, progress=not args.no_progress)
    except (Exception, KeyboardInterrupt) as e:
        why = redact_text(f"{type(e).__name__}: {e}" if not isinstance(e, EtrainError) else str(e))
        try:
            marked = mark_start_failed(store, spec.run_id, (why.strip().splitlines() or ["interrupted"])[0][:300],
                                       by=by)
        except EtrainError as err:  # the store is away too: the run stays PENDING, and this says so
            print(f"etrain: run {spec.run_id!r} could not be marked as not started: {err}", file=sys.stderr)
            marked = None
        if marked is not None:
            print(f"etrain: run {spec.run_id!r} did not start, and is recorded as FAILED before its first step; "
                  f"`etrain resume {spec.run_id}` starts it once the cause below is fixed", file=sys.stderr)
        raise


def _detach(args) -> int:
    """``etrain run`` or ``etrain resume`` in the background (orchestrator.store.user_runs.start_detached), once
    the command line is valid (a run's config: exit 2 here)."""
    from trainer.config.load import config_from_dict, load_raw

    from ..store import user_runs as registry

    if args.command == "resume":
        run_id, what = args.run, "resume"
    else:
        run_id, what = args.run_id or config_from_dict(load_raw(args.config, args.set)).run_id, "run"
    argv, env, rest = [], {}, iter(args.argv)
    for a in rest:  # a --token travels in the environment: never in `ps` or the log's header
        if a == "--token":
            env["ETRAIN_RUN_TOKEN"] = next(rest, "")
        elif a.startswith("--token="):
            env["ETRAIN_RUN_TOKEN"] = a.partition("=")[2]
        elif a != "--detach":
            argv.append(a)
    pid, log, code = registry.start_detached([*argv, "--no-progress"], run_id, env=env)
    if code is not None:
        registry.print_log(run_id, out=sys.stderr)
        print(f"etrain: {what} of run {run_id!r} did not start (exit {code}); its log is {log}", file=sys.stderr)
        return code or EXIT_FAILED
    print(f"etrain: run {run_id!r} runs in the background (pid {pid}, log {log}); `etrain logs {run_id} -f` "
          f"follows it, `etrain status {run_id}` shows where it is, `etrain stop {run_id}` ends it")
    return 0


def cmd_submit(args) -> int:
    from trainer.config.load import config_from_dict, load_raw

    from ..config import elastic_from_raw
    from ..driver.job_paths import job_data_paths, job_url
    from ..driver.run import submit_job
    from ..service import auth
    from ..store import user_runs as registry
    from ..store.urls import default_root, store_url_for

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError("etrain submit needs the cluster's dashboard: --address http://HEAD:8265 or $RAY_ADDRESS")
    raw = load_raw(args.config, args.set)
    cfg = config_from_dict(raw)
    run_id = args.run_id or cfg.run_id
    config = os.path.relpath(os.path.abspath(args.config), os.path.abspath(args.working_dir))
    if config.startswith(".."):
        raise ConfigError(f"the config {args.config} is outside --working-dir {args.working_dir}, which is all the "
                          "job gets; move it there or pass a --working-dir that holds it")
    # Paths of this machine's, made what the job must be given: it runs in a temporary copy of --working-dir.
    ckpt = cfg.checkpoint.url and job_url(cfg.checkpoint.url, "checkpoint.url", address, need="a checkpoint root")
    url = job_url(store_url_for(args.store, elastic_from_raw(raw), ckpt), "the run store (--store, $ETRAIN_STORE, "
                  "[elastic] store or checkpoint.url; else ./runs)", address)
    if not ckpt:  # the job's default, ./runs, would be in its temporary directory: this directory's, if reached
        try:
            ckpt = job_url(default_root(), "checkpoint.url (unset: ./runs)", address, need="a checkpoint root")
        except ConfigError as e:
            print(f"etrain: warning: the run's checkpoints will be lost when its job ends: {e}; set "
                  "checkpoint.url (--set checkpoint.url='\"s3://bucket/runs\"')", file=sys.stderr)
    token = auth.mint()  # kept here, in this user's run registry; the job gets only its hash
    entry = ["-m", "orchestrator", "run", config, "--no-progress", "--store", url, "--run-id", run_id,
             "--owner", auth.current_user(), "--token-hash", auth.digest(token)]
    for flag, v in (("--workers", args.workers), ("--min-workers", args.min_workers),
                    ("--max-workers", args.max_workers)):
        entry += [flag, str(v)] if v is not None else []
    sets = [*args.set, *job_data_paths(cfg, args.working_dir)]
    if ckpt and ckpt != cfg.checkpoint.url:
        sets.append(f"checkpoint.url={json.dumps(ckpt)}")  # a TOML string; last, so it wins
    entry += [a for o in sets for a in ("--set", o)]
    job = submit_job(address, entry, working_dir=args.working_dir)
    registry.record(run_id, url, token=token)
    print(f"etrain: submitted run {run_id!r} as Ray job {job} to {redact(address)}; store {redact(url)}"
          f"{'' if ckpt in (url, '') else f'; checkpoints {redact(ckpt)}'}\n"
          f"  `etrain status {run_id}` shows where it is, `ray job logs {job} --address {redact(address)} -f` "
          "follows its output")
    return 0


def _report(final: dict) -> int:
    from ..driver.run import exit_code

    loss = final.get("loss")
    print(f"etrain: run {final.get('run_id')!r} {final.get('phase')} at step {final.get('step')}/"
          f"{final.get('total_steps')}: {final.get('reason', '')}; {final.get('recoveries', 0)} recoveries, "
          f"{final.get('steps_lost', 0)} steps lost, final loss "
          f"{f'{loss:.4f}' if isinstance(loss, float) else loss}", flush=True)
    return exit_code(final)


def cmd_resume(args) -> int:
    from ..driver.run import prepare_resume
    from ..store import user_runs as registry

    if args.detach and args.submit:
        raise ConfigError("--detach and --submit both given: --submit runs the resumed run as a Ray job already; "
                          "give one")
    if args.detach:
        return _detach(args)
    url = store_url(args)
    if args.submit:
        from ..driver.run import submit_job
        from ..service import auth
        from ..store import liveness
        from ..store.run_store import open_store

        store = open_store(url)
        liveness.notice(store, args.run, store.get_status(args.run), by="etrain resume")
        # Authorized here; the new job gets a one-use grant to resume it (never the run's token).
        grant = auth.mint_grant()  # one use, within its hour
        auth.change_run(store, args.run, lambda spec: store.check_resumable(args.run) or
                        {"resume_grant": auth.digest(grant)}, args.token)
        entry = ["-m", "orchestrator", "resume", args.run, "--store", url, "--no-progress"]
        if args.workers:
            entry += ["--workers", str(args.workers)]
        job = submit_job(args.submit, entry, env={"ETRAIN_RESUME_GRANT": grant})
        print(f"etrain: submitted Ray job {job} to {redact(args.submit)}; follow it with `etrain status {args.run}`")
        return 0
    spec, store = prepare_resume(args.run, url, args.workers, token=args.token,
                                 grant=os.environ.pop("ETRAIN_RESUME_GRANT", None))
    # Recorded where this user's control commands (and `etrain resume --detach`, waiting for it) find the run.
    registry.record(spec.run_id, store.url, token=registry.token_of(spec.run_id))
    print(f"etrain: resuming run {spec.run_id!r} on {spec.workers} workers; store {redact(store.url)}", flush=True)
    return _report(_launch(spec, store, args, by="etrain resume"))


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "status": cmd_status, "events": cmd_events, "admin-token": cmd_admin,
            "suspend": cmd_suspend, "stop": cmd_stop, "resize": cmd_resize, "top": cmd_top,
            "chaos": cmd_chaos, "data": cmd_data, "plot": cmd_plot, "logs": cmd_logs, "submit": cmd_submit,
            "quota": cmd_quota, "queue": cmd_queue, "service": cmd_service, "grant": cmd_grant, "nodes": cmd_nodes}


if __name__ == "__main__":
    sys.exit(main())
