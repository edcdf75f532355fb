"""``MANIFEST.json``: the commit record of one checkpoint.

A checkpoint is ``<root>/<run_id>/checkpoints/step_<NNNNNNNNN>/`` holding the
DCP shard files, the DCP metadata (``.metadata``) and ``MANIFEST.json``,
written last, by one coordinator, after every rank's files are in storage. A
step directory without a valid manifest does not exist for any reader. The
manifest lists every file with its size and crc32c, so a reader can tell a
complete checkpoint from a partial or corrupted one without trusting the
storage listing.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c as _crc32c

from .errors import CheckpointError

FORMAT = "etrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
METADATA_NAME = ".metadata"
STEP_RE = re.compile(r"^step_(\d{9})$")
# Shard files are cut at this size: each goes up as one request, many in flight,
# which on local disks and object stores alike beats one big file per rank.
FILE_SIZE = 32 << 20


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


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


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the step directory
    size: int
    crc32c: str


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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "MANIFEST.json") -> Manifest:
        """Parse and validate; any problem is a CheckpointError naming ``where``."""
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where} is not valid JSON ({e}); the checkpoint is corrupt") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not an etrain manifest")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has format version {d.get('format_version')}; this etrain reads version {FORMAT_VERSION}"
            )
        try:
            files = [FileEntry(**f) for f in d.pop("files")]
            d.pop("total_bytes", None)
            m = cls(files=files, **d)
        except (TypeError, KeyError) as e:
            raise CheckpointError(f"{where} is missing or has unknown fields ({e}); the checkpoint is corrupt") from None
        if not m.files or any(f.size < 0 for f in m.files):
            raise CheckpointError(f"{where} lists no files; the checkpoint is corrupt")
        return m

    def file_table(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}
