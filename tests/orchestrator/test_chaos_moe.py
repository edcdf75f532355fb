"""Chaos on a Mixture of Experts whose expert-parallel degree follows its size (``parallel.ep = 0``), on the
session's real Ray cluster on 127.0.0.1 (tests/conftest.py: a head and three 1-CPU worker nodes).

The built-in MoE (moe-tiny with 4 experts) starts on 2 workers (ep 2) with a memory-tier snapshot every step;
a worker is killed and the survivor goes on alone at once (ep 1), restored from memory across ep with at most
the step in flight lost; when the replacement worker is up the run resizes back to 2 (ep 2), again from
memory. The run must pass the chaos oracle against a
failure-free run of the same config: every step once with the data cursor exact, the loss within
tolerance, every commit verifying, no committed step lost.
"""

from __future__ import annotations

import json
import uuid

import pytest

from checkpointing.manager import CheckpointManager
from orchestrator.chaos.cli import judge
from tests.cluster import GLOBAL_BATCH, reference_run, start_run
from tests.orchestrator.test_chaos import drive, use_reference

pytestmark = pytest.mark.ray

STEPS = 48
# 4 experts: ep 2 at 2 workers, ep 1 at 1 (ParallelDims.expert_degree). Two samples a micro-batch (1 or 2
# workers split the global batch of 12). Steps enough for a replacement worker to start (half a minute on
# two shared cores) while one worker trains. The first step after a re-formation is slow on two shared
# cores; this test is not about hangs.
MOE = ['model.preset="moe-tiny"', "model.n_experts=4", "parallel.ep=0", f"train.steps={STEPS}",
       "train.micro_batch=2", "recovery.memory_every_steps=1", "elastic.hang_timeout_s=30"]


@pytest.fixture(scope="module")
def moe_reference(ray_cluster, tmp_path_factory):
    """The failure-free run of the same config at 2 workers (ep 2)."""
    return reference_run(f"file://{tmp_path_factory.mktemp('moe-ref')}/runs", *MOE)


def test_moe_worker_killed_and_regrown_across_ep_passes_the_oracle(ray_cluster, moe_reference, tmp_path):
    root = f"file://{tmp_path}/runs"
    run, st = start_run(root, *MOE, workers=2, min_workers=1, max_workers=2, run_id=f"moe-{uuid.uuid4().hex[:6]}")
    run_id = run.spec.run_id
    plan, chaos, final = drive(run, st, '[[fault]]\nkind = "kill_worker"\nat_step = 6\nrank = 1\n', tmp_path,
                               timeout_s=500)
    result = judge(run_id, st, plan, chaos, final, use_reference(st, moe_reference, f"{run_id}-ref"))
    assert result["passed"], json.dumps(result, indent=1, default=str)
    assert result["faults_recovered"] == 1 and result["committed_steps_lost"] == 0, result

    events = st.events(run_id)
    formed = [e for e in events if e["kind"] == "formed"]
    (rec,) = [e for e in events if e["kind"] == "recovered"]
    (resized,) = [e for e in events if e["kind"] == "resized"]
    # The kill: the survivor goes on alone at once (ep 2 -> 1), restored from the memory tier (its own snapshot
    # and the copy of the dead rank's it held), at most the step in flight lost.
    assert rec["tier"] == "memory" and rec["steps_lost"] <= 1, rec
    assert (rec["world_before"], rec["world_after"]) == (2, 1), rec
    # The resize: back to 2 workers once the replacement is up (ep 1 -> 2), the ep-1 snapshot restored from
    # memory onto the new rank, no step lost.
    assert (resized["from_workers"], resized["to_workers"]) == (1, 2) and resized["tier"] == "memory", resized
    assert [(e["world_size"], e["ep"], e["tier"]) for e in formed] == [(2, 2, "none"), (1, 1, "memory"),
                                                                        (2, 2, "memory")], formed
    assert final["steps_lost"] == rec["steps_lost"] and final["resizes"] == 1
    mgr = CheckpointManager(root, run_id)
    assert mgr.read_manifest(STEPS).trainer_state["samples_consumed"] == STEPS * GLOBAL_BATCH
    failure = next(e for e in events if e["kind"] == "failure")
    print(f"\nMoE chaos: kill at step {failure['step']} -> recovered at 1 worker (ep 1) "
          f"from {rec['tier']} in {rec['time_to_recover_s']} s, {rec['steps_lost']} step lost; resize 1 -> 2 "
          f"(ep 2) from {resized['tier']} at step {resized['step']}, {resized['resize_s']} s from request to first "
          f"step; max loss rel diff {result['max_loss_rel_diff']:.2e}")
