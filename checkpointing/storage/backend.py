"""What differs between storage protocols, behind one interface: :class:`Backend`.

:class:`checkpointing.storage.base.Storage` is what callers use; it picks a backend by the URL's
protocol and hands it the requests whose making differs from one protocol to another:

* ``put_one`` / ``put_many``: write objects (``exclusive``: never replace one; FileExistsError);
* ``get_one`` / ``get_many``: read objects whole (a missing one: FileNotFoundError);
* ``get_bounded`` / ``get_many_bounded``: read small documents, each refused unread
  (:class:`DocumentRefused`) when it is over its cap or, on a local disk, not a regular file;
* ``ls``: list a directory's entries; ``abort_stale_uploads``: clean up after failed uploads;
* compare-and-swap of one small document: ``read_versioned`` (its bytes and a version; with a
  ``limit``, bounded as ``get_bounded`` is), ``write_if``
  (write only if the stored version is still the one read; False, writing nothing, if another writer
  got there first), ``write`` (replace it whole: a reader sees the old or the new one, never half);
* ``local_path``: the file behind a key on this machine's disks, or None where objects are not files.

The backends: :class:`checkpointing.storage.local.LocalBackend` (``file://``, plain paths),
:class:`checkpointing.storage.s3.S3Backend` (``s3://``: multipart uploads, ranged reads and S3's
conditional writes) and :class:`checkpointing.storage.generic.FsspecBackend` (any other fsspec
protocol: ``gs://``, ``memory://``, ...). Each request is retried and bounded by the storage's
:class:`RetryPolicy` and meets its injected faults (:mod:`checkpointing.storage.faults`), read from the
storage at each request (a live storage's faults may be changed). Keys reach a backend already checked
(:func:`confine`): relative, inside the root.
"""

from __future__ import annotations

import asyncio
import hashlib
import posixpath
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Protocol

import fsspec

from ..errors import StorageError, UnsafePathError
from ..manifest import Checksum
from .faults import NO_FAULT, Fault, StorageFaults
from .retry import RetryPolicy

MiB = 1 << 20
# Local writes go out in slices of this size, each checksummed just before it is
# written, so the bytes are still in the CPU cache when the kernel copies them.
SLICE = 4 * MiB

Buffer = bytes | bytearray | memoryview
# A local object being written, beside its final name; never listed.
PARTIAL_PREFIX = ".etrain-partial-"


class DocumentRefused(StorageError):
    """A bounded read refused a document unread: over its cap, or (local disks) not a regular file."""


def over_cap(rel: str, limit: int) -> DocumentRefused:
    """The refusal of ``rel`` for being bigger than ``limit`` bytes."""
    cap = f"{limit / MiB:g} MiB" if limit >= MiB else f"{limit} bytes"
    return DocumentRefused(f"{rel} is bigger than its cap of {cap}; refused unread")


