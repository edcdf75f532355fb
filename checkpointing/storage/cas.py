"""Compare-and-swap of one small document on a storage URL: what the run store's storage backend writes
its spec (and an interrupted run's status) with, so that two writers never lose each other's change.

    data, version = read_versioned(storage, "r1/control/spec.json")    # (None, None) when it is absent
    ok = write_if(storage, "r1/control/spec.json", new, version)        # False: another writer got there first
    ok = write_if(storage, "r1/control/spec.json", new, None)           # create: False if it exists

How the compare and the write are made one step depends on the backend:

* **S3** (and stores that implement S3's conditional writes): the version is the object's ETag and the
  write a PutObject with ``If-Match`` (``If-None-Match: *`` to create). The server decides; atomic.
* **local files** (``file://``): the version is a sha256 of the bytes. A lock file beside the document
  (``NAME.lock``, created with ``O_EXCL``) is held while the stored version is compared and the new bytes
  are written to a temporary file and moved into place (``os.replace``), so that readers see the old or
  the new document, never half of one. Atomic between processes on one machine, or on a shared file
  system that honours ``O_EXCL``. A lock older than :data:`STALE_LOCK_S` (a writer that died holding it)
  is broken.
* **other fsspec backends** (``gs://``, ``memory://``, ...): the version is a sha256 of the bytes,
  compared just before the write. Best effort: a writer that gets in between the two is overwritten.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import time
import uuid

from checkpointing.storage.base import Storage, confine

STALE_LOCK_S = 10.0  # a local lock older than this was left by a writer that died: broken
LOCK_WAIT_S = 5.0  # how long a local writer waits for the lock before giving up (TimeoutError)


def read_versioned(storage: Storage, rel: str) -> tuple[bytes | None, str | None]:
    """The document at ``rel`` and its version, or (None, None) when there is none."""
    if storage.is_s3:
        from fsspec.asyn import sync

        return sync(storage.fs.loop, _s3_get, storage, rel)
    if storage.is_local:
        try:
            with open(_local(storage, rel), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return data, _digest(data)
    try:
        data = storage.get(rel)
    except FileNotFoundError:
        return None, None
    return data, _digest(data)


def write_if(storage: Storage, rel: str, data: bytes, version: str | None) -> bool:
    """Write ``data`` at ``rel`` only if the stored version is still ``version`` (None: only if there is
    none); False, writing nothing, if another writer changed it."""
    if storage.is_s3:
        from fsspec.asyn import sync

        return sync(storage.fs.loop, _s3_put_if, storage, rel, data, version)
    if storage.is_local:
        return _local_write_if(_local(storage, rel), data, version)
    current, now = read_versioned(storage, rel)
    if now != version or (version is None and current is not None):
        return False
    storage.put(rel, data)
    return True


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(storage: Storage, rel: str, data: bytes) -> None:
    """Write ``data`` at ``rel`` whatever is there, so that a reader sees the old or the new document, never
    half of one: on a local disk a temporary file moved into place (a plain write truncates first, and a reader
    in between saw an empty lease: its controller fenced), elsewhere one PUT (atomic on S3)."""
    if not storage.is_local:
        storage.put(rel, data)
        return
    path = _local(storage, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _replace(path, data)


def _replace(path: str, data: bytes) -> None:
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


def _local(storage: Storage, rel: str) -> str:
    return posixpath.join(storage.root, confine(rel))


def _local_write_if(path: str, data: bytes, version: str | None) -> bool:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = f"{path}.lock"
    _take(lock)
    try:
        try:
            with open(path, "rb") as f:
                now = _digest(f.read())
        except FileNotFoundError:
            now = None
        if now != version:
            return False
        _replace(path, data)
        return True
    finally:
        try:
            os.remove(lock)
        except FileNotFoundError:
            pass


def _take(lock: str) -> None:
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


def _s3_code(e: BaseException) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


async def _s3_get(storage: Storage, rel: str) -> tuple[bytes | None, str | None]:
    s3 = await storage.fs.set_session()
    bucket, key, _ = storage.fs.split_path(_local(storage, rel))
    try:
        resp = await s3.get_object(Bucket=bucket, Key=key)
    except Exception as e:
        if _s3_code(e) in ("NoSuchKey", "404", "NotFound"):
            return None, None
        raise
    body = resp["Body"]
    try:
        return await body.read(), resp["ETag"]
    finally:
        body.close()


async def _s3_put_if(storage: Storage, rel: str, data: bytes, version: str | None) -> bool:
    s3 = await storage.fs.set_session()
    bucket, key, _ = storage.fs.split_path(_local(storage, rel))
    condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
    try:
        await s3.put_object(Bucket=bucket, Key=key, Body=data, **condition)
        return True
    except Exception as e:
        # 412: the ETag moved on (or the object exists); 409: a conditional write raced ours; 404: deleted
        if _s3_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"):
            return False
        raise
