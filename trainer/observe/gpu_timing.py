"""Collective timing in GPU time: CUDA event pairs around NCCL collectives, read once they have completed.

    timer = EventTimer()
    if timer.wants(tensor):                  # a CUDA tensor (NCCL): CPU tensors keep host timing
        start = timer.start()                # an event on the current stream, before the collective is issued
        ...issue...; after completion (sync call, work future, wait_tensor) on a stream that waits for it:
        timer.finish(start, record_args)     # the end event; recorded as (record_args, seconds) once it has fired
    timer.drain(record)                      # record every pair whose end has completed (never blocks)

The host clock measures how long it takes to *enqueue* an NCCL collective (microseconds), not how long
the GPU spends on it. The start event is recorded on the issuing stream, which the NCCL stream waits
for before it starts; the end event is recorded on a stream that waits for the collective's completion
(the current stream after a blocking call or ``wait_tensor``, the callback stream of the work's future,
which CUDA futures make wait on the work's events). Their difference is the collective's GPU time,
including waiting for the slowest peer, as nccl-tests count it. Nothing here synchronizes: pairs are
read when their end event has fired, at the next collective or snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

MAX_PENDING = 4096  # pairs never completed (a crashed group) are dropped rather than kept


class EventTimer:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[object, object, tuple]] = []

    @staticmethod
    def wants(tensor) -> bool:
        """Whether a collective over ``tensor`` is timed on the GPU: a CUDA tensor (or list of them)."""
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0] if tensor else None
        return torch.is_tensor(tensor) and tensor.is_cuda

    @staticmethod
    def start():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, start, args: tuple) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.add(start, end, args)

    def add(self, start, end, args: tuple) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.clear()
            self._pending.append((start, end, args))

    def drain(self, record: Callable[..., None]) -> int:
        """``record(*args, seconds)`` for every pair whose end event has completed; how many are left."""
        keep, done = [], []
        with self._lock:
            for pair in self._pending:
                (done if pair[1].query() else keep).append(pair)
            self._pending = keep
            left = len(keep)
        for start, end, args in done:
            record(*args, start.elapsed_time(end) / 1000.0)
        return left
