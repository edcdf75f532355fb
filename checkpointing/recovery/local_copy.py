"""Copies to peers on the same host through shared memory: no bytes over a socket.

    keys = host_keys(group, world_size)     # collective: equal keys can open each other's memory
    shared = publish(snapshot.wire_parts()) # this rank's snapshot in an anonymous memory file (memfd)
    blob = open_copy(pid, fd, size, where)  # a peer's: mapped read-only, kept alive by the mapping
    shared.close()                          # once every peer mapped it (the copies' agreement)

A snapshot copied to a peer on another host travels over the tier's gloo group
(:func:`checkpointing.recovery.peer_copy.replicate`): two copies through the kernel's sockets and
a few milliseconds of CPU per 8 MB on each side, every snapshot. Between two processes of one host
(the ranks of one node, the common case of a single multi-GPU machine) the sender writes its
snapshot once into an anonymous memory file (``memfd_create``, one ``writev``) and the peer maps
that file read-only through ``/proc/<pid>/fd/<fd>``: nothing is copied again. The pages belong to
the file, not to the sender: when the sender dies, the peer's mapping keeps them (the point of a
copy), and they are freed when the last mapping goes (the copy pruned), so nothing can leak past the
processes that hold it. A peer checks what it mapped exactly as bytes received over the network
(:meth:`MemorySnapshot.from_bytes`: framing, header checksum, every file against the agreed table).

``host_key`` is the kernel's boot id and the process-id namespace: two processes with the same key
see the same ``/proc``. Opening may still be refused (another user, a hardened ``/proc``); then
that copy fails as a lost network copy would (the step is not restorable, the previous one stays)
and every rank copies over the network from the next snapshot on (:class:`.tier.MemoryTier`).
"""

from __future__ import annotations

import mmap
import os

from ..dcp_format import CorruptCheckpointError

_BROKEN: list[str] = []  # why opening a peer's memory failed here once (then: copies over the network)


def host_key() -> str:
    """Equal for processes that share a kernel boot and a process-id namespace ("" where unknown: never
    equal to another's, so such a rank always copies over the network)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}" if boot and not _BROKEN else ""
    except OSError:
        return ""


def host_keys(group, world_size: int) -> list[str]:
    """Every rank's :func:`host_key` over ``group`` (collective; "" where shared memory does not work)."""
    import torch.distributed as dist

    keys = [""] * world_size
    dist.all_gather_object(keys, host_key() if hasattr(os, "memfd_create") else "", group=group)
    return keys


class Shared:
    """This rank's snapshot in an anonymous memory file, open until :meth:`close`."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close


def publish(parts: list) -> Shared:
    """``parts`` (bytes-like) written, in order, into a new anonymous memory file (close-on-exec)."""
    fd = os.memfd_create("etrain-memory-snapshot", os.MFD_CLOEXEC)
    try:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        size = sum(len(v) for v in views)
        os.ftruncate(fd, size)
        while views:  # writev may write less than asked (and takes at most IOV_MAX buffers)
            wrote = os.writev(fd, views[:512])
            while wrote and views:
                if wrote >= len(views[0]):
                    wrote -= len(views.pop(0))
                else:
                    views[0], wrote = views[0][wrote:], 0
        return Shared(fd, size)
    except BaseException:
        os.close(fd)
        raise


def open_copy(pid: int, fd: int, size: int, where: str) -> memoryview:
    """Peer ``pid``'s memory file ``fd`` of ``size`` bytes, mapped read-only. CorruptCheckpointError when it
    is not there or has another size; OSError when this host will not open another process's memory (then
    shared memory is off in this process from now on)."""
    try:
        src = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: process {pid} has no memory file {fd}") from None
    except OSError as e:
        _BROKEN.append(str(e))
        raise
    try:
        have = os.fstat(src).st_size
        if have != size or size <= 0:
            raise CorruptCheckpointError(f"{where}: its memory file has {have} bytes, {size} were announced")
        return memoryview(mmap.mmap(src, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    finally:
        os.close(src)
