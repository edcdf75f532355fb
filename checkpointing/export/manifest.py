"""An export's commit, read back: the ``MANIFEST.json`` of a transformers directory written by
``etrain ckpt export`` or ``[checkpoint] export_every``, and the state of a run's export.

    doc = read_export_manifest(storage, "my-run/exports/step_000002000")  # None: not committed
    st = export_state(storage, "my-run", 2000)       # complete, incomplete, corrupt or stale, and why
    st = export_dir_state("s3://bucket/runs/my-run/exports/step_000002000", contents=True)

The manifest is written last (it is the commit). It lists every file of the directory with its
size and crc32c, the run, the step, and ``checkpoint_manifest_sha256``: the identity of the
checkpoint it was made from, the sha256 of that checkpoint's ``MANIFEST.json``
(:attr:`checkpointing.manifest.Manifest.digest`). A run's export is

- ``incomplete`` without its manifest (being written, or cut short);
- ``corrupt`` when the manifest is not one (every field is checked as data; files are bare
  names), a file it lists is missing or of another size, a file is there that it does not
  list, or (``contents=True``) a file fails its crc32c;
- ``stale`` when the step's checkpoint exists and is not the one the export was made from (the
  run's checkpoints were deleted and its run id trained again), or the export records none
  (written before etrain recorded it);
- ``complete`` otherwise: the only state in which it is used. Its checkpoint may be gone
  (exports outlive retention); it then stays complete.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import CheckpointError, ConfigError
from ..layout import CHECKPOINTS, EXPORTS, RunRoot
from ..manifest import CRC_RE, MANIFEST_NAME, Checksum, checksum, manifest_digest, parse_step_dir
from ..names import redact, validate_run_id
from ..storage.base import MiB, Storage

EXPORT_MANIFEST = "MANIFEST.json"  # written last: an export directory without it is incomplete
EXPORT_FORMAT = "etrain-export"
EXPORT_VERSION = 1
CHECKPOINT_KEY = "checkpoint_manifest_sha256"  # the identity of the checkpoint an export was made from
MAX_MANIFEST_BYTES = 16 * MiB  # far above any real one (about 100 bytes a file); never read past
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = {"format", "format_version", "created_unix", "run_id", "step", "source", "export_format", "dtype",
             "files"}
_KEYS = _REQUIRED | {CHECKPOINT_KEY}


def export_rel(run_id: str, step: int) -> str:
    """The key of one step's export under the checkpoint root, ``<run_id>/exports/step_<NNNNNNNNN>``:
    the checkpoints' zero-padded step name (:meth:`checkpointing.layout.RunRoot.export`)."""
    return RunRoot(run_id).export(step)


class _Bad(Exception):
    """One field of an export manifest is wrong; the message names it."""


def _text(doc: dict, key: str, limit: int) -> str:
    v = doc[key]
    if not isinstance(v, str) or not v or len(v) > limit:
        raise _Bad(f"{key} must be a string of 1-{limit} characters, got {type(v).__name__}")
    return v


def _check_files(files) -> None:
    if not isinstance(files, list) or not files:
        raise _Bad("files must be a non-empty list")
    seen = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or set(f) != {"path", "size", "crc32c"}:
            raise _Bad(f"files[{i}] must have exactly path, size and crc32c")
        path, size = f["path"], f["size"]
        if not isinstance(path, str) or not _FILE_NAME_RE.match(path) or path == EXPORT_MANIFEST:
            raise _Bad(f"files[{i}].path {str(path)[:80]!r} is not a bare file name of the directory")
        if path in seen:
            raise _Bad(f"files[{i}].path {path!r} is listed twice")
        seen.add(path)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise _Bad(f"files[{i}].size must be an integer >= 0, got {str(size)[:40]}")
        if not isinstance(f["crc32c"], str) or not CRC_RE.match(f["crc32c"]):
            raise _Bad(f"files[{i}].crc32c must be 8 lowercase hex digits, got {str(f['crc32c'])[:40]!r}")


