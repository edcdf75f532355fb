"""The ``etrain`` commands that act on a run through its run store: status, events, logs, suspend, stop,
resize, top, plot, chaos and data (``orchestrator.cli.main`` parses the command line and calls them).

    etrain status RUN [--json]     etrain events RUN [--json]     etrain logs RUN [-f]
    etrain suspend RUN             etrain stop RUN                etrain resize RUN --workers N
    etrain top RUN [--once]        etrain plot RUN [-o run.png]   etrain chaos RUN --plan P
    etrain data prepare CONFIG

They find the store the way every command does (:func:`store_url`: ``--store``, ``$ETRAIN_STORE``,
the run registry, ``file://$PWD/runs``), write desired state there and, unless ``--no-wait``, wait
for the controller to reach it. Suspend, stop, resize and chaos need the run's token
(:mod:`orchestrator.service.auth`); on a store this user may read but not write they exit 2 naming it.
Stored text is shown through :func:`orchestrator.driver.progress.printable` (no escape sequence of a
stored reason or event reaches the terminal).
"""

from __future__ import annotations

import json
import os
import sys
import time

from checkpointing.errors import EtrainError
from checkpointing.names import redact

from ..phase import TERMINAL, Phase

EXIT_FAILED, EXIT_USAGE = 1, 2


def store_url(args) -> str:
    """--store, then $ETRAIN_STORE, then the run registry's entry for the run, then ./runs
    (:func:`orchestrator.store.urls.default_root`), without the driver, the controller, torch or Ray."""
    from checkpointing.names import check_url

    from ..store.urls import default_root

    for url, source in ((args.store, "--store"), (os.environ.get("ETRAIN_STORE"), "$ETRAIN_STORE")):
        if url:
            return check_url(url, source)
    if getattr(args, "run", None):
        from ..store import user_runs as registry

        found = registry.lookup(args.run)
        if found:
            return check_url(found, f"the run registry entry {registry.runs_dir()}/{args.run}.json")
    return default_root()


def looked_where(args) -> str:
    """Where a control command looked for a run, and how to point it elsewhere (for UnknownRun)."""
    from ..store import user_runs as registry

    if args.store:
        where = "--store"
    elif os.environ.get("ETRAIN_STORE"):
        where = "$ETRAIN_STORE"
    else:
        where = (f"the run registry {registry.runs_dir()} (no entry for it) and then ./runs of this directory"
                 if getattr(args, "run", None) else "./runs of this directory")
    return (f"looked in {where}; name the run's store with --store URL or $ETRAIN_STORE "
            "(the URL `etrain run` printed, or the run's checkpoint root)")


def open_store_of(args):
    from ..store.run_store import open_store

    return open_store(store_url(args))


