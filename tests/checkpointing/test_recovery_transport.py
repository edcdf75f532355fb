"""The memory tier's per-step path: the host copy indexed once per layout, a snapshot's files replayed from
the last layout (a changed layout laid out anew), and the one transport interface with its two
implementations, each refusing the direction it does not carry."""

from __future__ import annotations

import pytest
import torch

from checkpointing.host_copy import HostCopy, layout_fingerprint
from checkpointing.recovery.restore import SnapshotKey, load_from_memory
from checkpointing.recovery.tier import MemoryTier
from checkpointing.recovery.transport import PeerCopyTransport, SnapshotTransport, TransportError
from orchestrator.workers.tier_fetch import MemoryRestore, RayFetchTransport


def state(n: int = 33, note: str = "a", seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, 7, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16)},
            "optim": {"w": {"exp_avg": torch.randn(n, 7, generator=g), "step": torch.tensor(3.0)}, "note": note}}


def zeros(s):
    if isinstance(s, dict):
        return {k: zeros(v) for k, v in s.items()}
    return torch.zeros_like(s) if isinstance(s, torch.Tensor) else ""


def test_the_host_copy_is_indexed_once_per_layout_and_copied_anew_when_it_changes():
    host = HostCopy()
    first = host.copy_async(state())
    again = host.copy_async(state(seed=2, note="b"))
    out = again.wait()
    assert again.layout == first.layout == layout_fingerprint(out)
    assert out["model"]["w"].data_ptr() == first.state["model"]["w"].data_ptr()  # the same buffers, refilled
    assert torch.equal(out["model"]["w"], state(seed=2)["model"]["w"]) and out["optim"]["note"] == "b"
    bigger = host.copy_async(state(n=40, seed=3))
    assert bigger.layout != first.layout == layout_fingerprint(first.state)
    assert bigger.layout == layout_fingerprint(bigger.state)
    assert torch.equal(bigger.state["optim"]["w"]["exp_avg"], state(n=40, seed=3)["optim"]["w"]["exp_avg"])


def test_a_deferred_host_copy_is_made_by_its_waiter_or_before_the_optimizer_writes_whichever_is_first():
    from checkpointing.host_copy import fence_writes

    host = HostCopy()
    live = state(seed=1)
    first = host.copy_async(live, defer=True)  # a new layout: indexed and copied in the call
    assert first.done() and torch.equal(first.state["model"]["w"], live["model"]["w"])
    # The same layout: nothing copied in the call; the training thread's fence makes the copy, as of then.
    live["model"]["w"].add_(1.0)
    pending = host.copy_async(live, defer=True)
    assert not pending.done()
    assert not torch.equal(pending.state["model"]["w"], live["model"]["w"])  # the buffers still hold copy 1
    fence_writes()  # what the optimizer step calls before writing in place
    assert pending.done()
    expected = live["model"]["w"].clone()
    live["model"]["w"].mul_(3.0)  # the optimizer's write, after the fence: not in the copy
    assert torch.equal(pending.wait()["model"]["w"], expected)
    # The waiter first (the tier's thread): the copy is made by wait(), once; the fence then has nothing to do.
    again = host.copy_async(live, defer=True)
    out = again.wait()
    assert again.done() and torch.equal(out["model"]["w"], live["model"]["w"])
    assert torch.equal(out["optim"]["w"]["exp_avg"], live["optim"]["w"]["exp_avg"])
    live["model"]["w"].zero_()
    fence_writes()
    assert not torch.equal(again.state["model"]["w"], live["model"]["w"])


def test_a_replayed_snapshot_restores_its_own_state_and_a_resized_item_is_laid_out_anew():
    tier = MemoryTier(0, 1)
    try:
        got = []
        for step, s in ((1, state(seed=1)), (2, state(seed=2)), (3, state(seed=3, note="a longer note" * 40))):
            res = tier.take_async(step, s, {"step": step, "samples_consumed": 12 * step}).result()
            assert res.ok, res.reason
            target = zeros(s)
            load_from_memory(target, res.snapshot.sources(), res.snapshot)
            assert torch.equal(target["model"]["w"], s["model"]["w"]) and target["optim"]["note"] == s["optim"]["note"]
            got.append(res.planned)
        # Step 2 replays step 1's layout (no planning); step 3's note no longer fits it: planned anew.
        assert got == [True, False, True]
    finally:
        tier.close()


def test_both_transports_are_the_one_interface_and_refuse_the_other_direction():
    push = PeerCopyTransport(None, {0: [1], 1: [0]})
    pull = RayFetchTransport(MemoryRestore(SnapshotKey(3, 1), {"__0_0.x.distcp": "w0"}))
    assert isinstance(push, SnapshotTransport) and isinstance(pull, SnapshotTransport)
    with pytest.raises(TransportError, match="RayFetchTransport"):
        push.fetch(SnapshotKey(3, 1), "__0_0.x.distcp")
    with pytest.raises(TransportError, match="PeerCopyTransport"):
        pull.send(None)
    assert pull.where == {"__0_0.x.distcp": "w0"} and MemoryRestore(SnapshotKey(3, 1), {}).step == 3


def test_a_rank_without_the_last_plan_makes_every_rank_plan_anew():
    from tests.harness import run_ranks

    ranks = run_ranks("tests.memory_tier_jobs:replan_one", 2, {}, timeout=120)
    assert [r["out"] for r in ranks] == [[("agreed", True, ""), ("agreed", True, "")]] * 2, ranks


def test_files_fetched_from_other_holders_are_fetched_together_not_one_after_another():
    # Two fetched files whose fetches each wait for the other: read in turn, the first would time out.
    import threading

    from checkpointing.recovery.snapshot import MemoryStorage

    both = threading.Barrier(2, timeout=5.0)

    def fetched(data: bytes):
        def fetch() -> bytes:
            both.wait()
            return data
        return fetch

    storage = MemoryStorage({"a": fetched(b"A"), "b": fetched(b"B"), "c": b"C"})
    assert storage.get_many(["a", "b", "c"]) == {"a": b"A", "b": b"B", "c": b"C"}
