"""The S3 backend (``s3://``, ``s3a://``): requests on fsspec's event loop, through aiobotocore.

Big objects go up as multipart uploads with several parts in flight, each part retried on its own; a
failed upload is aborted so no orphaned parts are billed. Big objects are read back as concurrent
ranged GETs. Conditional writes are the server's: ``If-None-Match: *`` for an exclusive create (on
single and multipart uploads), ``If-Match`` on the ETag for compare-and-swap (the version is the
ETag), so both are atomic. Our retry layer owns retries: botocore makes one attempt per request.

Endpoint: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (botocore's own variables) or
``FSSPEC_S3_ENDPOINT_URL`` (fsspec's). Credentials come only from the standard chains (environment,
config files, instance metadata); they are never passed, logged or put into error messages here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from fsspec.asyn import sync as fsspec_sync

from ..errors import StorageError
from .backend import Backend, Body, Settings, over_cap
from .retry import describe

log = logging.getLogger("etrain")

_NOT_FOUND = ("NoSuchKey", "404", "NotFound")
_PRECONDITION_FAILED = ("PreconditionFailed", "412")


def _code(exc: BaseException) -> str:
    """The S3 error code of a botocore error ("" for any other)."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _is_not_found(exc: BaseException) -> bool:
    if isinstance(getattr(exc, "response", None), dict):
        return _code(exc) in _NOT_FOUND
    return isinstance(exc, FileNotFoundError)