def cmd_logs(args) -> int:
    from ..store import user_runs as registry

    if not registry.print_log(args.run, follow=args.follow):
        print(f"etrain: no log of run {args.run!r} at {registry.log_path(args.run)}: only `etrain run --detach` "
              f"keeps one; `etrain events {args.run}` shows its events, `ray job logs JOB` a Ray job's output",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_status(args) -> int:
    """A run's status, or the runs of the store(s). A run whose documents are not etrain's is a row of its own
    (``unreadable``), its reason on stderr and exit 2; the runs beside it are shown as usual."""
    from ..driver.progress import health_status_line, listing_console, printable, status_table, tier_status_line
    from ..store import user_runs as registry

    explicit = bool(args.store or os.environ.get("ETRAIN_STORE"))
    if args.run:
        from ..store.liveness import notice

        store = open_store_of(args)
        spec = store.get_spec(args.run)  # UnknownRun names the fix
        st = notice(store, args.run, store.get_status(args.run), by="etrain status")  # its controller gone?
        rows = [{**(st or {"run_id": args.run, "phase": Phase.PENDING}), "owner": spec.owner}]
    else:  # the runs of one store (--store, $ETRAIN_STORE), else of ./runs and of the run registry
        rows = registry.statuses([store_url(args)], registered=not explicit, strict=explicit)
    if args.json:
        print(json.dumps(rows[0] if args.run else rows, indent=2, sort_keys=True))
    elif not rows:
        print(printable(f"no runs in {redact(store_url(args))}" + ("" if explicit else
                                                                    f" or in the run registry {registry.runs_dir()}")))
    else:
        listing_console().print(status_table(rows))
        if args.run and rows[0].get("reason"):
            print(f"reason: {printable(rows[0]['reason'], multiline=True)}")
        if args.run and tier_status_line(rows[0]):
            print(tier_status_line(rows[0]))
        if args.run and health_status_line(rows[0]):
            print(health_status_line(rows[0]))
        for store, reason in dict.fromkeys((r["store"], r["reason"]) for r in rows
                                           if r.get("phase") in (registry.UNREACHABLE, registry.MISSING)):
            print(printable(f"{store}: {reason}"))
    return unreadable_runs(rows)


def unreadable_runs(rows: list[dict]) -> int:
    """Each run of ``rows`` whose documents are not etrain's, with why, on stderr; EXIT_USAGE if there is one."""
    from ..driver.progress import printable
    from ..store import user_runs as registry

    bad = [r for r in rows if r.get("phase") == registry.UNREADABLE]
    for r in bad:
        print(printable(f"etrain: run {r['run_id']!r} of {r.get('store')} is unreadable: {r.get('reason')}"),
              file=sys.stderr)
    return EXIT_USAGE if bad else 0


def cmd_chaos(args) -> int:
    """``etrain chaos``: faults into a run need its token, or the store's admin token, as a resize does."""
    from ..chaos.cli import main as chaos_main
    from ..service.auth import authorize

    store = open_store_of(args)
    authorize(store, store.get_spec(args.run), args.token)  # UnknownRun names the fix; NotAuthorized says whose
    return chaos_main(args, store)


def cmd_top(args) -> int:
    from .top import main as top_main

    if not args.run and not args.url:
        print("etrain: top needs a RUN (or --url http://HOST:PORT/metrics)", file=sys.stderr)
        return EXIT_USAGE
    return top_main(args, None if args.url else open_store_of(args))


def cmd_events(args) -> int:
    from ..driver.progress import event_line, printable

    store = open_store_of(args)
    store.get_spec(args.run)
    events = store.events(args.run)
    if args.json:
        print(json.dumps(events, indent=2, sort_keys=True))
        return 0
    for e in events:
        line = printable(formed_line(e)) if e.get("kind") == "formed" else event_line(e)  # event_line: printable
        print(f"{clock_time(e.get('time'))}  {line}")
    return 0


def formed_line(e: dict) -> str:
    """A ``formed`` event as a line of ``etrain events``: the fields that matter, as words, never as Python
    literals (``--json`` has them all); node ids cut to 8 digits as ``ray status`` shows them.

        [formed] epoch 3: 4 workers at step 120, restored from memory, ep 2, memory tier 1.2 GiB per rank
        (...), members a1b2c3d4,e5f6a7b8,..., pids 811,812,..., rendezvous 10.0.0.5:29500
    """
    from ..driver.progress import from_tier, short_ids

    def listed(v) -> str:
        return ",".join(str(x) for x in v) if isinstance(v, list) else str(v)

    line = f"[formed] epoch {e.get('epoch', '?')}: {e.get('world_size', '?')} workers at step {e.get('step', '?')}"
    if e.get("tier") in ("memory", "durable"):  # "none": a run that starts from step 0
        line += f", restored{from_tier(e)}"
    if e.get("ep") is not None:
        line += f", ep {e['ep']}"
    tier = e.get("memory_tier")
    if isinstance(tier, dict):
        line += f", memory tier {tier.get('describe') or tier.get('budget')}"
    members = e.get("members") or short_ids(e.get("nodes"))
    for name, v in (("members", members), ("pids", e.get("pids")), ("rendezvous", e.get("rendezvous"))):
        if v:
            line += f", {name} {listed(v)}"
    return line


def clock_time(unix) -> str:
    """``HH:MM:SS`` of a stored time, ``--:--:--`` for one that is not a time (orchestrator.store.documents)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(unix or 0))
    except (TypeError, ValueError, OverflowError, OSError):
        return "--:--:--"


def live_status(store, run_id: str, command: str) -> dict:
    """The status of a run a control command may change; RunConflict saying why not (it ended, it is
    suspended, its controller is gone: the run is then marked INTERRUPTED, orchestrator.store.liveness)."""
    from ..store.liveness import notice
    from ..store.run_store import RunConflict

    store.get_spec(run_id)
    st = notice(store, run_id, store.get_status(run_id), by=f"etrain {command}") or {}
    phase = Phase.of(st)
    if phase == Phase.INTERRUPTED:
        raise RunConflict(f"run {run_id!r} was interrupted (its controller is gone); `etrain resume {run_id}` "
                          "continues it from its last checkpoint")
    if phase in (Phase.FINISHED, Phase.FAILED):
        raise RunConflict(f"run {run_id!r} has {phase}; nothing to change")
    if phase == Phase.SUSPENDED:
        raise RunConflict(f"run {run_id!r} is already suspended; nothing changed "
                          f"(`etrain resume {run_id} [--workers N]` continues it)")
    if not store.leader_alive(run_id):
        raise RunConflict(f"run {run_id!r} is not running (its controller is gone); "
                          f"`etrain resume {run_id}` continues it")
    return st


def wait_phase(store, run_id: str, phases: tuple[str, ...], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = store.get_status(run_id) or {}
        if st.get("phase") in phases:
            print(f"etrain: run {run_id!r} {st['phase']} at step {st.get('step')}")
            return 0 if st["phase"] not in (Phase.FAILED, Phase.INTERRUPTED) else EXIT_FAILED
        time.sleep(0.5)
    print(f"etrain: run {run_id!r} did not get there within {timeout:.0f} s; `etrain status {run_id}` shows where "
          "it is", file=sys.stderr)
    return EXIT_FAILED


def cmd_suspend(args) -> int:
    return _request(args, "suspended", "suspend", "stops")


def cmd_stop(args) -> int:
    return _request(args, "stop", "stop", "ends")


def _request(args, field: str, what: str, verb: str) -> int:
    """Set the spec's ``field`` (authorized, compare-and-swap) and, unless --no-wait, wait for a terminal phase."""
    from ..service.auth import change_run
    from ..store.documents import writing

    store = open_store_of(args)
    live_status(store, args.run, args.command)
    with writing(store):  # a store this user may only read: StoreNotWritable, naming it (exit 2)
        change_run(store, args.run, {field: True}, args.token)
    print(f"etrain: {what} of run {args.run!r} requested; it {verb} at the next step boundary")
    return 0 if args.no_wait else wait_phase(store, args.run, tuple(TERMINAL), args.timeout)


def cmd_resize(args) -> int:
    from ..service.resize import resize_run

    store = open_store_of(args)
    st = live_status(store, args.run, args.command)
    # clears the allocator's target; the size sticks unless --allow-growth
    spec = resize_run(store, args.run, args.workers, args.token, field="--workers", allow_growth=args.allow_growth)
    if args.workers is None:
        print(f"etrain: run {args.run!r} may grow into idle capacity again, up to {spec.max_workers} workers; the "
              "cluster's allocator decides when")
        return 0
    print(f"etrain: run {args.run!r} resizes {st.get('world_size')} -> {args.workers} workers at its next step "
          "boundary; `etrain events` shows when it did. " + (
              f"The cluster's allocator may grow it into idle capacity, up to {spec.max_workers}" if args.allow_growth
              else "The size sticks: the cluster's allocator grows it no further (--allow-growth gives it room "
                   f"up to max_workers, {spec.max_workers})"))
    return 0


def cmd_admin(args) -> int:
    from ..service.auth import ADMIN_TOKEN_ENV, new_admin_token

    store = open_store_of(args)
    path = new_admin_token(store)
    print(f"etrain: the admin token of {redact(store.url)} is in {path} (mode 0600); it may suspend, resume, resize "
          f"and stop every run there: give it as ${ADMIN_TOKEN_ENV} elsewhere, and keep it secret")
    return 0


def cmd_data(args) -> int:
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from trainer.config.load import load_config
    from trainer.data.corpus import prepare

    cfg = load_config(args.config, args.set)
    with Progress(TextColumn("tokenizing"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task("tokenizing", total=None)
        splits = prepare(cfg, lambda done, total: bar.update(task, completed=min(done, total), total=total))
    for s in splits:
        where = (f"cache {s['cache_state']} at {s['cache']}" if "cache" in s else
                 "no cache: token files are mapped in place" if s["kind"] == "tokens" else
                 "no cache: the default byte corpus is read into memory")
        print(f"etrain: {s['split']}: {s['tokens']:,} tokens, {s.get('documents', '?')} documents, {s['kind']}, "
              f"digest {s['digest']}; {where}", flush=True)
    return 0


def cmd_plot(args) -> int:
    from ..plot import check_output, draw, log_series, run_series

    if bool(args.run) == bool(args.log_file):
        print("etrain: plot needs a RUN or --log-file STEPS.jsonl (one of them)", file=sys.stderr)
        return EXIT_USAGE
    out = check_output(args.output or (f"{args.run}.png" if args.run else args.log_file.rsplit(".", 1)[0] + ".png"))
    if args.log_file:
        try:
            with open(args.log_file) as f:
                series = log_series([json.loads(line) for line in f if line.strip()])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EtrainError(f"--log-file {args.log_file!r} is not a readable step log: {e}") from None
        title = f"step log {args.log_file}"
    else:
        store = open_store_of(args)
        spec = store.get_spec(args.run)
        seq_len = (spec.config.get("data") or {}).get("seq_len")
        try:
            series = run_series(store.get_history(args.run), store.events(args.run),
                                seq_len=seq_len if isinstance(seq_len, int) else None)
        except ValueError as e:
            raise EtrainError(f"run {args.run!r}: {e}") from None
        title = f"run {args.run}"
    try:
        draw(out, series, title=title)
    except OSError as e:
        raise EtrainError(f"-o {out!r} cannot be written ({e.strerror or e}); give a path in a writable directory")

    marks = ", ".join(f"{n} {k}" for k in ("failure", "recovery", "resize", "suspend", "resume")
                      if (n := sum(m["kind"] == k for m in series["marks"])))
    print(f"etrain: wrote {out}: {len(series['step'])} steps" + (f"; {marks}" if marks else ""))
    return 0
