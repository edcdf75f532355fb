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

import bisect
import ctypes
import mmap
import os
import threading

from ..dcp.format import CorruptCheckpointError


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
        self.placed = None  # the host copy's buffers placed here (.replay.Placed), kept while the layout holds
        self.protected: list = []  # this step's placed tensor bytes (protect)
        self.refused = False  # a put was refused this step (every later one is too)
        self.copied = 0  # bytes put copied in this step (a placed tensor's are not)
        self.laid_out = None  # the placed replay whose files lie here whole, nothing else written since

    def put(self, parts: list) -> memoryview | None:
        """``parts`` joined into the next bytes of the region (None when they do not fit, or would write over the
        bytes of a tensor placed here, :meth:`protect`): a view of them. A part that already lies where it
        goes (a placed tensor's bytes) is not copied; one lying elsewhere in the region is refused."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(len(v) for v in views)
        start = self._reserve(n)
        if start is None:
            return None
        base = self.address()
        end = base + len(self.view)
        moves, pos = [], start
        for v in views:
            at = _address(v)
            if len(v) and base <= at < end:
                if at != base + pos:  # a placed tensor's bytes, not where the files put them
                    return self._refuse()
            elif len(v):
                if self.protected and _overlaps(self.protected, pos, pos + len(v)):
                    return self._refuse()
                moves.append((pos, at, len(v)))
            pos += len(v)
        if moves:
            self.laid_out = None  # other bytes than the last layout's
        return self._write(start, n, moves)

    def put_patched(self, n: int, patches: list) -> memoryview | None:
        """The next ``n`` bytes of the region as they lie (a file laid out there before, ``laid_out``) with
        ``patches`` (``[(offset in them, bytes)]``) written over them: a view of them (None when they do not
        fit or a patch would land on placed bytes)."""
        start = self._reserve(n)
        if start is None:
            return None
        moves = []
        for off, raw in patches:
            view = memoryview(raw).cast("B")
            if off < 0 or off + len(view) > n or _overlaps(self.protected, start + off, start + off + len(view)):
                return self._refuse()
            if len(view):
                moves.append((start + off, _address(view), len(view)))
        return self._write(start, n, moves)

    def _reserve(self, n: int) -> int | None:
        """Where the next ``n`` bytes of the region start (taken), or None: they do not fit, or puts are refused."""
        with self._lock:
            if self.refused or self.used + n > self.capacity:
                return None
            start = self.reserve + self.used
            self.used += n
        return start

    def _write(self, start: int, n: int, moves: list) -> memoryview:
        base = self.address()
        for pos, at, size in moves:  # memmove through ctypes lets go of the interpreter lock (training runs on)
            ctypes.memmove(base + pos, at, size)
        with self._lock:
            self.copied += sum(size for *_, size in moves)
        out = self.view[start : start + n].toreadonly()
        self._given[id(out)] = (out, start)
        return out

    def _refuse(self) -> None:
        """From now until the next :meth:`reset`, every put is refused (the files go elsewhere)."""
        with self._lock:
            self.refused, self.laid_out = True, None
        return None

    def protect(self, ranges: list) -> None:
        """The bytes ``[(start, end)]`` (sorted) hold placed tensors of this step: no put writes over them."""
        self.protected = list(ranges)

    def address(self) -> int:
        return _address(self.view)

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
            self.protected, self.refused, self.copied = [], False, 0
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

    def take(self, step: int, nbytes: int, avoid: Region | None = None) -> Region | None:
        """A region for step ``step``'s files (at most ``nbytes``): a free one that fits, else a new one
        (a free one too small is let go), never ``avoid``. None once frozen, or where memory files do not exist."""
        if self.frozen or not hasattr(os, "memfd_create"):
            return None
        with self._lock:
            free = [r for r in self.regions if r.step not in self.held and r is not avoid]
            fits = [r for r in free if r.capacity >= nbytes and self._roomy(r)]
            if fits:
                return fits[0].reset(step)
            for r in free:
                self.regions.remove(r)
                r.close()
            region = Region(nbytes, self.reserve).reset(step)
            self.regions.append(region)
            return region

    def take_placed(self, step: int, current) -> Region | None:
        """A free region for step ``step`` whose placed buffers (``Region.placed``) ``current`` says are the
        host copy's layout and the last plan's now, else None."""
        with self._lock:
            for r in self.regions if not self.frozen else ():
                if r.step not in self.held and self._roomy(r) and current(r.placed):
                    return r.reset(step)
        return None

    def _roomy(self, region: Region) -> bool:
        """Whether ``region`` leaves room for the wire form's header and metadata (``grow_reserve``)."""
        return region.reserve >= self.reserve

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


def _overlaps(ranges: list, start: int, end: int) -> bool:
    """Whether ``[start, end)`` meets one of the sorted, disjoint ``ranges``."""
    i = bisect.bisect_right(ranges, (start, float("inf")))
    return (i > 0 and ranges[i - 1][1] > start) or (i < len(ranges) and ranges[i][0] < end)


def _address(view: memoryview) -> int:
    """Where a (contiguous, byte) buffer's memory starts, read-only ones too."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
