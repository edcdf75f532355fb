"""The storage seam: a few methods over any fsspec URL, with retries, time bounds and parallelism.

    storage = Storage("s3://bucket/runs")           # or file://, gs://, memory://
    storage.put_many([("a/b.bin", data), ...])      # concurrent, multipart for big objects
    crc = storage.put_parts("a/c.bin", [view, ...])  # one object from several buffers; its crc32c
    blobs = storage.get_many(["a/b.bin"])           # concurrent, ranged for big objects
    doc = storage.get_bounded("r1/control/status.json", 1 << 20)  # DocumentRefused when over 1 MiB
    docs = storage.get_last_bounded("r1/control/events", ".json", count=1000, limit=1 << 20, total=64 << 20)
    storage.list_dir("a")                           # {name: size or None for a directory}
    data, version = storage.read_versioned("r1/control/spec.json", limit=16 << 20)  # (None, None): absent
    ok = storage.write_if("r1/control/spec.json", new, version)     # False: another writer got there first
    path = storage.local_path("a/b.bin")            # a file on this machine, or None (not a local disk)

Paths are ``str`` relative to the root URL, never ``Path`` (which mangles
``s3://``), and confined to it: a key with a ``..`` or ``.`` segment, an
absolute path, a backslash or a control character is refused
(:class:`UnsafePathError`) before any request. A reader sees an object whole or
not at all, as S3 gives it: on a local disk it is written beside its name
(``.etrain-partial-*``, never listed) and renamed into place, or linked there
for an ``exclusive`` write. Objects are otherwise never renamed (object stores
copy and delete), so a reader must never trust an object that a manifest does
not list. ``exclusive`` writes never replace an object: a hard link (which
fails if the name exists) on local disks, a conditional put (``If-None-Match:
*``, on single and multipart uploads) on S3, and a check before the write on
other fsspec backends (not atomic there).

Compare-and-swap of one small document (what the run store's storage backend
writes its spec and an interrupted run's status with, so that two writers never
lose each other's change): :meth:`Storage.read_versioned`, :meth:`Storage.write_if`
and :meth:`Storage.write`. Atomic on S3 (``If-Match`` on the ETag) and on a local
disk (a lock beside the document that its holder keeps while it lives,
:mod:`checkpointing.storage.doc_lock`); best effort elsewhere.

Reads of documents whose writer may not be trusted (the run store's) are bounded:
:meth:`Storage.get_bounded`, :meth:`Storage.get_many_bounded` and ``read_versioned(rel, limit=...)``
refuse a document over the caller's cap unread (:class:`~checkpointing.storage.backend.DocumentRefused`,
naming it and the cap), and on a local disk anything that is not a regular file (a symbolic link, a
FIFO, a device) without opening it for reading or waiting on it. Checkpoint shards, which may be
gigabytes, are read with :meth:`Storage.get` and :meth:`Storage.get_many`, without a cap.

What differs by protocol is a backend's (:mod:`checkpointing.storage.backend`, the
interface; :mod:`~checkpointing.storage.local`, :mod:`~checkpointing.storage.s3`,
:mod:`~checkpointing.storage.generic`), chosen by the URL's protocol (:data:`BACKENDS`).
Credentials come only from the standard chains (environment, config files,
instance metadata) through fsspec and botocore; they are never passed, logged or
put into error messages here.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from ..errors import StorageError
from ..names import check_url, redact
from .backend import PARTIAL_PREFIX, Backend, Body, Buffer, DocumentRefused, MiB, confine
from .doc_lock import LockHeld
from .faults import StorageFaults
from .generic import FsspecBackend
from .local import LocalBackend
from .retry import RetryPolicy
from .s3 import S3Backend

__all__ = ["BACKENDS", "DocumentRefused", "LockHeld", "Storage"]  # the errors of bounded reads and of local CAS

# The backend of each URL protocol; any other protocol is fsspec's (FsspecBackend).
BACKENDS: dict[str, type[Backend]] = {p: cls for cls in (LocalBackend, S3Backend) for p in cls.protocols}


class Storage:
    """Byte storage under one root URL. Thread-safe; one instance per process is enough.

    ``backend``: the requests of the URL's protocol (:mod:`checkpointing.storage.backend`); ``fs`` and
    ``root``: its fsspec file system and the root's path in it. ``retry``, ``concurrency``, ``part_size``
    and ``faults`` are read at each request (``faults`` may be changed on a live storage)."""

    def __init__(self, url: str, *, retry: RetryPolicy | None = None, concurrency: int = 8,
                 part_size: int = 32 * MiB, faults: StorageFaults | None = None):
        if not url:
            raise StorageError("the storage URL is empty")
        check_url(url, "URL")  # a secret in it would be repeated by every message that names the storage
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.concurrency = max(1, concurrency)
        self.part_size = max(5 * MiB, part_size)
        self.faults = faults
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            self.backend: Backend = BACKENDS.get(protocol, FsspecBackend)(self.url, self)
        except (ImportError, ValueError) as e:
            raise StorageError(f"cannot open storage {self._safe_url()}: {e}") from None
        self.is_s3 = isinstance(self.backend, S3Backend)
        self.is_local = isinstance(self.backend, LocalBackend)
        self.fs, self.root = self.backend.fs, self.backend.root

    def _safe_url(self) -> str:
        """The URL as messages show it (:func:`checkpointing.names.redact`)."""
        return redact(self.url)

    def __repr__(self) -> str:
        return f"Storage({self._safe_url()!r})"

    def join(self, *parts: str) -> str:
        """A child URL of this storage's root."""
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    def _path(self, rel: str) -> str:
        return self.backend.path(rel)

    def local_path(self, rel: str) -> str | None:
        """The path on this machine's disks of the file holding ``rel`` ("" the root) on a local-disk storage
        (``file://``, plain paths), for reading it in place; None for any other storage."""
        return self.backend.local_path(rel)

    # --- writes ----------------------------------------------------------------

    def put(self, rel: str, data: Buffer, *, exclusive: bool = False) -> None:
        """Write one object. ``exclusive``: fail with FileExistsError if it exists."""
        self.put_many([(rel, data)], exclusive=exclusive)

    def put_parts(self, rel: str, parts: list[Buffer], *, exclusive: bool = False) -> str:
        """Write one object made of ``parts`` (buffers, in order) and return its crc32c.

        On a local disk the parts are written one after the other, never
        joined, and checksummed slice by slice on the way; elsewhere the
        checksum is one pass before the upload. Either way the checksum is of
        the bytes given, not of what storage says it stored. Runs in the
        calling thread (call it from several threads for parallelism).
        """
        return self.backend.put_one(rel, Body(parts), exclusive, checksum=True)

    def put_many(self, items: list[tuple[str, Buffer]], *, exclusive: bool = False) -> None:
        """Write several objects concurrently; raises StorageError naming the first that failed."""
        if items:
            self.backend.put_many([(rel, Body(data)) for rel, data in items], exclusive)

    # --- reads -------------------------------------------------------------------

    def get(self, rel: str) -> bytes:
        return self.get_many([rel])[rel]

    def get_many(self, rels: Iterable[str]) -> dict[str, bytes]:
        """Read several objects concurrently. A missing one raises FileNotFoundError."""
        rels = list(dict.fromkeys(rels))
        return self.backend.get_many(rels) if rels else {}

    def get_bounded(self, rel: str, limit: int) -> bytes:
        """Read one document of at most ``limit`` bytes; DocumentRefused, naming it and the cap, when it is
        bigger or (on a local disk) not a regular file, without reading it. A missing one: FileNotFoundError."""
        return self.backend.get_bounded(confine(rel), limit)

    def get_many_bounded(self, rels: Iterable[str], limit: int) -> dict[str, bytes]:
        """:meth:`get_bounded` of several documents, each of at most ``limit`` bytes, concurrently."""
        rels = [confine(r) for r in dict.fromkeys(rels)]
        return self.backend.get_many_bounded(rels, limit) if rels else {}

    def get_last_bounded(self, rel: str, suffix: str, *, count: int, limit: int, total: int) -> dict[str, bytes]:
        """The last ``count`` files of the directory ``rel`` by name, of those whose names end with ``suffix``
        (``rel/name`` -> bytes, in name order): each read with :meth:`get_bounded` (``limit``), and only as
        many of the last as their listed sizes (each counted at most ``limit``) keep within ``total`` bytes."""
        listed = sorted((n, size) for n, size in self.list_dir(rel).items() if n.endswith(suffix) and size is not None)
        kept, used = [], 0
        for name, size in reversed(listed):
            used += min(size, limit)
            if len(kept) == count or used > total:
                break
            kept.append(f"{rel}/{name}")
        return self.get_many_bounded(reversed(kept), limit)

    # --- compare-and-swap of one document -----------------------------------------

    def read_versioned(self, rel: str, *, limit: int | None = None) -> tuple[bytes | None, str | None]:
        """The document at ``rel`` and its version (S3: its ETag; elsewhere a sha256 of its bytes), or
        (None, None) when there is none. ``limit``: bounded as :meth:`get_bounded` is."""
        return self.backend.read_versioned(confine(rel), limit)

    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        """Write ``data`` at ``rel`` only if the stored version is still ``version`` (None: only if there is
        none); False, writing nothing, if another writer changed it. A local writer waits for another's lock
        a few seconds, then LockHeld, a TimeoutError naming the lock (:mod:`checkpointing.storage.local`)."""
        return self.backend.write_if(confine(rel), data, version)

    def write(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` whatever is there, so that a reader sees the old or the new document, never
        half of one: on a local disk a temporary file moved into place, elsewhere one PUT (atomic on S3)."""
        self.backend.write(confine(rel), data)

    # --- listing and deleting ------------------------------------------------------

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        """Children of ``rel``: name -> size in bytes, or None for a sub-directory. Missing: {}."""
        path = self._path(rel)

        def attempt():
            self.backend.fault("list", rel)
            try:
                entries = self.backend.ls(path)
            except FileNotFoundError:
                return {}
            out = {}
            for e in entries:
                name = posixpath.basename(e["name"].rstrip("/"))
                if not name or e["name"].rstrip("/") == path.rstrip("/") or name.startswith(PARTIAL_PREFIX):
                    continue
                out[name] = None if e["type"] == "directory" else int(e.get("size") or 0)
            return out

        return self.retry.call(attempt, what=f"listing {rel or self._safe_url()}")

    def exists(self, rel: str) -> bool:
        parent, name = posixpath.split(rel)
        return name in self.list_dir(parent)

    def delete_tree(self, rel: str) -> None:
        """Remove ``rel`` and everything under it (missing is fine)."""
        path = self._path(rel)

        def attempt():
            self.backend.fault("delete", rel)
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self.retry.call(attempt, what=f"deleting {rel}")

    def abort_stale_uploads(self, rel: str, older_than_s: float) -> int:
        """Abort multipart uploads under ``rel`` begun more than ``older_than_s`` ago (S3 only)."""
        return self.backend.abort_stale_uploads(rel, older_than_s)

    def close(self) -> None:
        self.backend.close()
