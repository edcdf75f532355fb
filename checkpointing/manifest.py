"""``MANIFEST.json``: the commit record of one checkpoint.

A checkpoint is ``<root>/<run_id>/checkpoints/step_<NNNNNNNNN>/`` holding the
DCP shard files, the DCP metadata (``.metadata``) and ``MANIFEST.json``,
written last, by one coordinator, after every rank's files are in storage. A
step directory without a valid manifest does not exist for any reader. The
manifest lists every file with its size and crc32c, so a reader can tell a
complete checkpoint from a partial or corrupted one without trusting the
storage listing.

A commit's identity is :attr:`Manifest.digest`, the sha256 of its ``MANIFEST.json`` bytes: two
commits of the same step (a run whose checkpoints were deleted and that trained again under the
same run id, an adopted checkpoint) never share it, since each manifest records its own creation
time and every file's size and crc32c. An export records the digest of the checkpoint it was
made from (:mod:`checkpointing.export.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c as _crc32c

from .errors import CheckpointError

FORMAT = "etrain-checkpoint"
FORMAT_VERSION = 3
MANIFEST_NAME = "MANIFEST.json"
METADATA_NAME = ".metadata"
STEP_RE = re.compile(r"^step_(\d{9})$")
# The only names a manifest may list: shard files and one DCP metadata file, bare
# names in the step directory (format 1 named the metadata "e<epoch>.metadata").
# Format 3 locates items as stock DCP does (checkpointing.dcp.format); 1 and 2 wrote raw bytes.
SHARD_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\.distcp$")
METADATA_RE = re.compile(r"^(?:e\d{1,12})?\.metadata$")
CRC_RE = re.compile(r"^[0-9a-f]{8}$")
READABLE_VERSIONS = (1, 2, 3)
# Shard files are cut at this size: each goes up as one request, many in flight,
# which on local disks and object stores alike beats one big file per rank.
FILE_SIZE = 32 << 20


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def manifest_digest(blob: bytes) -> str:
    """The identity of one commit: the sha256 (64 hex digits) of its ``MANIFEST.json`` bytes."""
    return hashlib.sha256(blob).hexdigest()


def checksum(data: bytes | bytearray | memoryview) -> str:
    """crc32c of ``data`` as 8 hex digits (hardware-accelerated where the CPU has it)."""
    return f"{_crc32c.crc32c(data):08x}"


class Checksum:
    """crc32c over data fed in pieces; ``hexdigest()`` equals ``checksum()`` of their concatenation."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = _crc32c.crc32c(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def is_listable_name(name: str) -> bool:
    """Whether ``name`` may appear in a manifest: a shard file or the DCP metadata, never a path."""
    return isinstance(name, str) and bool(SHARD_RE.fullmatch(name) or METADATA_RE.fullmatch(name))


@dataclass(frozen=True)
class FileEntry:
    path: str  # a bare file name in the step directory (``is_listable_name``)
    size: int
    crc32c: str


class _Bad(Exception):
    """One field of a manifest is wrong; the message names it."""


def _int(d: dict, key: str, lo: int = 0) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _Bad(f"{key} must be an integer >= {lo}, got {v!r:.60}")
    return v


def _of(d: dict, key: str, tp: type, what: str):
    v = d.get(key)
    if not isinstance(v, tp):
        raise _Bad(f"{key} must be {what}, got {type(v).__name__}")
    return v


