"""A pipelined swapper: fp32 state in a file, streamed through a fixed pool of host buffers.

    f = StateFile(path, numel)                      # created exclusively, zeros (a sparse file)
    pool = BufferPool(count=4, numel=1 << 20)       # the only host memory the state ever occupies
    swapper = Swapper(f, pool)
    stats = swapper.run(units, compute)             # units: [(file ranges), ...]; compute(i, buffer)
    t = f.mapped()                                  # the whole file as one memory-mapped tensor (checkpoints)

:meth:`Swapper.run` walks the units in order: a reader thread fills a buffer with unit ``i + 1``
(and further, as buffers allow) while the caller computes on unit ``i`` in place, and a writer
thread writes unit ``i - 1`` back; a buffer returns to the pool only once its write has finished,
so a read never lands in a buffer whose contents are still on their way to the file. It returns
when every write is done: between two runs the file holds the whole state. A unit is a list of
``(offset, numel)`` ranges of the file, laid one after another in its buffer. The time the caller
waited for a read (and for the last writes) is the step's I/O stall (:class:`SwapStats`).

Reads and writes are plain ``preadv``/``pwritev`` into the buffers (the page cache, not this
process, holds whatever the kernel keeps of the file); :meth:`StateFile.mapped` shares those
pages, so checkpoints read and load the state in place without a copy of it in memory.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

F32 = 4  # bytes per element: the state is fp32


class BufferPool:
    """``count`` fp32 host buffers of ``numel`` elements (pinned where CUDA is present), handed out one at a
    time: :meth:`acquire` blocks while every buffer is in use. ``max_in_use`` is the high-water mark."""

    def __init__(self, count: int, numel: int, pin: bool = False):
        if count < 2 or numel < 1:
            raise ValueError(f"a buffer pool needs >= 2 buffers of >= 1 element (got {count} x {numel})")
        self.numel = numel
        self.buffers = [torch.empty(numel, dtype=torch.float32, pin_memory=pin) for _ in range(count)]
        self._free = list(range(count))
        self._cond = threading.Condition()
        self.in_use = 0
        self.max_in_use = 0

    @property
    def nbytes(self) -> int:
        return len(self.buffers) * self.numel * F32

    def acquire(self) -> int:
        """A free buffer's index (blocks until one is released)."""
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            self.in_use += 1
            self.max_in_use = max(self.max_in_use, self.in_use)
            return self._free.pop(0)

    def release(self, i: int) -> None:
        with self._cond:
            if i in self._free:
                raise RuntimeError(f"buffer {i} released twice")
            self._free.append(i)
            self.in_use -= 1
            self._cond.notify()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class StateFile:
    """``numel`` fp32 values in a file of this process's own (created exclusively, removed by :meth:`close`)."""

    def __init__(self, path: str, numel: int):
        self.path, self.numel = path, numel
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, numel * F32)  # sparse: reads as zeros, AdamW's initial state

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Elements ``offset .. offset + out.numel()`` into ``out`` (contiguous fp32, CPU)."""
        view, pos = _bytes(out), offset * F32
        while view.nbytes:
            n = os.preadv(self.fd, [view], pos)
            if n <= 0:
                raise OSError(f"short read from {self.path} at byte {pos}")
            view, pos = view[n:], pos + n

    def write_from(self, offset: int, src: torch.Tensor) -> None:
        view, pos = _bytes(src), offset * F32
        while view.nbytes:
            n = os.pwritev(self.fd, [view], pos)
            view, pos = view[n:], pos + n

    def mapped(self) -> torch.Tensor:
        """The whole file as one fp32 tensor sharing its pages (writes to it reach the file)."""
        return torch.from_file(self.path, shared=True, size=self.numel, dtype=torch.float32)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@dataclass
class SwapStats:
    """One :meth:`Swapper.run`: bytes moved, seconds the caller waited for them, seconds the threads spent."""

    read_bytes: int = 0
    written_bytes: int = 0
    wait_s: float = 0.0  # the caller blocked on I/O (reads not ready, the final writes)
    io_s: float = 0.0  # reader and writer busy, in total
    run_s: float = 0.0

    def add(self, other: SwapStats) -> None:
        for k in ("read_bytes", "written_bytes", "wait_s", "io_s", "run_s"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


Unit = list[tuple[int, int]]  # (file offset, numel) ranges, laid one after another in a buffer


class Swapper:
    """The pipelined read-compute-write loop over a :class:`StateFile` (module docstring)."""

    def __init__(self, file: StateFile, pool: BufferPool):
        self.file, self.pool = file, pool
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="etrain-swap-in")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="etrain-swap-out")
        self._io_lock = threading.Lock()
        self._io_s = 0.0

    def _timed(self, fn, *args) -> None:
        t0 = time.perf_counter()
        fn(*args)
        with self._io_lock:
            self._io_s += time.perf_counter() - t0

    def _read(self, unit: Unit) -> int:
        i = self.pool.acquire()  # blocks until a buffer's write-back has finished
        try:
            self._timed(self._move, unit, self.pool.buffers[i], self.file.read_into)
        except BaseException:
            self.pool.release(i)
            raise
        return i

    def _write(self, unit: Unit, i: int) -> None:
        try:
            self._timed(self._move, unit, self.pool.buffers[i], self.file.write_from)
        finally:
            self.pool.release(i)

    @staticmethod
    def _move(unit: Unit, buf: torch.Tensor, op) -> None:
        at = 0
        for offset, numel in unit:
            op(offset, buf[at : at + numel])
            at += numel

    def run(self, units: list[Unit], compute: Callable[[int, torch.Tensor], None]) -> SwapStats:
        """``compute(i, buffer)`` for each unit in order, on its state read into ``buffer`` (the unit's
        ranges one after another), which it updates in place; written back behind it."""
        for u in units:
            if sum(n for _, n in u) > self.pool.numel:
                raise ValueError(f"a unit of {sum(n for _, n in u)} elements exceeds a buffer ({self.pool.numel})")
        stats, t_run = SwapStats(), time.perf_counter()
        self._io_s = 0.0
        depth = max(1, len(self.pool.buffers) - 1)  # reads ahead; one buffer is always left to compute in
        reads: list[Future] = [self._reader.submit(self._read, u) for u in units[:depth]]
        writes: list[Future] = []
        held = None  # the buffer being computed on
        try:
            for k, unit in enumerate(units):
                t0 = time.perf_counter()
                held = reads[k].result()
                stats.wait_s += time.perf_counter() - t0
                if k + depth < len(units):
                    reads.append(self._reader.submit(self._read, units[k + depth]))
                n = sum(m for _, m in unit)
                compute(k, self.pool.buffers[held][:n])
                writes.append(self._writer.submit(self._write, unit, held))
                held = None
                stats.read_bytes += n * F32
                stats.written_bytes += n * F32
        finally:
            t0 = time.perf_counter()
            if held is not None:  # compute failed: nothing of that unit is written back
                self.pool.release(held)
            for f in reads[len(writes) + (held is not None):]:  # reads never computed on: buffers go back
                try:
                    self.pool.release(f.result())
                except Exception:
                    pass
            for f in writes:
                f.result()
            stats.wait_s += time.perf_counter() - t0
        stats.io_s, stats.run_s = self._io_s, time.perf_counter() - t_run
        return stats

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.file.close()