class S3Backend(Backend):
    protocols = ("s3", "s3a")

    def __init__(self, url: str, io: Settings):
        super().__init__(url, io)
        self.fs.retries = 1

    def fs_options(self) -> dict:
        endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                    or os.environ.get("FSSPEC_S3_ENDPOINT_URL"))
        options = {
            "skip_instance_cache": True,
            # Our retry layer owns retries; one attempt per request below it.
            "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                              "connect_timeout": 10, "read_timeout": self.io.retry.request_timeout_s,
                              "max_pool_connections": max(10, 2 * self.io.concurrency),
                              # Integrity is ours: a crc32c per file in the manifest. Skipping
                              # botocore's per-request checksums saves a pass over every byte.
                              "request_checksum_calculation": "when_required",
                              "response_checksum_validation": "when_required"},
        }
        if endpoint:
            options["endpoint_url"] = endpoint
        return options

    def _run(self, coro_fn, *args):
        """Run ``coro_fn(*args)`` on fsspec's event loop and wait for it."""
        return fsspec_sync(self.fs.loop, coro_fn, *args)

    async def _client(self):
        await self.fs.set_session()
        return self.fs.s3

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    # --- writes ------------------------------------------------------------------------------

    def put_one(self, rel: str, body: Body, exclusive: bool, checksum: bool = False) -> str | None:
        crc = body.checksum() if checksum else None  # one pass before the upload
        self._run(self._put_many, [(rel, body)], exclusive)
        return crc

    def put_many(self, items: list[tuple[str, Body]], exclusive: bool) -> None:
        self._run(self._put_many, items, exclusive)

    async def _put_many(self, items, exclusive: bool) -> None:
        sem = asyncio.Semaphore(self.io.concurrency)
        results = await asyncio.gather(*[self._put(rel, data, sem, exclusive) for rel, data in items],
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _put(self, rel: str, data: Body, sem: asyncio.Semaphore, exclusive: bool) -> None:
        s3 = await self._client()
        bucket, key = self._bucket_key(rel)
        size, part_size, retry = data.size, self.io.part_size, self.io.retry
        if size <= part_size:
            async def put():
                f = await self.afault("put", rel)
                body = data.read(0, size // 2 if f.truncate else size)
                extra = {"IfNoneMatch": "*"} if exclusive else {}
                try:
                    return await s3.put_object(Bucket=bucket, Key=key, Body=body, **extra)
                except Exception as e:
                    if _code(e) in _PRECONDITION_FAILED:
                        raise FileExistsError(rel) from None
                    raise

            async with sem:
                await retry.acall(put, what=f"writing {rel}")
            return
        async with sem:
            mpu = await retry.acall(lambda: s3.create_multipart_upload(Bucket=bucket, Key=key),
                                    what=f"starting upload of {rel}")
        upload_id = mpu["UploadId"]
        starts = list(range(0, size, part_size))

        async def part(i: int, start: int):
            stop = min(start + part_size, size)

            async def up():
                f = await self.afault("put", rel)
                body = data.read(start, (start + stop) // 2 if f.truncate else stop)
                return await s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=body)

            async with sem:
                out = await retry.acall(up, what=f"writing part {i + 1}/{len(starts)} of {rel}")
            return {"PartNumber": i + 1, "ETag": out["ETag"]}

        try:
            parts = await asyncio.gather(*[part(i, s) for i, s in enumerate(starts)])
            extra = {"IfNoneMatch": "*"} if exclusive else {}

            async def complete():
                try:
                    return await s3.complete_multipart_upload(
                        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}, **extra)
                except Exception as e:
                    if _code(e) in _PRECONDITION_FAILED:
                        raise FileExistsError(rel) from None
                    raise

            await retry.acall(complete, what=f"completing upload of {rel}")
        except BaseException:
            try:
                await asyncio.wait_for(s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id), 30)
            except Exception as e:
                log.warning("could not abort the incomplete upload of %s: %s", rel, describe(e))
            raise

    # --- reads -------------------------------------------------------------------------------

    def get_one(self, rel: str) -> bytes:
        return self.get_many([rel])[rel]

    def get_many(self, rels: list[str]) -> dict[str, bytes]:
        return self._run(self._get_many, rels)

    async def _get_many(self, rels: list[str]) -> dict[str, bytes]:
        sem = asyncio.Semaphore(self.io.concurrency)
        out = await asyncio.gather(*[self._get(rel, sem) for rel in rels])
        return dict(zip(rels, out))

    async def _get(self, rel: str, sem: asyncio.Semaphore) -> bytes:
        s3 = await self._client()
        bucket, key = self._bucket_key(rel)
        part_size, retry = self.io.part_size, self.io.retry

        async def get_range(rng: str | None) -> bytes:
            async def attempt():
                await self.afault("get", rel)
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
                return await retry.acall(attempt, what=f"reading {rel}")

        async with sem:
            try:
                head = await retry.acall(lambda: s3.head_object(Bucket=bucket, Key=key), what=f"sizing {rel}")
            except StorageError as e:
                if e.__cause__ is not None and _is_not_found(e.__cause__):
                    raise FileNotFoundError(rel) from None
                raise
        size = head["ContentLength"]
        if size <= part_size:
            return await get_range(None)
        ranges = [f"bytes={s}-{min(s + part_size, size) - 1}" for s in range(0, size, part_size)]
        return b"".join(await asyncio.gather(*[get_range(r) for r in ranges]))

    def get_bounded(self, rel: str, limit: int) -> bytes:
        return self.get_many_bounded([rel], limit)[rel]

    def get_many_bounded(self, rels: list[str], limit: int) -> dict[str, bytes]:
        return self._run(self._get_many_bounded, rels, limit)

    async def _get_many_bounded(self, rels: list[str], limit: int) -> dict[str, bytes]:
        sem = asyncio.Semaphore(self.io.concurrency)
        s3 = await self._client()

        async def one(rel: str) -> bytes:
            bucket, key = self._bucket_key(rel)

            async def attempt():
                await self.afault("get", rel)
                try:
                    resp = await s3.get_object(Bucket=bucket, Key=key)
                except Exception as e:
                    if _is_not_found(e):
                        raise FileNotFoundError(rel) from None
                    raise
                return await _read_capped(resp, rel, limit)

            async with sem:
                return await self.io.retry.acall(attempt, what=f"reading {rel}")

        out = await asyncio.gather(*[one(rel) for rel in rels])
        return dict(zip(rels, out))

    # --- uploads left behind ---------------------------------------------------------------------

    def abort_stale_uploads(self, rel: str, older_than_s: float) -> int:
        return self._run(self._abort_stale, rel, older_than_s)

    async def _abort_stale(self, rel: str, older_than_s: float) -> int:
        s3 = await self._client()
        bucket, prefix = self._bucket_key(rel)
        retry = self.io.retry
        resp = await retry.acall(lambda: s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix),
                                 what=f"listing uploads under {rel}")
        now, n = time.time(), 0
        for up in resp.get("Uploads", []):
            if now - up["Initiated"].timestamp() >= older_than_s:
                await retry.acall(lambda up=up: s3.abort_multipart_upload(
                    Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]), what=f"aborting upload of {up['Key']}")
                n += 1
        return n

    # --- compare-and-swap: the server's conditional writes on the ETag ---------------------------

    def read_versioned(self, rel: str, limit: int | None = None) -> tuple[bytes | None, str | None]:
        return self._run(self._read_versioned, rel, limit)

    async def _read_versioned(self, rel: str, limit: int | None) -> tuple[bytes | None, str | None]:
        s3 = await self.fs.set_session()
        bucket, key = self._bucket_key(rel)
        try:
            resp = await s3.get_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _code(e) in _NOT_FOUND:
                return None, None
            raise
        if limit is not None:
            return await _read_capped(resp, rel, limit), resp["ETag"]
        body = resp["Body"]
        try:
            return await body.read(), resp["ETag"]
        finally:
            body.close()

    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        return self._run(self._write_if, rel, data, version)

    async def _write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        s3 = await self.fs.set_session()
        bucket, key = self._bucket_key(rel)
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            await s3.put_object(Bucket=bucket, Key=key, Body=data, **condition)
            return True
        except Exception as e:
            # 412: the ETag moved on (or the object exists); 409: a conditional write raced ours; 404: deleted
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"):
                return False
            raise


async def _read_capped(resp: dict, rel: str, limit: int) -> bytes:
    """The body of a GetObject response of at most ``limit`` bytes: one the response says is bigger is
    refused unread, and no more than ``limit + 1`` bytes are ever read."""
    body = resp["Body"]
    try:
        if (resp.get("ContentLength") or 0) > limit:
            raise over_cap(rel, limit)
        data = await body.read(limit + 1)
    finally:
        body.close()
    if len(data) > limit:
        raise over_cap(rel, limit)
    return data