def _files(raw) -> list[FileEntry]:
    if not isinstance(raw, list) or not raw:
        raise _Bad("files must be a non-empty list")
    out, seen = [], set()
    for i, f in enumerate(raw):
        if not isinstance(f, dict) or set(f) != {"path", "size", "crc32c"}:
            raise _Bad(f"files[{i}] must have exactly path, size and crc32c")
        if not is_listable_name(f["path"]):
            raise _Bad(f"files[{i}].path {str(f['path'])[:80]!r} is not a file name of this format "
                       "(a bare *.distcp or .metadata name)")
        if f["path"] in seen:
            raise _Bad(f"files[{i}].path {f['path']!r} is listed twice")
        size = f["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise _Bad(f"files[{i}].size must be an integer >= 0, got {size!r:.40}")
        if not isinstance(f["crc32c"], str) or not CRC_RE.match(f["crc32c"]):
            raise _Bad(f"files[{i}].crc32c must be 8 lowercase hex digits, got {f['crc32c']!r:.40}")
        seen.add(f["path"])
        out.append(FileEntry(f["path"], size, f["crc32c"]))
    if sum(1 for f in out if METADATA_RE.match(f.path)) != 1:
        raise _Bad("files must list exactly one DCP metadata file")
    return out


_FIELDS = {"run_id", "step", "epoch", "world_size", "layout", "config_hash", "trainer_state", "files",
           "created_unix", "format", "format_version", "extra", "total_bytes", "config"}


@dataclass
class Manifest:
    run_id: str
    step: int
    epoch: int  # fencing token: the controller epoch that wrote this
    world_size: int
    layout: dict[str, Any]  # pp, dp_replicate, dp_shard, tp, zero_stage, ...
    config_hash: str
    trainer_state: dict[str, Any]  # data cursor, LR-schedule position
    files: list[FileEntry]
    created_unix: float = 0.0
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # The run's resolved config (every section, model included; URLs without credentials), from
    # format 3; {} in older checkpoints and in adopted ones.
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """:func:`manifest_digest` of this manifest as stored: of the bytes :meth:`from_json` read, or of
        :meth:`to_json` (the bytes a commit writes) for one made here."""
        return getattr(self, "_stored_digest", "") or manifest_digest(self.to_json())

    @property
    def metadata_file(self) -> str:
        return next(f.path for f in self.files if METADATA_RE.match(f.path))

    def to_json(self) -> bytes:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "MANIFEST.json", *, step: int | None = None,
                  run_id: str | None = None) -> Manifest:
        """Parse and validate; any problem is a CheckpointError naming ``where`` and the field.

        ``step`` and ``run_id``: what the manifest must say (its directory's step, the run's id).
        """
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{where} is not valid JSON ({str(e)[:80]}); the checkpoint is corrupt") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not an etrain manifest; the checkpoint is corrupt")
        version = d.get("format_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise CheckpointError(f"{where} has format version {str(version)[:20]}; this etrain reads versions "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}")
        try:
            unknown = set(d) - _FIELDS
            if unknown:
                raise _Bad(f"unknown fields {', '.join(sorted(map(str, unknown)))[:80]}")
            m = cls(run_id=_of(d, "run_id", str, "a string"), step=_int(d, "step"), epoch=_int(d, "epoch"),
                    world_size=_int(d, "world_size", 1), layout=_of(d, "layout", dict, "a table"),
                    config_hash=_of(d, "config_hash", str, "a string"),
                    trainer_state=_of(d, "trainer_state", dict, "a table"), files=_files(d.get("files")),
                    created_unix=_finite(d.get("created_unix", 0.0), "created_unix"), format_version=version,
                    extra=_of(d, "extra", dict, "a table") if "extra" in d else {},
                    config=_of(d, "config", dict, "a table") if "config" in d else {})
            ts = m.trainer_state
            for key in ("step", "samples_consumed"):
                v = ts.get(key, 0)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise _Bad(f"trainer_state.{key} must be an integer >= 0, got {v!r:.40}")
            if "total_bytes" in d and d["total_bytes"] != m.total_bytes:
                raise _Bad(f"total_bytes is {str(d['total_bytes'])[:20]}, its files add up to {m.total_bytes}")
            if step is not None and m.step != step:
                raise _Bad(f"step is {m.step} but the manifest is in the directory of step {step}")
            if run_id is not None and m.run_id != run_id:
                raise _Bad(f"run_id is {m.run_id[:80]!r} but this is run {run_id!r}")
            if "step" in ts and ts["step"] != m.step:
                raise _Bad(f"trainer_state.step is {ts['step']} but step is {m.step}")
        except _Bad as e:
            raise CheckpointError(f"{where}: {e}; the checkpoint is corrupt") from None
        m._stored_digest = manifest_digest(data.encode() if isinstance(data, str) else bytes(data))
        return m

    def file_table(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}


def config_changes(saved: dict, current: dict, sections: tuple[str, ...],
                   ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """The fields of ``sections`` whose value differs between a checkpoint's recorded config and the
    current one, as (``section.field``, saved, current), in order. Fields one side lacks (added
    or removed since) are not compared."""
    out = []

    def walk(a, b, path: str) -> None:
        if path in ignore:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) & set(b)):
                walk(a[k], b[k], f"{path}.{k}" if path else k)
        elif a != b:
            out.append((path, a, b))

    for section in sections:
        if section in saved and section in current:
            walk(saved[section], current[section], section)
    return out


def _finite(v, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(f"{key} must be a finite number, got {v!r:.40}")
    return float(v)
