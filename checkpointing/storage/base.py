"""The storage seam: a few methods over any fsspec URL, with retries, time bounds and parallelism.

    storage = Storage("s3://bucket/runs")           # or file://, gs://, memory://
    storage.put_many([("a/b.bin", data), ...])      # concurrent, multipart for big objects
    crc = storage.put_parts("a/c.bin", [view, ...])  # one object from several buffers; its crc32c
    blobs = storage.get_many(["a/b.bin"])           # concurrent, ranged for big objects
    storage.list_dir("a")                           # {name: size or None for a directory}

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
other fsspec backends (not atomic there). On S3 big objects go up as multipart uploads with several parts in
flight, each part retried on its own; a failed upload is aborted so no
orphaned parts are billed. Credentials come only from the standard chains
(environment, config files, instance metadata) through fsspec and botocore;
they are never passed, logged or put into error messages here.

S3 endpoint: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (botocore's own
variables) or ``FSSPEC_S3_ENDPOINT_URL`` (fsspec's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import fsspec
from fsspec.asyn import sync as fsspec_sync

from ..errors import StorageError, UnsafePathError
from .faults import NO_FAULT, StorageFaults
from ..manifest import Checksum
from ..names import check_url, redact
from .retry import RetryPolicy, describe

log = logging.getLogger("etrain")

MiB = 1 << 20
# Local writes go out in slices of this size, each checksummed just before it is
# written, so the bytes are still in the CPU cache when the kernel copies them.
_SLICE = 4 * MiB

Buffer = bytes | bytearray | memoryview
# A local object being written, beside its final name; never listed.
PARTIAL_PREFIX = ".etrain-partial-"


class _Body:
    """The bytes of one object as buffers in order, never joined on local disks."""

    def __init__(self, data: Buffer | list[Buffer] | tuple[Buffer, ...]):
        parts = data if isinstance(data, (list, tuple)) else [data]
        self.parts = [m for m in (memoryview(p).cast("B") for p in parts) if len(m)]
        self.size = sum(len(m) for m in self.parts)

    def slices(self):
        for part in self.parts:
            for start in range(0, len(part), _SLICE):
                yield part[start : start + _SLICE]

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


def _is_not_found(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        return code in ("NoSuchKey", "404", "NotFound")
    return isinstance(exc, FileNotFoundError)


def confine(rel: str) -> str:
    """``rel`` if it is a key inside the root; UnsafePathError otherwise (never touches storage)."""
    if not isinstance(rel, str):
        raise UnsafePathError(f"storage key {rel!r} is not a string")
    bad = (rel.startswith("/") or "\\" in rel or any(ord(c) < 32 or ord(c) == 127 for c in rel)
           or any(seg in ("", ".", "..") for seg in rel.rstrip("/").split("/")))
    if bad:
        raise UnsafePathError(f"storage key {rel[:120]!r} would leave the storage root; refused")
    return rel


class Storage:
    """Byte storage under one root URL. Thread-safe; one instance per process is enough."""

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
        self.is_s3 = protocol in ("s3", "s3a")
        self.is_local = protocol in ("file", "local")
        options: dict = {}
        if self.is_s3:
            endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                        or os.environ.get("FSSPEC_S3_ENDPOINT_URL"))
            options = {
                "skip_instance_cache": True,
                # Our retry layer owns retries; one attempt per request below it.
                "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                                  "connect_timeout": 10, "read_timeout": self.retry.request_timeout_s,
                                  "max_pool_connections": max(10, 2 * self.concurrency),
                                  # Integrity is ours: a crc32c per file in the manifest. Skipping
                                  # botocore's per-request checksums saves a pass over every byte.
                                  "request_checksum_calculation": "when_required",
                                  "response_checksum_validation": "when_required"},
            }
            if endpoint:
                options["endpoint_url"] = endpoint
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except (ImportError, ValueError) as e:
            raise StorageError(f"cannot open storage {self._safe_url()}: {e}") from None
        if self.is_s3:
            self.fs.retries = 1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _safe_url(self) -> str:
        """The URL as messages show it (:func:`checkpointing.names.redact`)."""
        return redact(self.url)

    def __repr__(self) -> str:
        return f"Storage({self._safe_url()!r})"

    def join(self, *parts: str) -> str:
        """A child URL of this storage's root."""
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    def _path(self, rel: str) -> str:
        return posixpath.join(self.root, confine(rel)) if rel else self.root

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="etrain-io")
            return self._pool

    def _fault(self, op: str, rel: str):
        return self.faults.decide(op, rel) if self.faults else NO_FAULT

    def _sync_fault(self, op: str, rel: str):
        f = self._fault(op, rel)
        if f.delay_s:
            time.sleep(min(f.delay_s, self.retry.request_timeout_s))
            if f.delay_s > self.retry.request_timeout_s:
                raise TimeoutError(f"{op} {rel} exceeded its {self.retry.request_timeout_s:.0f} s bound")
        f.raise_if_error(op, rel)
        return f

    async def _async_fault(self, op: str, rel: str):
        f = self._fault(op, rel)
        if f.delay_s:
            await asyncio.sleep(f.delay_s)  # bounded by the caller's wait_for
        f.raise_if_error(op, rel)
        return f

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
        body = _Body(parts)
        if self.is_s3:
            crc = body.checksum()
            fsspec_sync(self.fs.loop, self._s3_put_many, [(rel, body)], exclusive)
            return crc
        return self._put_one_sync(rel, body, exclusive, checksum=True)

    def put_many(self, items: list[tuple[str, Buffer]], *, exclusive: bool = False) -> None:
        """Write several objects concurrently; raises StorageError naming the first that failed."""
        if not items:
            return
        items = [(rel, _Body(data)) for rel, data in items]
        if self.is_s3:
            fsspec_sync(self.fs.loop, self._s3_put_many, items, exclusive)
            return
        futures = [self._threads().submit(self._put_one_sync, rel, body, exclusive) for rel, body in items]
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # collect all, report the first
                errors.append(e)
        if errors:
            raise errors[0]

    def _put_one_sync(self, rel: str, body: _Body, exclusive: bool, checksum: bool = False) -> str | None:
        path = self._path(rel)

        def attempt():
            f = self._sync_fault("put", rel)
            keep = body.size // 2 if f.truncate else body.size  # a truncating fault stores half
            if not self.is_local:
                crc = body.checksum() if checksum else None
                if exclusive and self.fs.exists(path):
                    raise FileExistsError(rel)
                self.fs.pipe_file(path, body.read(0, keep))
                return crc
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

        return self.retry.call(attempt, what=f"writing {rel}")

    async def _s3_client(self):
        await self.fs.set_session()
        return self.fs.s3

    async def _s3_put_many(self, items, exclusive: bool) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        results = await asyncio.gather(*[self._s3_put_one(rel, data, sem, exclusive) for rel, data in items],
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _s3_put_one(self, rel: str, data: _Body, sem: asyncio.Semaphore, exclusive: bool) -> None:
        s3 = await self._s3_client()
        bucket, key, _ = self.fs.split_path(self._path(rel))
        size = data.size
        if size <= self.part_size:
            async def put():
                f = await self._async_fault("put", rel)
                body = data.read(0, size // 2 if f.truncate else size)
                extra = {"IfNoneMatch": "*"} if exclusive else {}
                try:
                    return await s3.put_object(Bucket=bucket, Key=key, Body=body, **extra)
                except Exception as e:
                    code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
                    if code in ("PreconditionFailed", "412"):
                        raise FileExistsError(rel) from None
                    raise

            async with sem:
                await self.retry.acall(put, what=f"writing {rel}")
            return
        async with sem:
            mpu = await self.retry.acall(lambda: s3.create_multipart_upload(Bucket=bucket, Key=key),
                                         what=f"starting upload of {rel}")
        upload_id = mpu["UploadId"]
        starts = list(range(0, size, self.part_size))

        async def part(i: int, start: int):
            stop = min(start + self.part_size, size)

            async def up():
                f = await self._async_fault("put", rel)
                body = data.read(start, (start + stop) // 2 if f.truncate else stop)
                return await s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=body)

            async with sem:
                out = await self.retry.acall(up, what=f"writing part {i + 1}/{len(starts)} of {rel}")
            return {"PartNumber": i + 1, "ETag": out["ETag"]}

        try:
            parts = await asyncio.gather(*[part(i, s) for i, s in enumerate(starts)])
            extra = {"IfNoneMatch": "*"} if exclusive else {}

            async def complete():
                try:
                    return await s3.complete_multipart_upload(
                        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}, **extra)
                except Exception as e:
                    if str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) in ("PreconditionFailed",
                                                                                            "412"):
                        raise FileExistsError(rel) from None
                    raise

            await self.retry.acall(complete, what=f"completing upload of {rel}")
        except BaseException:
            try:
                await asyncio.wait_for(s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id), 30)
            except Exception as e:
                log.warning("could not abort the incomplete upload of %s: %s", rel, describe(e))
            raise

    # --- reads -------------------------------------------------------------------

    def get(self, rel: str) -> bytes:
        return self.get_many([rel])[rel]

    def get_many(self, rels: Iterable[str]) -> dict[str, bytes]:
        """Read several objects concurrently. A missing one raises FileNotFoundError."""
        rels = list(dict.fromkeys(rels))
        if not rels:
            return {}
        if self.is_s3:
            return fsspec_sync(self.fs.loop, self._s3_get_many, rels)
        futures = {rel: self._threads().submit(self._get_one_sync, rel) for rel in rels}
        return {rel: f.result() for rel, f in futures.items()}

    def _get_one_sync(self, rel: str) -> bytes:
        path = self._path(rel)

        def attempt():
            self._sync_fault("get", rel)
            if self.is_local:
                with open(path, "rb") as fh:
                    return fh.read()
            return self.fs.cat_file(path)

        return self.retry.call(attempt, what=f"reading {rel}")

    async def _s3_get_many(self, rels: list[str]) -> dict[str, bytes]:
        sem = asyncio.Semaphore(self.concurrency)
        out = await asyncio.gather(*[self._s3_get_one(rel, sem) for rel in rels])
        return dict(zip(rels, out))

    async def _s3_get_one(self, rel: str, sem: asyncio.Semaphore) -> bytes:
        s3 = await self._s3_client()
        bucket, key, _ = self.fs.split_path(self._path(rel))

        async def get_range(rng: str | None) -> bytes:
            async def attempt():
                await self._async_fault("get", rel)
                try:
                    resp = await s3.get_object(Bucket=bucket, Key=key, **({"Range": rng} if rng else {}))
                except Exception as e:
                    if _is_not_found(e):
                        raise FileNotFoundError(rel) from None
                    raise
                body = resp["Body"]
                try:
                    return await body.read()
                finally:
                    body.close()

            async with sem:
                return await self.retry.acall(attempt, what=f"reading {rel}")

        async with sem:
            try:
                head = await self.retry.acall(lambda: s3.head_object(Bucket=bucket, Key=key), what=f"sizing {rel}")
            except StorageError as e:
                if e.__cause__ is not None and _is_not_found(e.__cause__):
                    raise FileNotFoundError(rel) from None
                raise
        size = head["ContentLength"]
        if size <= self.part_size:
            return await get_range(None)
        ranges = [f"bytes={s}-{min(s + self.part_size, size) - 1}" for s in range(0, size, self.part_size)]
        return b"".join(await asyncio.gather(*[get_range(r) for r in ranges]))

    # --- listing and deleting ------------------------------------------------------

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        """Children of ``rel``: name -> size in bytes, or None for a sub-directory. Missing: {}."""
        path = self._path(rel)

        def attempt():
            self._sync_fault("list", rel)
            try:
                entries = self.fs.ls(path, detail=True, refresh=True) if not self.is_local else self.fs.ls(
                    path, detail=True)
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
            self._sync_fault("delete", rel)
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self.retry.call(attempt, what=f"deleting {rel}")

    def abort_stale_uploads(self, rel: str, older_than_s: float) -> int:
        """Abort multipart uploads under ``rel`` begun more than ``older_than_s`` ago (S3 only)."""
        if not self.is_s3:
            return 0
        return fsspec_sync(self.fs.loop, self._s3_abort_stale, rel, older_than_s)

    async def _s3_abort_stale(self, rel: str, older_than_s: float) -> int:
        s3 = await self._s3_client()
        bucket, prefix, _ = self.fs.split_path(self._path(rel))
        resp = await self.retry.acall(lambda: s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix),
                                      what=f"listing uploads under {rel}")
        now, n = time.time(), 0
        for up in resp.get("Uploads", []):
            if now - up["Initiated"].timestamp() >= older_than_s:
                await self.retry.acall(lambda up=up: s3.abort_multipart_upload(
                    Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]), what=f"aborting upload of {up['Key']}")
                n += 1
        return n

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
