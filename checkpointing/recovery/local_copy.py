"""Copies to peers on the same host through shared memory: no bytes over a socket.

    keys = host_keys(group, world_size)     # collective: equal keys can open each other's memory
    shared = publish(snapshot.wire_parts()) # this rank's snapshot in an anonymous memory file (memfd)
                                            # (or: written into an Arena's Region as the snapshot is taken)
    blob = open_copy(pid, fd, size, where)  # a peer's: mapped read-only, kept alive by the mapping
    shared.close()                          # once every peer mapped it (the copies' agreement)

A snapshot copied to a peer on another host travels over the tier's gloo group
(:func:`checkpointing.recovery.peer_copy.replicate`): two copies through the kernel's sockets and
a few milliseconds of CPU per 8 MB on each side, every snapshot. Between two processes of one host
(the ranks of one node, the common case of a single multi-GPU machine) the sender's snapshot lies in an
anonymous memory file (``memfd_create``: the :class:`Region` its files were written into) and the peer maps
that file read-only through ``/proc/<pid>/fd/<fd>``: nothing is copied again. The pages belong to
the file, not to the sender: when the sender dies, the peer's mapping keeps them (the point of a
copy), and they are freed when the last mapping goes (the copy pruned), so nothing can leak past the
processes that hold it. A peer checks what it mapped as bytes received over the network are
(:meth:`MemorySnapshot.from_bytes`: framing, header checksum, every file's size against the agreed table),
each file's crc32c when a restore reads it (the bytes never crossed a wire).

``host_key`` is the kernel's boot id and the process-id namespace: two processes with the same key
see the same ``/proc``. Opening may still be refused (another user, a hardened ``/proc``); then
that copy fails as a lost network copy would (the step is not restorable, the previous one stays)
and every rank copies over the network from the next snapshot on (:class:`.tier.MemoryTier`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from ..dcp_format import CorruptCheckpointError


def host_key() -> str:
    """Equal for processes that share a kernel boot and a process-id namespace ("" where unknown: never
    equal to another's, so such a rank always copies over the network)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}" if boot else ""
    except OSError:
        return ""


def host_keys(group, world_size: int) -> list[str]:
    """Every rank's :func:`host_key` over ``group`` (collective; "" where shared memory does not work)."""
    import torch.distributed as dist

    keys = [""] * world_size
    dist.all_gather_object(keys, host_key() if hasattr(os, "memfd_create") else "", group=group)
    return keys


def publish(parts: list) -> Region:
    """``parts`` (bytes-like) written, in order, into a new anonymous memory file of their size (close-on-exec):
    a :class:`Region` without a reserve, closed by its owner once every peer mapped it."""
    size = sum(len(memoryview(p).cast("B")) for p in parts)
    region = Region(size, 0)
    try:
        region.put(parts)
    except BaseException:
        region.close()
        raise
    return region


def open_copy(pid: int, fd: int, size: int, where: str, offset: int = 0) -> memoryview:
    """``size`` bytes from ``offset`` of peer ``pid``'s memory file ``fd``, mapped read-only.
    CorruptCheckpointError when it is not there or is shorter; OSError when this host will not open another
    process's memory (the caller then copies over the network)."""
    try:
        src = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: process {pid} has no memory file {fd}") from None
    try:
        have = os.fstat(src).st_size
        if size <= 0 or offset < 0 or have < offset + size:
            raise CorruptCheckpointError(f"{where}: its memory file has {have} bytes, {size} from {offset} were "
                                         "announced")
        whole = memoryview(mmap.mmap(src, offset + size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        return whole[offset:]
    finally:
        os.close(src)


class Region:
    """One snapshot's own files, written into a memory file from ``reserve`` on (the wire form's header and
    metadata go just before them at :meth:`publish`, so the whole wire form is one range of the file)."""

    def __init__(self, capacity: int, reserve: int):
        self.fd = os.memfd_create("etrain-memory-snapshot", os.MFD_CLOEXEC)
        self.capacity, self.reserve = capacity, reserve
        os.ftruncate(self.fd, reserve + capacity)
        self.view = memoryview(mmap.mmap(self.fd, reserve + capacity, flags=mmap.MAP_SHARED))
        self.step, self.used = -1, 0
        self._given: dict[int, tuple[memoryview, int]] = {}  # the views put gave, and where each starts
        self._lock = threading.Lock()

    def put(self, parts: list) -> memoryview | None:
        """``parts`` joined into the next bytes of the region (None when they do not fit): a view of them."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(len(v) for v in views)
        with self._lock:
            if self.used + n > self.capacity:
                return None
            start = pos = self.reserve + self.used
            self.used += n
        base = _address(self.view)
        for v in views:  # memmove through ctypes lets go of the interpreter lock (training's Python runs on)
            if len(v):
                ctypes.memmove(base + pos, _address(v), len(v))
            pos += len(v)
        out = self.view[start : start + n].toreadonly()
        self._given[id(out)] = (out, start)
        return out

    def publish(self, head: bytes | memoryview, files: list) -> tuple[int, int] | None:
        """Write the wire form's ``head`` just before ``files`` (views this region gave, in wire order) when
        they lie back to back from the reserve on and the head fits: (offset, size) of the wire form in the
        memory file, else None."""
        pos = self.reserve
        for f in files:
            given = self._given.get(id(f))
            if given is None or given[0] is not f or given[1] != pos:
                return None
            pos += len(f)
        if len(head) > self.reserve:
            return None
        start = self.reserve - len(head)
        self.view[start : self.reserve] = memoryview(head).cast("B")
        return start, pos - start

    def reset(self, step: int) -> Region:
        with self._lock:
            self.step, self.used = step, 0
            self._given.clear()
        return self

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the mapping stays while a snapshot's files are views of it
            self.fd = -1

    __del__ = close


class Arena:
    """The memory files (:class:`Region`) a tier's own snapshots are written into, each rewritten only once
    the tier no longer holds its step (:meth:`hold`): no fresh pages per snapshot, and a peer on this host
    maps a snapshot's wire form where it lies. :meth:`freeze` (the tier detached: what it held is kept past
    it) ends every rewrite."""

    def __init__(self):
        self.regions: list[Region] = []
        self.held: set[int] = set()
        self.reserve = 1 << 20  # room for the wire form's header and metadata before the files
        self.frozen = False
        self._lock = threading.Lock()

    def take(self, step: int, nbytes: int) -> Region | None:
        """A region for step ``step``'s files (at most ``nbytes``): a free one that fits, else a new one
        (a free one too small is let go). None once frozen, or where memory files do not exist."""
        if self.frozen or not hasattr(os, "memfd_create"):
            return None
        with self._lock:
            free = [r for r in self.regions if r.step not in self.held]
            fits = [r for r in free if r.capacity >= nbytes and r.reserve >= self.reserve]
            if fits:
                return fits[0].reset(step)
            for r in free:
                self.regions.remove(r)
                r.close()
            region = Region(nbytes, self.reserve).reset(step)
            self.regions.append(region)
            return region

    def region_of(self, step: int) -> Region | None:
        with self._lock:
            return next((r for r in self.regions if r.step == step), None)

    def hold(self, steps: set[int]) -> None:
        """The steps the tier holds (their regions are never rewritten)."""
        with self._lock:
            self.held = set(steps)

    def grow_reserve(self, head: int) -> None:
        """A wire form's header and metadata of ``head`` bytes did not fit: regions from now on leave room."""
        self.reserve = max(self.reserve, 1 << (2 * head).bit_length())

    def freeze(self) -> None:
        with self._lock:
            self.frozen = True
            self.held = {r.step for r in self.regions}


def _address(view: memoryview) -> int:
    """Where a (contiguous, byte) buffer's memory starts, read-only ones too."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
