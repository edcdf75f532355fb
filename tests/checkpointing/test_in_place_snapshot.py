"""Memory snapshots taken in place: once a layout's files were written into a memory file back to back, the
host copy's buffers for that layout are placed in that file where the files put each tensor's bytes
(checkpointing.recovery.replay.place), so a later snapshot copies the state there once and writes only the
envelopes, padding and non-tensor items. Each is checked against the state it was taken of, restored through
the durable reader; a write that would land on placed bytes is refused and the files go elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpointing.recovery.local_copy import Region
from checkpointing.recovery.restore import load_from_memory
from checkpointing.recovery.tier import MemoryTier
from tests.harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_region_copies_only_what_is_not_in_place_and_refuses_writes_over_placed_bytes():
    region = Region(4096, 64).reset(1)
    tensor = np.frombuffer(region.view, dtype=np.uint8, count=256, offset=64 + 16)  # placed where it goes
    tensor[:] = 7
    region.protect([(80, 336)])
    out = region.put([b"h" * 16, memoryview(tensor), b"t" * 8])
    assert out is not None and bytes(out) == b"h" * 16 + bytes([7]) * 256 + b"t" * 8
    assert region.copied == 24  # the 256 placed bytes were not copied
    region.reset(2)
    region.protect([(80, 336)])
    assert region.put([b"x" * 40]) is None  # bytes 64-104 of the region: over the placed bytes
    assert bytes(tensor) == bytes([7]) * 256
    region.reset(2)
    region.protect([(80, 336)])
    assert region.put([b"h" * 20, memoryview(tensor)]) is None  # not where the files put it
    assert region.refused and region.put([b"y"]) is None  # every later put too, until the next step
    assert bytes(tensor) == bytes([7]) * 256
    region.reset(3)
    region.protect([(80, 336)])
    assert region.put([b"z" * 8]) is not None and region.put([b"w" * 16]) is None  # bytes 72-88: over them
    assert bytes(tensor) == bytes([7]) * 256


def _state(g: torch.Generator, rows: int = 300) -> dict:
    return {"model": {"w": torch.randn(rows, 70, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16)},
            "optim": {"w": {"exp_avg": torch.randn(33, 7, generator=g), "step": torch.tensor(3.0)}}}


def _zeros(state):
    return {k: _zeros(v) for k, v in state.items()} if isinstance(state, dict) else torch.zeros_like(state)


def _nbytes(state) -> int:
    return sum(_nbytes(v) for v in state.values()) if isinstance(state, dict) else state.nbytes


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.compat
def test_snapshots_go_in_place_once_the_layout_held_twice_and_each_restores_its_state():
    tier = MemoryTier(0, 1)
    g = torch.Generator().manual_seed(0)
    state = _state(g)
    seen = ""
    try:
        for step in range(1, 16):
            if step == 8:  # a new layout: laid out anew, then in place again
                state = _state(g, rows=301)
            if step == 10:  # the plan lost with the layout unchanged: planned anew, the placed buffers dropped
                tier._plans.clear()
            with torch.no_grad():
                for t in (state["model"]["w"], state["optim"]["w"]["exp_avg"]):
                    t.normal_(generator=g)
                state["optim"]["w"]["step"].add_(1)
            res = tier.take_async(step, state, {"step": step, "samples_consumed": 12 * step}).result()
            assert res.ok, res.reason
            copied = tier._arena.region_of(step).copied
            if res.in_place:  # only the envelopes (about 1.5 kB a tensor) and padding were written, or nothing
                assert copied < 8 * 1024 < _nbytes(state) // 10, copied
            seen += "P" if res.planned else "-" if not res.in_place else "i" if copied else "I"
            back = _zeros(state)
            load_from_memory(back, tier.sources(step), res.snapshot)
            assert _same(back, state), f"step {step}"
    finally:
        tier.close()
    # P: planned by DCP; -: replayed from the host copy's own buffers (placing them in that memory file);
    # i: in place, the envelopes and padding written; I: in place, nothing written (no non-tensor items here).
    # Steps 8 (a new layout) and 10 (the plan lost) start over.
    assert seen == "P--iiIIP-P--iiI", seen
    assert len(tier._arena.regions) == 2


def test_in_place_snapshots_copy_to_peers_and_restore_at_world3():
    ranks = run_ranks("tests.memory_tier_jobs:in_place", 3, {}, timeout=180)
    for r in ranks:
        assert r["in_place"] == [False] * 3 + [True] * 4, r
        assert r["restored"] and r["same_bytes"] and r["mapped"] == [True] and r["restorable"] == 7, r
