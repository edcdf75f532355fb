"""The local-disk backend (``file://`` URLs and plain paths): objects are files of this machine.

A reader sees an object whole or not at all: it is written beside its name (``.etrain-partial-*``,
never listed), made durable (``fsync``), and renamed into place, or hard-linked there for an
``exclusive`` write (a link fails if the name exists). Its checksum is taken slice by slice on the way,
while the bytes are still in the CPU cache.

Compare-and-swap of one document: the version is a sha256 of its bytes. A lock file beside the
document (``NAME.lock``, created with ``O_EXCL``) is held while the stored version is compared and the
new bytes are written to a temporary file and moved into place (``os.replace``). Atomic between
processes on one machine, or on a shared file system that honours ``O_EXCL``. A lock older than
:data:`STALE_LOCK_S` (a writer that died holding it) is broken; a live writer's lock is waited for
:data:`LOCK_WAIT_S`, then TimeoutError.
"""

from __future__ import annotations

import os
import time
import uuid

from ..manifest import Checksum
from .backend import PARTIAL_PREFIX, Backend, Body, digest

STALE_LOCK_S = 10.0  # a local lock older than this was left by a writer that died: broken
LOCK_WAIT_S = 5.0  # how long a local writer waits for the lock before giving up (TimeoutError)


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

    def ls(self, path: str) -> list[dict]:
        return self.fs.ls(path, detail=True)

    # --- compare-and-swap: a lock file beside the document --------------------------------

    def read_versioned(self, rel: str) -> tuple[bytes | None, str | None]:
        try:
            with open(self.path(rel), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return data, digest(data)

    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = f"{path}.lock"
        take_lock(lock)
        try:
            try:
                with open(path, "rb") as f:
                    now = digest(f.read())
            except FileNotFoundError:
                now = None
            if now != version:
                return False
            replace_file(path, data)
            return True
        finally:
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass

    def write(self, rel: str, data: bytes) -> None:
        # A temporary file moved into place: a plain write truncates first, and a reader in between saw an
        # empty lease (its controller fenced).
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replace_file(path, data)


def replace_file(path: str, data: bytes) -> None:
    """``data`` written to a temporary file beside ``path``, made durable, then moved into place (atomic); the
    temporary file removed if anything fails."""
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def take_lock(lock: str) -> None:
    """Create ``lock`` exclusively, waiting for its holder; TimeoutError after :data:`LOCK_WAIT_S`."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return
        except FileExistsError:
            try:
                if time.time() - os.stat(lock).st_mtime > STALE_LOCK_S:
                    os.remove(lock)  # its writer died holding it
                    continue
            except FileNotFoundError:
                continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"{lock} is held by another writer")
        time.sleep(0.005)
