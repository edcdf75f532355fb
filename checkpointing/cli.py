"""``etrain ckpt``: list, inspect, verify and adopt checkpoints from any machine that reaches the storage.

    etrain ckpt ls s3://bucket/runs/my-run
    etrain ckpt ls s3://bucket/runs --run my-run        (the URL the config's checkpoint.url names)
    etrain ckpt inspect s3://bucket/runs/my-run/checkpoints/step_000001000
    etrain ckpt verify s3://bucket/runs/my-run [--step 1000]
    etrain ckpt verify s3://bucket/runs/my-run/exports/step_000002000     (an export_every export)
    etrain ckpt adopt s3://bucket/runs/my-run/checkpoints/step_000001000 --samples-consumed 8000
    etrain ckpt export s3://bucket/runs/my-run/checkpoints/step_000001000 ./my-run-hf --format hf

A URL names a run directory (``<root>/<run_id>``), its ``checkpoints``
directory, or one ``step_<NNNNNNNNN>`` directory; or, with ``--run RUN``, the
root the run config's ``checkpoint.url`` names. ``verify`` reads every
listed file and checks it as a load would: its size and crc32c, the DCP
metadata through the restricted unpickler and against the files, and every
item (tensors in their envelope, other items plain data); it exits 1 on any
problem, naming the file, and 0 when every checked checkpoint is sound. Given
a run's export (``<run>/exports/step_N``), ``verify`` checks its manifest,
every file's size and crc32c, and that it was made from the step's
checkpoint as it is now (not stale). ``ls`` lists the run's exports too, each
with the checkpoint it was made from (:mod:`checkpointing.export.manifest`).
``ls``, ``inspect`` and ``verify`` exit 1 alike when the URL does not exist,
holds no checkpoint or is a checkpoint root without ``--run`` (naming the
runs it holds). ``adopt`` commits a checkpoint written by stock DCP
(:mod:`checkpointing.adopt`); it exits 2 naming what is wrong when it is not
one. A URL that carries credentials is refused (exit 2); every URL a message
shows goes through :func:`checkpointing.names.redact`. ``ls`` and
``inspect`` do not import torch.

A listing cut short by its reader (``etrain ckpt ls URL | head -1``) ends
quietly with status 141, as a Unix tool killed by SIGPIPE does
(:func:`quiet_when_pipe_closes`, which the ``etrain`` command uses for all
of its commands).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

from .cli_args import ArgumentParser
from .errors import CheckpointError, ConfigError, EtrainError
from .layout import parse_url
from .manager import CheckpointManager
from .names import check_url, redact

_URL_HELP = "the run's directory <checkpoint.url>/<run_id>[/checkpoints[/step_N]], or checkpoint.url with --run RUN"


EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `ls | head -1`'s ls


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), no poll
        return False


def quiet_when_pipe_closes(fn, *args) -> int:
    """``fn(*args)``, its output flushed; when the reader of stdout has gone (``| head -1``), no
    BrokenPipeError traceback: stdout goes to /dev/null (so the interpreter's last flush cannot
    fail either) and the status is :data:`EXIT_PIPE_CLOSED`. A broken pipe elsewhere (a connection
    to a server) is raised on as any other error."""
    try:
        code = fn(*args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def cmd_ls(mgr: CheckpointManager, as_json: bool) -> int:
    rows = []
    for step in mgr.steps():
        try:
            m = mgr.read_manifest(step)
        except EtrainError as e:
            # No manifest: an uncommitted save. A manifest that fails validation: corrupt.
            corrupt = mgr.is_committed(step)
            rows.append({"step": step, "committed": False, **({"corrupt": str(e)} if corrupt else {})})
            continue
        rows.append({"step": step, "committed": True, "epoch": m.epoch, "world_size": m.world_size,
                     "layout": m.layout, "bytes": m.total_bytes, "created_unix": m.created_unix,
                     "samples_consumed": m.trainer_state.get("samples_consumed"), "manifest_sha256": m.digest,
                     # [health]: the check this step passed; the sample ranges the run skipped up to it
                     "verified": m.trainer_state.get("verified"),
                     "skipped_ranges": m.trainer_state.get("skipped_ranges") or []})
    from .export.manifest import export_states

    exports = export_states(mgr.storage, mgr.run_id)  # [checkpoint] export_every: kept when checkpoints go
    by_step = {r["step"]: r for r in rows}
    for step, st in exports.items():  # an export whose checkpoint is gone: a row of its own
        r = by_step.get(step) or {"step": step, "committed": False, "checkpoint_gone": True}
        r.update({"export": st.describe(), "export_checkpoint": st.made_from})
        if step not in by_step:
            rows.append(r)
    rows.sort(key=lambda r: r["step"])
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0 if rows else 1
    if not rows:
        print(f"no checkpoints under {redact(mgr.storage.join(mgr.prefix))}", file=sys.stderr)
        return 1
    print(f"{'step':>10}  {'state':<11} {'epoch':>5} {'world':>5}  {'layout':<28} {'size':>10}  {'verified':<8}  "
          "created")
    for r in rows:
        if r.get("checkpoint_gone"):
            continue  # in the exports' list below
        if not r["committed"]:
            print(f"{r['step']:>10}  {'corrupt' if r.get('corrupt') else 'uncommitted':<11}")
            continue
        lay = r["layout"]
        desc = f"pp{lay.get('pp')} dp{lay.get('dp_replicate')}x{lay.get('dp_shard')} tp{lay.get('tp')} z{lay.get('zero_stage')}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_unix"]))
        verified = "yes" if r.get("verified") else "no"  # a run without [health] checks (or an older one): no
        skipped = f"  skipped {_ranges(r['skipped_ranges'])}" if r.get("skipped_ranges") else ""
        print(f"{r['step']:>10}  {'committed':<11} {r['epoch']:>5} {r['world_size']:>5}  {desc:<28} "
              f"{_size(r['bytes']):>10}  {verified:<8}  {when}{skipped}")
    if exports:
        print(f"exports under {redact(mgr.storage.join(mgr.run_id))}/exports (transformers directories), each with "
              "the checkpoint (manifest sha256) it was made from:")
        for step, st in exports.items():
            print(f"{step:>10}  {_export_line(mgr, step, st)}")
    return 0


def _ranges(ranges: list) -> str:
    """Sample ranges as ``[a, b)`` text, the first few."""
    text = ", ".join(f"[{a}, {b})" for a, b in ranges[:3])
    return text + (f" and {len(ranges) - 3} more" if len(ranges) > 3 else "")


def _export_line(mgr: CheckpointManager, step: int, st) -> str:
    """One export in ``etrain ckpt ls``: its state, the checkpoint it came from, and a stale one flagged
    with the command that writes it again."""
    if st.state == "complete":
        where = "the step's checkpoint" if st.checkpoint else "its checkpoint is gone since"
        return f"complete    from checkpoint {st.made_from[:12] if st.made_from else '(not recorded)'} ({where})"
    if st.state == "stale":
        from .export.manifest import export_rel

        return (f"STALE       {st.why}; write it again: etrain ckpt export {redact(mgr.url_of(step))} "
                f"{redact(mgr.storage.join(export_rel(mgr.run_id, step)))} --overwrite")
    return st.describe()


def cmd_inspect(mgr: CheckpointManager, step: int | None, as_json: bool) -> int:
    if step is None:
        step = mgr.latest_committed()
        if step is None:
            print(f"no committed checkpoint under {redact(mgr.storage.join(mgr.prefix))}", file=sys.stderr)
            return 1
    m = mgr.read_manifest(step)
    if as_json:
        print(m.to_json().decode())
        return 0
    print(f"checkpoint  {redact(mgr.storage.join(mgr.step_rel(step)))}")
    print(f"run         {m.run_id}   step {m.step}   epoch {m.epoch}")
    print(f"saved at    world {m.world_size}, layout {json.dumps(m.layout, sort_keys=True)}")
    recorded = f", resolved config recorded ({', '.join(sorted(m.config))}; --json shows it)" if m.config else ""
    print(f"config      hash {m.config_hash or '(none: adopted)'}{recorded}")
    if m.extra.get("adopted_from"):
        print(f"adopted     from {str(m.extra['adopted_from'])[:200]}")
    print(f"data cursor {json.dumps(m.trainer_state, sort_keys=True)}")
    print(f"files       {len(m.files)}, {_size(m.total_bytes)} (crc32c each)")
    for f in m.files:
        print(f"  {f.path:<24} {_size(f.size):>10}  crc32c {f.crc32c}")
    return 0


def verify_step(mgr: CheckpointManager, step: int) -> list[str]:
    """Problems with one checkpoint, each naming the file, found as a load finds them: the manifest,
    every file's size and crc32c, the DCP metadata (restricted unpickler, item locations) and every
    item (:func:`checkpointing.dcp.reader.verify_files`). Empty when a load would accept it."""
    try:
        manifest = mgr.read_manifest(step)
    except CheckpointError as e:
        return [str(e)]
    from .dcp.reader import EtrainReader, verify_files

    return verify_files(EtrainReader(mgr.storage, mgr.step_rel(step), manifest.file_table()))


def cmd_verify(mgr: CheckpointManager, step: int | None) -> int:
    steps = [step] if step is not None else mgr.committed_steps()
    if not steps:
        print(f"no committed checkpoint under {redact(mgr.storage.join(mgr.prefix))}", file=sys.stderr)
        return 1
    bad = 0
    for s in steps:
        problems = verify_step(mgr, s)
        if problems:
            bad += 1
            for p in problems:
                print(f"FAIL {p}")
        else:
            print(f"ok   {mgr.step_rel(s)}")
    return 1 if bad else 0


def cmd_verify_export(url: str) -> int:
    """``etrain ckpt verify <root>/<run>/exports/step_N``: the export's manifest, every file's size and
    crc32c, and its checkpoint (:func:`checkpointing.export.manifest.export_state`)."""
    from .export.manifest import export_dir_state

    st = export_dir_state(url, contents=True)
    shown = redact(url.rstrip("/"))
    if st.complete:
        origin = f"checkpoint {st.made_from[:12]}" if st.made_from else "a checkpoint it does not record"
        print(f"ok   {shown} (made from {origin}{'' if st.checkpoint else ', which is gone since'})")
        return 0
    print(f"FAIL {shown}: {st.describe()}")
    return 1


def _refuse_a_root(storage, rel: str, args: argparse.Namespace) -> None:
    """EtrainError when the URL (``rel`` in ``storage``) holds no checkpoints: it does not exist, or it
    is a checkpoint root (``checkpoint.url``) whose runs are named (``--run RUN`` picks one)."""
    children = storage.list_dir(rel)
    if not children:
        raise EtrainError(f"nothing at {redact(args.url)}; give the run's directory <checkpoint.url>/<run_id>, or "
                          "checkpoint.url with --run RUN")
    runs = sorted(n for n, size in children.items() if size is None and "checkpoints" in storage.list_dir(
        f"{rel}/{n}".lstrip("/")))
    if runs:
        shown = redact(args.url)
        raise EtrainError(f"{shown} is a checkpoint root holding the runs {', '.join(runs)}; name one: "
                          f"etrain ckpt {args.cmd} {shown} --run {runs[0]}")


def cmd_adopt(args: argparse.Namespace) -> int:
    """Exit 0 once committed; 2 when refused (not an adoptable DCP checkpoint, a bad flag, a live
    writer); 1 when storage failed."""
    from .adopt import AdoptRefused, adopt
    from .lock import WriterLockHeld

    try:
        adopt(args.url, samples_consumed=args.samples_consumed, into=args.into, step=args.step)
        return 0
    except (AdoptRefused, WriterLockHeld, ConfigError) as e:
        print(f"etrain ckpt adopt: {e}", file=sys.stderr)
        return 2
    except EtrainError as e:
        print(f"etrain ckpt adopt: {e}", file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="etrain ckpt", description="List, inspect, verify and adopt checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ls", help="every checkpoint of a run, committed or not")
    p.add_argument("url", help=_URL_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("inspect", help="one checkpoint's manifest (the newest if no step is named)")
    p.add_argument("url", help=_URL_HELP)
    p.add_argument("--step", type=int, help="the step to show (default: the newest committed)")
    p.add_argument("--json", action="store_true", help="the manifest as JSON")
    p = sub.add_parser("verify", help="check every file's size and checksum")
    p.add_argument("url", help=_URL_HELP)
    p.add_argument("--step", type=int, help="the step to check (default: every committed one)")
    p = sub.add_parser("adopt", help="commit a checkpoint written by stock DCP (FileSystemWriter, FsspecWriter)")
    p.add_argument("url", help="the DCP checkpoint directory: <root>/<run_id>/checkpoints/step_<N>, or any with --into")
    p.add_argument("--samples-consumed", type=int, required=True, metavar="N",
                   help="the data cursor: samples the run has trained on (step x train.global_batch)")
    p.add_argument("--into", metavar="RUN_URL", help="copy it into this run (<root>/<run_id>) first")
    p.add_argument("--step", type=int, help="the step it is of (with --into)")
    for name in ("ls", "inspect", "verify"):
        p = sub.choices[name]
        p.add_argument("--run", metavar="RUN", help="the run under URL, when URL is the checkpoint root "
                                                    "(checkpoint.url of the run's config)")
    sub.add_parser("export", help="the model as a transformers directory, safetensors or torch file "
                                  "(etrain ckpt export --help; needs the trainer)", add_help=False)
    args = ap.parse_args(argv)
    if args.cmd == "export":
        print("etrain ckpt export: run it as `etrain ckpt export URL OUT` (it needs the trainer's model config)",
              file=sys.stderr)
        return 2
    if args.cmd == "adopt":
        return cmd_adopt(args)
    try:
        check_url(args.url, "URL")
    except ConfigError as e:
        print(f"etrain ckpt {args.cmd}: {e}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "verify" and not args.run:
            from .export.manifest import split_export_url

            if split_export_url(args.url) is not None:
                return cmd_verify_export(args.url)
        try:
            root, run_id, step = (args.url.rstrip("/"), args.run, None) if args.run else parse_url(args.url)
        except EtrainError:  # "runs", "s3://bucket": no run in it, but perhaps a checkpoint root
            from .storage.base import Storage

            _refuse_a_root(Storage(args.url), "", args)
            raise
        step = args.step if getattr(args, "step", None) is not None else step
        mgr = CheckpointManager(root, run_id)
        if not args.run and not mgr.steps():
            _refuse_a_root(mgr.storage, mgr.run_id, args)
        if args.cmd == "ls":
            return cmd_ls(mgr, args.json)
        if args.cmd == "inspect":
            return cmd_inspect(mgr, step, args.json)
        return cmd_verify(mgr, step)
    except EtrainError as e:
        print(f"etrain ckpt: {e}", file=sys.stderr)
        return 1
