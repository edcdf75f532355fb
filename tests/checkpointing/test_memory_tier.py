"""The memory tier: a snapshot in host memory restores exactly what the durable checkpoint of the same step
restores, into another world size and another layout, from a peer's copy alone; a snapshot that not every
rank completed, a file that fails its checksum or metadata that would run code is never used.

Multi-process tests run the real Trainer in real gloo groups (tests.harness, rank processes reused): a
world-2 ZeRO-3 run commits a durable checkpoint (file://) and takes a memory snapshot of the same step; the
snapshot is restored at world 3 (ZeRO-3) and at world 2 (ZeRO-1, from rank 0's memory alone), each compared
bitwise with the durable checkpoint restored into the same layout, and with stock DCP's reading of both.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from checkpointing.dcp.format import CorruptCheckpointError
from checkpointing.errors import CheckpointError
from checkpointing.recovery.restore import load_from_memory, plan_restore
from checkpointing.recovery.snapshot import MemorySnapshot, replica_peers
from checkpointing.recovery.budget import state_bytes
from checkpointing.recovery.tier import MemoryTier
from tests.harness import run_ranks

BASE = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "data.max_bytes=60000", "data.seq_len=16",
        "train.global_batch=12", "train.micro_batch=2", "train.warmup_steps=1", "train.steps=20",
        "metrics.enabled=false"]
ZERO3, ZERO1 = ["parallel.zero_stage=3"], ["parallel.zero_stage=1"]


def small_state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(33, 7, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16)},
            "optim": {"w": {"exp_avg": torch.randn(33, 7, generator=g), "step": torch.tensor(3.0)}}}


def zeros(state):
    return {k: zeros(v) for k, v in state.items()} if isinstance(state, dict) else torch.zeros_like(state)


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k], f"{what}.{k}")
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}.{k} differs"


@pytest.fixture
def taken():
    tier = MemoryTier(0, 1)
    state = small_state()
    res = tier.take(7, state, {"step": 7, "samples_consumed": 84})
    assert res.ok, res.reason
    yield tier, state, res.snapshot
    tier.close()


# --- one process -------------------------------------------------------------------------------


@pytest.mark.compat
def test_snapshot_round_trips_through_its_wire_format_and_restores_bitwise(taken):
    tier, state, snap = taken
    back = MemorySnapshot.from_bytes(snap.to_bytes())
    assert (back.step, back.rank, back.world_size, back.agreed, back.trainer_state) == (7, 0, 1, True,
                                                                                      snap.trainer_state)
    assert back.files == snap.files and back.metadata == snap.metadata and back.table == snap.table
    assert tier.held_bytes() == snap.nbytes >= state_bytes(state)
    target = zeros(state)
    load_from_memory(target, back.sources(), back)
    assert_same(target, state)


def test_a_corrupt_or_missing_file_is_refused_naming_it(taken):
    _, state, snap = taken
    (name,) = snap.files
    blob = bytearray(snap.to_bytes())
    blob[-10] ^= 0xFF  # a byte of the shard file, as a bad transfer would flip it
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        MemorySnapshot.from_bytes(bytes(blob), "the copy")
    bad = bytearray(snap.files[name])
    bad[-10] ^= 0xFF
    target = zeros(state)
    with pytest.raises(CorruptCheckpointError, match=f"{name} fails its checksum"):
        load_from_memory(target, {name: bytes(bad)}, snap)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is missing"):
        load_from_memory(target, {}, snap)
    assert_same(target, zeros(state))  # nothing was loaded
    snap.agreed = False
    with pytest.raises(CheckpointError, match="never agreed"):
        load_from_memory(target, snap.sources(), snap)


class _Hostile:
    def __reduce__(self):
        return (os.system, ("touch /tmp/etrain-memory-tier-pwned",))


@pytest.mark.compat
def test_metadata_that_would_run_code_is_refused_unexecuted(taken, tmp_path):
    _, state, snap = taken
    marker = "/tmp/etrain-memory-tier-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    snap.metadata = pickle.dumps(_Hostile())  # checksums recomputed: only the unpickler stands in the way
    with pytest.raises(CorruptCheckpointError, match="posix.system is not allowed|os.system is not allowed"):
        MemorySnapshot.from_bytes(snap.to_bytes(), "the copy")
    with pytest.raises(CorruptCheckpointError, match="is not allowed in DCP metadata"):
        load_from_memory(zeros(state), snap.sources(), snap)
    assert not os.path.exists(marker)


def test_a_snapshot_over_the_budget_is_refused_with_a_reason():
    state = small_state()
    tier = MemoryTier(0, 1, memory_budget_bytes=state_bytes(state) // 2)
    res = tier.take(3, state)
    assert res.status == "refused" and "memory_budget_bytes=" in res.reason and "rank 0 would hold" in res.reason
    assert tier.held_bytes() == 0 and tier.needed() == {}
    tier.memory_budget_bytes = 2 * state_bytes(state)
    first = tier.take(4, state)
    assert first.ok and tier.held_bytes() == first.snapshot.nbytes
    # The next snapshot must fit beside the kept one until it replaces it.
    assert tier.take(5, state).status == "refused" and tier.restorable == 4
    tier.memory_budget_bytes = 0
    assert tier.take(6, state).ok and set(tier.needed()) == {6}  # at most the newest agreed one is kept
    tier.close()


def test_replica_peers_prefer_another_node():
    assert [replica_peers(r, 4) for r in range(4)] == [[1], [2], [3], [0]]
    nodes = ["a", "a", "b", "b"]
    assert [replica_peers(r, 4, 1, nodes) for r in range(4)] == [[2], [2], [0], [0]]
    assert replica_peers(0, 4, 2, nodes) == [2, 3] and replica_peers(0, 3, 5) == [1, 2]
    assert replica_peers(0, 1) == []
    with pytest.raises(ValueError, match="one per rank"):
        replica_peers(0, 4, 1, ["a"])


def test_plan_restore_takes_the_newest_complete_step_else_none():
    needed = {10: {".metadata", "a", "b", "c"}, 9: {".metadata", "x", "y", "z"}}
    holdings = {0: {10: {".metadata", "a"}, 9: {".metadata", "x", "z"}}, 2: {10: {".metadata", "c", "a"}}}
    # Step 10's "b" is held by nobody (its rank died with no copy): step 9 is complete.
    holdings[1] = {9: {".metadata", "y"}}
    plan = plan_restore(holdings, needed)
    assert plan.step == 9 and plan.where == {".metadata": 0, "x": 0, "y": 1, "z": 0}
    assert "step 10 lacks 1 file(s) (b)" in plan.reason
    holdings[2][10].add("b")
    plan = plan_restore(holdings, needed)
    assert plan.step == 10 and plan.where == {".metadata": 0, "a": 0, "b": 2, "c": 2}
    assert plan_restore({0: {10: {"a"}}}, needed) is None
    assert plan_restore({}, {}) is None


# --- real process groups ---------------------------------------------------------------------------


def _plain(sources: dict) -> dict[str, bytes]:
    """Sources as ``bytes`` (a snapshot's files are views of the bytes it was read from) for a job's payload."""
    return {k: bytes(v) for k, v in sources.items()}


def _all_sources(ranks: list[dict]) -> dict[str, bytes]:
    out = {}
    for r in ranks:
        out.update(_plain(MemorySnapshot.from_bytes(r["snapshot"]).sources()))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """A world-2 ZeRO-3 run: a durable checkpoint and a memory snapshot (with copies) of step 6, taken in the
    background (take_async), after one of each step before: by then the host copy goes straight into the memory
    file the snapshot's files lie in, laid out there by the snapshot of step 4 (in place, only the non-tensor
    items written again)."""
    url = f"file://{tmp_path_factory.mktemp('mem-tier')}"
    base = BASE + [f'checkpoint.url="{url}"']
    ranks = run_ranks("tests.memory_tier_jobs:snapshot", 2,
                      {"base": base, "layout": ZERO3, "train": 6, "run_id": "w2", "async": True}, timeout=300)
    return base, url, ranks


@pytest.mark.compat
def test_a_world2_snapshot_restores_at_world3_bitwise_as_the_durable_checkpoint(world2, tmp_path):
    base, url, ranks = world2
    # Taken with take_async: training waited for a host copy; the later snapshots reused the first's plan, the
    # last one in place.
    assert [r["first"] for r in ranks] == [("agreed", True)] * 2
    assert [(r["status"], r["planned"], r["in_place"]) for r in ranks] == [("agreed", False, True)] * 2
    assert all(r["replicated"] for r in ranks)
    assert all(r["restorable"] == 6 and r["held"] > 0 for r in ranks)
    snap = ranks[1]["snapshot"]
    out = run_ranks("tests.memory_tier_jobs:restore", 3, {"base": base, "layout": ZERO3, "run_id": "w2",
                                                          "snapshot": snap, "sources": _all_sources(ranks)})
    for r in out:
        assert r["memory_step"] == r["durable_step"] == 6
        assert_same(r["memory"], r["durable"], "world 3")
        assert_same(r["memory"], ranks[0]["state"], "world 3 vs the saved state")
        assert r["memory_loss"] == r["durable_loss"]
    # Stock DCP reads the snapshot's files as a checkpoint directory, and they hold what the durable one does.
    mem_dir = tmp_path / "memory"
    mem_dir.mkdir()
    for name, data in _all_sources(ranks).items():
        (mem_dir / name).write_bytes(data)
    dcp_to_torch_save(str(mem_dir), str(tmp_path / "mem.pt"))
    dcp_to_torch_save(f"{url[len('file://'):]}/w2/checkpoints/step_000000006", str(tmp_path / "dur.pt"))
    stock_mem, stock_dur = (torch.load(tmp_path / n, weights_only=True) for n in ("mem.pt", "dur.pt"))
    assert_same(stock_mem, stock_dur, "stock DCP")


@pytest.mark.compat
def test_rank1_restores_from_rank0s_copy_alone_into_zero1(world2):
    base, _, ranks = world2
    # Rank 1 is gone with its memory: what rank 0 holds is its own files and its copy of rank 1's.
    own = MemorySnapshot.from_bytes(ranks[0]["snapshot"])
    (copy,) = [MemorySnapshot.from_bytes(b) for b in ranks[0]["copies"].values()]
    assert copy.rank == 1 and copy.files == MemorySnapshot.from_bytes(ranks[1]["snapshot"]).files
    plan = plan_restore({0: ranks[0]["holdings"]}, ranks[0]["needed"])
    assert plan is not None and plan.step == 6 and set(plan.where.values()) == {0}
    assert set(plan.where) == set(own.file_table())
    out = run_ranks("tests.memory_tier_jobs:restore", 2, {"base": base, "layout": ZERO1, "run_id": "w2",
                                                          "snapshot": ranks[0]["snapshot"],
                                                          "sources": _plain({**own.sources(), **copy.sources()})})
    for r in out:
        assert_same(r["memory"], r["durable"], "world 2 ZeRO-1")
        assert r["memory_loss"] == r["durable_loss"]
    # Without the copy the step is incomplete: the plan falls back to the durable checkpoint.
    assert plan_restore({0: {6: own.names()}}, ranks[0]["needed"]) is None


def test_a_snapshot_one_rank_failed_to_copy_is_never_used(world2):
    base, _, _ = world2
    ranks = run_ranks("tests.memory_tier_jobs:snapshot", 2,
                      {"base": base, "layout": ZERO3, "train": 1, "run_id": "w2f", "durable": False, "state": False,
                       "fail_copy_on": 1})
    for r in ranks:
        assert r["status"] == "failed" and "rank 1: OSError: host memory copy failed (injected)" in r["reason"]
        assert r["held"] == 0 and r["needed"] == {} and r["restorable"] is None
    assert plan_restore({0: ranks[0]["holdings"], 1: ranks[1]["holdings"]}, ranks[0]["needed"]) is None


def test_a_rank_gone_mid_copy_leaves_the_step_unagreed(world2):
    base, _, _ = world2
    ranks = run_ranks("tests.memory_tier_jobs:snapshot", 2,
                      {"base": base, "layout": ZERO3, "train": 1, "run_id": "w2g", "durable": False, "state": False,
                       "die_in_copy_on": 1, "timeout_s": 20}, timeout=120)
    assert ranks[1] == {"gone": True}
    r = ranks[0]
    assert r["status"] == "failed" and "not agreed: the agreement failed" in r["reason"], r["reason"]
    assert r["held"] == 0 and r["needed"] == {} and r["restorable"] is None


def test_copies_go_to_another_node_at_world3(world2):
    base, _, _ = world2
    ranks = run_ranks("tests.memory_tier_jobs:snapshot", 3,
                      {"base": base, "layout": ZERO3, "train": 1, "run_id": "w3", "durable": False, "state": False,
                       "node_ids": ["a", "a", "b"], "budget_after": 3})
    assert all(r["status"] == "agreed" and r["replicated"] for r in ranks)
    # Ranks 0 and 1 (node a) copy to rank 2 (node b), rank 2 to rank 0: rank 1 holds no copy.
    assert [sorted(r["copies"]) for r in ranks] == [[2], [], [0, 1]]
    assert ranks[2]["held"] > ranks[0]["held"] > ranks[1]["held"] > 0
    # Node a lost (ranks 0 and 1): rank 2 alone holds the whole step.
    plan = plan_restore({2: ranks[2]["holdings"]}, ranks[2]["needed"])
    assert plan is not None and plan.step == 1
    # Node b lost (rank 2): its files are on rank 0.
    plan = plan_restore({0: ranks[0]["holdings"], 1: ranks[1]["holdings"]}, ranks[0]["needed"])
    assert plan is not None and {plan.where[n] for n in MemorySnapshot.from_bytes(ranks[2]["snapshot"]).files} == {0}
    # A budget of 3 snapshots: rank 1 (its own kept and the next) fits; ranks 0 and 2 (the copies they keep
    # and receive) do not, and one rank's refusal refuses the snapshot on every rank.
    for r in ranks:
        status, reason, held, restorable = r["again"]
        assert status == "refused" and held == r["held"] and restorable == 1
        assert "rank 0 would hold" in reason and "rank 2 would hold" in reason and "rank 1 " not in reason


def test_a_copy_whose_table_differs_from_the_receivers_is_refused():
    ranks = run_ranks("tests.memory_tier_jobs:hostile_copy", 2, {"mode": "table"}, timeout=120)
    # Rank 1's copy lists rank 0's file with another checksum: consistent in itself, not this step's table.
    assert ranks[0]["outcome"].startswith("CorruptCheckpointError: the copy of rank 1's snapshot disagrees with "
                                          "this rank's snapshot of step 1"), ranks[0]
    assert ranks[1]["outcome"].startswith("CorruptCheckpointError"), ranks[1]


def test_a_peers_announced_size_is_bounded_before_anything_is_allocated():
    ranks = run_ranks("tests.memory_tier_jobs:hostile_copy", 2, {"mode": "size"}, timeout=120)
    assert ranks[0]["outcome"].startswith(f"CorruptCheckpointError: rank 1 announced a copy of {1 << 62} bytes; "
                                          "its snapshot of step 1 takes at most"), ranks[0]


@pytest.mark.parametrize("trainer_state, why", [
    ({"step": 1, "samples_consumed": "twelve"}, "samples_consumed"),
    ({"step": 1}, "lacks samples_consumed"),
    ({"step": 5, "samples_consumed": 12}, "step is 5"),
])
def test_a_bad_trainer_state_falls_back_before_anything_is_loaded(trainer_state, why):
    (r,) = run_ranks("tests.memory_tier_jobs:bad_trainer_state", 1,
                     {"base": BASE, "run_id": "bad-state", "trainer_state": trainer_state}, timeout=120)
    assert why in r["reason"] and r["state"] == {}, r
    assert (r["step"], r["samples_consumed"]) == (0, 0)  # nothing applied: the durable checkpoint loads next


def test_a_read_that_fails_on_one_rank_sends_every_rank_to_the_durable_checkpoint():
    """Each rank reads its part of a snapshot alone (no exchange of DCP's load plans); one rank's corrupt
    file must still fail the restore on every rank, together, without a hang."""
    ranks = run_ranks("tests.memory_tier_jobs:bad_trainer_state", 2, {"base": BASE, "run_id": "bad-read",
                                                                       "flip_rank": 1}, timeout=120)
    assert "rank 1" in ranks[1]["reason"] and "crc32c" in ranks[1]["reason"].lower(), ranks[1]
    assert ranks[0]["reason"] == "another rank could not read the snapshot from memory", ranks[0]
    assert all(r["state"] == {} for r in ranks)
    # nothing applied: the durable checkpoint loads next
    assert [(r["step"], r["samples_consumed"]) for r in ranks] == [(0, 0), (0, 0)]
