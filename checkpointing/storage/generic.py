"""The backend of every other fsspec protocol (``gs://``, ``az://``, ``memory://``, ...): fsspec's own calls.

An ``exclusive`` write checks that the name is free just before writing (not atomic: two writers
racing may both write). Compare-and-swap is best effort too: the version is a sha256 of the bytes,
compared just before the write, so a writer that gets in between the two is overwritten.
"""

from __future__ import annotations

from .backend import Backend, Body, digest


class FsspecBackend(Backend):
    def put_one(self, rel: str, body: Body, exclusive: bool, checksum: bool = False) -> str | None:
        path = self.path(rel)

        def attempt():
            f = self.fault("put", rel)
            keep = body.size // 2 if f.truncate else body.size  # a truncating fault stores half
            crc = body.checksum() if checksum else None
            if exclusive and self.fs.exists(path):
                raise FileExistsError(rel)
            self.fs.pipe_file(path, body.read(0, keep))
            return crc

        return self.io.retry.call(attempt, what=f"writing {rel}")

    def get_one(self, rel: str) -> bytes:
        path = self.path(rel)

        def attempt():
            self.fault("get", rel)
            return self.fs.cat_file(path)

        return self.io.retry.call(attempt, what=f"reading {rel}")

    def read_versioned(self, rel: str, limit: int | None = None) -> tuple[bytes | None, str | None]:
        try:
            data = self.get_one(rel) if limit is None else self.get_bounded(rel, limit)
        except FileNotFoundError:
            return None, None
        return data, digest(data)

    def write_if(self, rel: str, data: bytes, version: str | None) -> bool:
        current, now = self.read_versioned(rel)
        if now != version or (version is None and current is not None):
            return False
        self.write(rel, data)
        return True
