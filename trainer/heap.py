"""Python's cyclic garbage collector in a long training process.

    freeze_boot_heap()      # once set up: what exists now is never scanned again
    thaw_heap()             # (a process that runs again after: its objects become collectable again)

A full collection walks every object the collector tracks: in a process that imported torch, Ray and
the checkpointing stack, about 330,000 of them, 130-170 ms measured on a 2-core host, at a moment
the allocator picks: inside a recovery, inside a step (and every rank waits for the slowest one in the
step's next collective), inside a snapshot. What boot made (modules, classes, functions, the corpus's
metadata) is never garbage; :func:`freeze_boot_heap` moves it to the permanent generation, which
collections skip, so that a later full collection walks only what training made since: well under a
millisecond for the built-in model. Collection itself stays on, so cycles made later are still freed.
No collection runs first: it would cost the same 130-170 ms at every start, for the few dozen
unreachable objects an import leaves.
"""

from __future__ import annotations

import gc


def freeze_boot_heap() -> None:
    """Exempt every object that exists now from later collections (``gc.freeze``)."""
    gc.freeze()


def thaw_heap() -> None:
    """Make frozen objects collectable again (``gc.unfreeze``): for a process that goes on after a run it
    froze for, so that the run's objects, once unreachable, are freed."""
    gc.unfreeze()