class Body:
    """The bytes of one object as buffers in order, never joined on local disks."""

    def __init__(self, data: Buffer | list[Buffer] | tuple[Buffer, ...]):
        parts = data if isinstance(data, (list, tuple)) else [data]
        self.parts = [m for m in (memoryview(p).cast("B") for p in parts) if len(m)]
        self.size = sum(len(m) for m in self.parts)

    def slices(self):
        for part in self.parts:
            for start in range(0, len(part), SLICE):
                yield part[start : start + SLICE]

    def checksum(self) -> str:
        c = Checksum()
        for part in self.parts:
            c.update(part)
        return c.hexdigest()

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` as one ``bytes`` (one copy, what an HTTP body needs)."""
        out, pos = [], 0
        for part in self.parts:
            end = pos + len(part)
            if end > start and pos < stop:
                out.append(part[max(start - pos, 0) : min(stop, end) - pos])
            pos = end
            if pos >= stop:
                break
        return out[0].tobytes() if len(out) == 1 else b"".join(out)


def confine(rel: str) -> str:
    """``rel`` if it is a key inside the root; UnsafePathError otherwise (never touches storage)."""
    if not isinstance(rel, str):
        raise UnsafePathError(f"storage key {rel!r} is not a string")
    bad = (rel.startswith("/") or "\\" in rel or any(ord(c) < 32 or ord(c) == 127 for c in rel)
           or any(seg in ("", ".", "..") for seg in rel.rstrip("/").split("/")))
    if bad:
        raise UnsafePathError(f"storage key {rel[:120]!r} would leave the storage root; refused")
    return rel


def digest(data: bytes) -> str:
    """The version of a document where the store keeps none: a sha256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


class Settings(Protocol):
    """What a backend's requests obey, read at each request: the storage's own attributes."""

    retry: RetryPolicy
    concurrency: int
    part_size: int
    faults: StorageFaults | None


class Backend(ABC):
    """The requests of one storage protocol (module doc). ``url``: the root; ``io``: the storage it serves."""

    protocols: ClassVar[tuple[str, ...]] = ()  # the URL protocols this backend is chosen for

    def __init__(self, url: str, io: Settings):
        self.io = io
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.fs_options())
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def fs_options(self) -> dict:
        """Keyword arguments for fsspec's file system of this protocol."""
        return {}

    def path(self, rel: str) -> str:
        """The fsspec path of the key ``rel`` (checked with :func:`confine`; "" is the root)."""
        return posixpath.join(self.root, confine(rel)) if rel else self.root

    # --- what differs per protocol ------------------------------------------------------

    @abstractmethod
    def put_one(self, rel: str, body: Body, exclusive: bool, checksum: bool = False) -> str | None:
        """Write one object in the calling thread, retried; its crc32c (of ``body``) if ``checksum``."""

    def put_many(self, items: list[tuple[str, Body]], exclusive: bool) -> None:
        """Write several objects concurrently; raises the first failure once all have ended."""
        futures = [self.threads().submit(self.put_one, rel, body, exclusive) for rel, body in items]
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # collect all, report the first
                errors.append(e)
        if errors:
            raise errors[0]

    @abstractmethod
    def get_one(self, rel: str) -> bytes:
        """Read one object in the calling thread, retried. Missing: FileNotFoundError."""

    def get_many(self, rels: list[str]) -> dict[str, bytes]:
        """Read several objects concurrently."""
        futures = {rel: self.threads().submit(self.get_one, rel) for rel in rels}
        return {rel: f.result() for rel, f in futures.items()}

    def get_bounded(self, rel: str, limit: int) -> bytes:
        """Read one document of at most ``limit`` bytes, retried; DocumentRefused (unread, or read no further
        than ``limit + 1`` bytes) when it is bigger. Missing: FileNotFoundError."""
        path = self.path(rel)

        def attempt():
            self.fault("get", rel)
            with self.fs.open(path, "rb") as f:
                if (getattr(f, "size", None) or 0) > limit:
                    raise over_cap(rel, limit)
                data = f.read(limit + 1)
            if len(data) > limit:
                raise over_cap(rel, limit)
            return data

        return self.io.retry.call(attempt, what=f"reading {rel}")

    def get_many_bounded(self, rels: list[str], limit: int) -> dict[str, bytes]:
        """:meth:`get_bounded` of several documents, concurrently; the first failure is raised."""
        futures = {rel: self.threads().submit(self.get_bounded, rel, limit) for rel in rels}
        return {rel: f.result() for rel, f in futures.items()}

    def ls(self, path: str) -> list[dict]:
        """fsspec's entries of the directory ``path`` (FileNotFoundError when there is none), never cached."""
        return self.fs.ls(path, detail=True, refresh=True)

    def abort_stale_uploads(self, rel: str, older_than_s: float) -> int:
        """Abort the unfinished uploads under ``rel`` begun more than ``older_than_s`` ago; how many."""
        return 0

    @abstractmethod
    def read_versioned(self, rel: str, limit: int | None = None) -> tuple[bytes | None, str | None]:
        """The document at ``rel`` and its version, or (None, None) when there is none; with ``limit``,
        DocumentRefused when it is bigger than that (:meth:`get_bounded`)."""

    @abstractmethod
    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        """Write ``data`` at ``rel`` only if the stored version is still ``version`` (None: only if there is
        none); False, writing nothing, if another writer changed it."""

    def write(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` whatever is there, so that a reader sees the old or the new document."""
        self.put_many([(rel, Body(data))], exclusive=False)

    def local_path(self, rel: str) -> str | None:
        """The path on this machine of the file holding ``rel``; None where objects are not local files."""
        return None

    # --- what every backend shares ---------------------------------------------------------

    def threads(self) -> ThreadPoolExecutor:
        """The pool that blocking requests run on, ``io.concurrency`` threads, made when first needed."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io.concurrency, thread_name_prefix="etrain-io")
            return self._pool

    def fault(self, op: str, rel: str) -> Fault:
        """The injected fault of one blocking request, carried out: a delay (cut at the request's bound,
        then a TimeoutError) or an error; a truncation is left to the caller."""
        f = self._decide(op, rel)
        timeout = self.io.retry.request_timeout_s
        if f.delay_s:
            time.sleep(min(f.delay_s, timeout))
            if f.delay_s > timeout:
                raise TimeoutError(f"{op} {rel} exceeded its {timeout:.0f} s bound")
        f.raise_if_error(op, rel)
        return f

    async def afault(self, op: str, rel: str) -> Fault:
        """:meth:`fault` for a request on the event loop (its delay bounded by the caller's wait_for)."""
        f = self._decide(op, rel)
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        f.raise_if_error(op, rel)
        return f

    def _decide(self, op: str, rel: str) -> Fault:
        faults = self.io.faults
        return faults.decide(op, rel) if faults else NO_FAULT

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
