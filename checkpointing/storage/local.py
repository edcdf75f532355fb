"""The local-disk backend (``file://`` URLs and plain paths): objects are files of this machine.

A reader sees an object whole or not at all: it is written beside its name (``.etrain-partial-*``,
never listed), made durable (``fsync``), and renamed into place, or hard-linked there for an
``exclusive`` write (a link fails if the name exists). Its checksum is taken slice by slice on the way,
while the bytes are still in the CPU cache.

A bounded read (:meth:`LocalBackend.get_bounded`, what the run store reads its documents with) opens
the file without following a link or waiting on it (``O_NOFOLLOW | O_NONBLOCK``), refuses anything
but a regular file, and refuses a file over its cap before reading it (:class:`DocumentRefused`).
Checkpoint shards are read whole, without a cap (:meth:`LocalBackend.get_one`).

Compare-and-swap of one document: the version is a sha256 of its bytes. A lock beside the document
(``NAME.lock``, :mod:`checkpointing.storage.doc_lock`: a kernel record lock, dropped when its holder
dies) is held while the stored version is compared and the new bytes are written to a temporary file,
made durable and moved into place (``os.replace``). A holder keeps the lock for as long as it lives, so
no update is ever lost to a slow or stopped writer; another writer waits for it :data:`LOCK_WAIT_S`,
then :class:`~checkpointing.storage.doc_lock.LockHeld` (a TimeoutError) names the lock.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import uuid

from ..manifest import Checksum
from .backend import PARTIAL_PREFIX, Backend, Body, DocumentRefused, digest, over_cap
from .doc_lock import DocLock

LOCK_WAIT_S = 5.0  # how long a local writer waits for another's lock before giving up (LockHeld)
_CHUNK = 1 << 20


class LocalBackend(Backend):
    protocols = ("file", "local")

    def local_path(self, rel: str) -> str:
        return self.path(rel)

    def put_one(self, rel: str, body: Body, exclusive: bool, checksum: bool = False) -> str | None:
        path = self.path(rel)

        def attempt():
            f = self.fault("put", rel)
            keep = body.size // 2 if f.truncate else body.size  # a truncating fault stores half
            c = Checksum() if checksum else None
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if exclusive and os.path.lexists(path):
                raise FileExistsError(rel)
            # Written beside its name and moved into place, so that a reader never sees
            # it half written (a lock generation rewritten while another process reads it).
            head, name = os.path.split(path)
            tmp = os.path.join(head, f"{PARTIAL_PREFIX}{name}.{uuid.uuid4().hex[:8]}")
            try:
                with open(tmp, "xb") as fh:
                    for piece in body.slices():
                        if c is not None:
                            c.update(piece)
                        if keep > 0:
                            fh.write(piece[:keep])
                            keep -= min(keep, len(piece))
                    # On a local disk "written" must mean durable before a
                    # manifest can claim it (a PUT that returned already is).
                    fh.flush()
                    os.fsync(fh.fileno())
                if exclusive:
                    os.link(tmp, path)  # FileExistsError if another writer got there first
                else:
                    os.replace(tmp, path)
            finally:
                # A partial file (ENOSPC, an I/O error) goes, so it does not fill the disk;
                # after a link the name holds the bytes and the second name goes too.
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            return c.hexdigest() if c is not None else None

        return self.io.retry.call(attempt, what=f"writing {rel}")

    def get_one(self, rel: str) -> bytes:
        path = self.path(rel)

        def attempt():
            self.fault("get", rel)
            with open(path, "rb") as fh:
                return fh.read()

        return self.io.retry.call(attempt, what=f"reading {rel}")

    def get_bounded(self, rel: str, limit: int) -> bytes:
        path = self.path(rel)

        def attempt():
            self.fault("get", rel)
            return read_regular(path, rel, limit)

        return self.io.retry.call(attempt, what=f"reading {rel}")

    def ls(self, path: str) -> list[dict]:
        return self.fs.ls(path, detail=True)

    # --- compare-and-swap: a lock beside the document ---------------------------------------

    def read_versioned(self, rel: str, limit: int | None = None) -> tuple[bytes | None, str | None]:
        try:
            data = read_regular(self.path(rel), rel, limit)
        except FileNotFoundError:
            return None, None
        return data, digest(data)

    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with DocLock(f"{path}.lock", LOCK_WAIT_S) as held:
            if version_of(path, rel) != version:
                return False
            self.fault("cas", rel)  # a writer slow between its compare and its write (tests, chaos)
            replace_file(path, data, before_replace=held.check)
            return True

    def write(self, rel: str, data: bytes) -> None:
        # A temporary file moved into place: a plain write truncates first, and a reader in between saw an
        # empty lease (its controller fenced).
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replace_file(path, data)


def open_regular(path: str, rel: str) -> int:
    """A read-only descriptor of the regular file ``path``, opened without following a link or blocking on
    a FIFO; DocumentRefused naming ``rel`` for anything else, FileNotFoundError when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise DocumentRefused(f"{rel} is a symbolic link, not a regular file; refused unread") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise DocumentRefused(f"{rel} is {kind}, not a regular file; refused unread")
    return fd


def read_regular(path: str, rel: str, limit: int | None) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``limit`` of them: a file
    larger than that is refused (DocumentRefused naming ``rel`` and the cap) before any is read."""
    fd = open_regular(path, rel)
    try:
        if limit is not None and os.fstat(fd).st_size > limit:
            raise over_cap(rel, limit)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)  # a file growing meanwhile: still bounded
        if limit is not None and len(data) > limit:
            raise over_cap(rel, limit)
        return data
    finally:
        os.close(fd)


def version_of(path: str, rel: str) -> str | None:
    """The version (:func:`~checkpointing.storage.backend.digest`) of the document at ``path``, streamed
    (no size is too big to compare); None when there is none."""
    try:
        fd = open_regular(path, rel)
    except FileNotFoundError:
        return None
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while piece := f.read(_CHUNK):
            h.update(piece)
    return h.hexdigest()


def replace_file(path: str, data: bytes, before_replace=None) -> None:
    """``data`` written to a temporary file beside ``path`` (made exclusively, never through a link), made
    durable, then moved into place (atomic); ``before_replace()`` is called just before the move (a lock's
    check). The temporary file is removed if anything fails."""
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