def _check(doc, rel: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or doc.get("format_version") != EXPORT_VERSION \
            or isinstance(doc.get("format_version"), bool):
        raise _Bad(f"not an etrain export manifest (format {EXPORT_FORMAT!r}, version {EXPORT_VERSION})")
    missing, unknown = _REQUIRED - set(doc), set(doc) - _KEYS
    if missing or unknown:
        raise _Bad(", ".join(([f"missing {', '.join(sorted(missing))}"] if missing else [])
                             + ([f"unknown fields {', '.join(sorted(map(str, unknown)))[:80]}"] if unknown else [])))
    _check_files(doc["files"])
    parts = rel.rstrip("/").split("/")
    named = parse_step_dir(parts[-1])
    step = doc["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or named not in (None, step):
        raise _Bad(f"step must be the integer its directory names ({named}), got {str(step)[:20]}")
    try:
        validate_run_id(doc["run_id"], "run_id")
    except ConfigError:
        raise _Bad(f"run_id {str(doc['run_id'])[:40]!r} is not a run id") from None
    if named is not None and len(parts) >= 3 and parts[-2] == EXPORTS and doc["run_id"] != parts[-3]:
        raise _Bad(f"run_id is {doc['run_id']!r} but this is an export of run {parts[-3][:80]!r}")
    for key, limit in (("source", 4096), ("export_format", 32), ("dtype", 32)):
        _text(doc, key, limit)
    created = doc["created_unix"]
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise _Bad(f"created_unix must be a finite number, got {str(created)[:40]}")
    made_from = doc.get(CHECKPOINT_KEY)
    if CHECKPOINT_KEY in doc and not (isinstance(made_from, str) and _SHA256_RE.match(made_from)):
        raise _Bad(f"{CHECKPOINT_KEY} must be 64 lowercase hex digits, got {str(made_from)[:80]!r}")


def read_export_manifest(storage: Storage, rel: str, present: dict[str, int | None] | None = None) -> dict | None:
    """The manifest of the export directory ``rel`` (None when it has none: incomplete), checked as
    data; CheckpointError naming the field when it is corrupt. ``present``: the directory's listing,
    when the caller has it."""
    import json

    where = redact(storage.join(rel, EXPORT_MANIFEST))
    size = (storage.list_dir(rel) if present is None else present).get(EXPORT_MANIFEST, 0)
    if size is None:
        raise CheckpointError(f"{where} is a directory, not an export manifest")
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where} is {size} bytes, more than an export manifest is ({MAX_MANIFEST_BYTES})")
    try:
        blob = storage.get(f"{rel}/{EXPORT_MANIFEST}")
    except FileNotFoundError:
        return None
    if len(blob) > MAX_MANIFEST_BYTES:  # it grew since it was listed
        raise CheckpointError(f"{where} is more than {MAX_MANIFEST_BYTES} bytes, more than an export manifest is")
    try:
        doc = json.loads(blob)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({str(e)[:60]})") from None
    try:
        _check(doc, rel)
    except _Bad as e:
        raise CheckpointError(f"{where}: {e}") from None
    return doc


def file_problems(storage: Storage, rel: str, doc: dict, present: dict[str, int | None], *,
                  contents: bool) -> list[str]:
    """What is wrong with the files of the export ``rel`` (listing ``present``) whose manifest is ``doc``:
    one it lists that is missing or of another size, one there that it does not list, and
    (``contents``) one that fails its crc32c. Empty when the directory holds exactly what the
    manifest says."""
    listed = {f["path"]: f for f in doc["files"]}
    extra = sorted(set(present) - set(listed) - {EXPORT_MANIFEST})
    problems = [f"{name[:80]!r}: not listed in its manifest" for name in extra]
    for name, f in listed.items():
        if name not in present or present[name] is None:
            problems.append(f"{name}: missing")
        elif present[name] != f["size"]:
            problems.append(f"{name}: {present[name]} bytes, its manifest says {f['size']}")
        elif contents:
            try:
                got = _crc32c(storage, f"{rel}/{name}")
            except (FileNotFoundError, IsADirectoryError):  # removed since it was listed
                problems.append(f"{name}: missing")
                continue
            if got != f["crc32c"]:
                problems.append(f"{name}: crc32c {got}, its manifest says {f['crc32c']}")
    return problems


def _crc32c(storage: Storage, rel: str) -> str:
    """crc32c of one file of an export: streamed 16 MiB at a time from a local disk (an export's
    shards are up to 5 GB), read whole elsewhere."""
    path = storage.local_path(rel)
    if path is None:
        return checksum(storage.get(rel))
    c = Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            c.update(chunk)
    return c.hexdigest()


@dataclass(frozen=True)
class ExportState:
    """What one run export is (module doc): ``state`` with ``why`` for all but complete; ``made_from``:
    the checkpoint identity its manifest records; ``checkpoint``: that of the step's checkpoint now
    (None when it is gone)."""

    state: str  # "complete", "incomplete", "corrupt" or "stale"
    why: str = ""
    made_from: str | None = None
    checkpoint: str | None = None

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    def describe(self) -> str:
        return self.state if not self.why or self.state == "incomplete" else f"{self.state}: {self.why}"


def checkpoint_identity(storage: Storage, run_id: str, step: int) -> str | None:
    """The identity of step ``step``'s checkpoint of the run now (the sha256 of its manifest's bytes);
    None when it has none (never committed, pruned or deleted)."""
    try:
        return manifest_digest(storage.get(f"{RunRoot(run_id).step(step)}/{MANIFEST_NAME}"))
    except (FileNotFoundError, IsADirectoryError):
        return None


def export_state(storage: Storage, run_id: str, step: int, *, contents: bool = False) -> ExportState:
    """The state of the run's export of ``step`` (module doc). Reads its manifest and listing and the
    step's checkpoint manifest; with ``contents`` every file too (its crc32c)."""
    rel = export_rel(run_id, step)
    present = storage.list_dir(rel)
    try:
        doc = read_export_manifest(storage, rel, present) if EXPORT_MANIFEST in present else None
    except CheckpointError as e:
        return ExportState("corrupt", str(e))
    if doc is None:
        return ExportState("incomplete", f"no {EXPORT_MANIFEST}: being written, or cut short")
    made_from = doc.get(CHECKPOINT_KEY)
    problems = file_problems(storage, rel, doc, present, contents=contents)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return ExportState("corrupt", "; ".join(problems[:3]) + more, made_from)
    now = checkpoint_identity(storage, run_id, step)
    if now is not None and made_from != now:
        why = (f"made from checkpoint {made_from[:12]}, but step {step}'s checkpoint is now {now[:12]}"
               if made_from else f"it records no checkpoint and step {step} has checkpoint {now[:12]}")
        return ExportState("stale", why, made_from, now)
    return ExportState("complete", "", made_from, now)


def export_states(storage: Storage, run_id: str, *, contents: bool = False) -> dict[int, ExportState]:
    """{step: ExportState} of every ``exports/step_N`` directory of the run, ascending."""
    out = {}
    for name, size in storage.list_dir(RunRoot(run_id).exports).items():
        step = parse_step_dir(name)
        if size is None and step is not None:
            out[step] = export_state(storage, run_id, step, contents=contents)
    return dict(sorted(out.items()))


def list_exports(storage: Storage, run_id: str) -> dict[int, str]:
    """{step: "complete" | "incomplete" | "corrupt: <why>" | "stale: <why>"} of the run's exports. Only
    a complete one may be used."""
    return {step: st.describe() for step, st in export_states(storage, run_id).items()}


def export_complete(storage: Storage, rel: str) -> bool:
    """Whether the export directory ``rel`` is committed, its manifest sound and its files those it
    lists (sizes; not their contents): for an export that is not a run's (``etrain ckpt export``)."""
    present = storage.list_dir(rel)
    try:
        doc = read_export_manifest(storage, rel, present)
    except CheckpointError:
        return False
    return doc is not None and not file_problems(storage, rel, doc, present, contents=False)


def split_export_url(url: str) -> tuple[str, str, int] | None:
    """``<root>/<run_id>/exports/step_N`` (a URL or a local path) -> (root, run_id, step); None for
    anything else."""
    parts = url.rstrip("/").split("/")
    step = parse_step_dir(parts[-1]) if parts else None
    if step is None or len(parts) < 4 or parts[-2] != EXPORTS or not parts[-3] or parts[-3] == CHECKPOINTS:
        return None
    root = "/".join(parts[:-3]) or "/"
    return None if root.endswith((":/", ":")) else (root, parts[-3], step)


def export_dir_state(url: str, *, contents: bool = True) -> ExportState | None:
    """The state of the run export a URL or path names (:func:`split_export_url`); None when it names
    none. CheckpointError/ConfigError when its root cannot be read or its run id is unsafe."""
    split = split_export_url(url)
    if split is None:
        return None
    root, run_id, step = split
    validate_run_id(run_id, "the export's run directory")
    storage = Storage(root)
    try:
        return export_state(storage, run_id, step, contents=contents)
    finally:
        storage.close()
