"""The built-in Mixture of Experts under context parallelism (each cp rank routes its share of the sequence;
the aux loss's f_e counts the whole sequence) and pipeline parallelism (every stage's aux loss reaches
backward without being part of the last stage's loss), with and without expert parallelism: the first 5
losses within 1e-4 of world 1's, the aux loss and the routed slots of the step log equal to world 1's, the
first step's router and expert gradients within 1e-5 (fp32). World 2 in the fast tier, world 4 slow.

World 1 accumulates over micro-batches of ``train.micro_batch`` samples, and the pipeline's micro-batches are
the same ones (the local batch / train.micro_batch): the aux loss is not linear in the tokens, so only the same
micro-batches give the same aux loss.
"""

from __future__ import annotations

import pytest
from tests.harness import run_ranks
from tests.trainer.test_moe import BASE, STEPS
from tests.trainer.test_parity import check_memory

# A balancing loss large enough that training without it (or with its gradient scaled wrong) fails the check.
STRONG_AUX = [x for x in BASE if "aux_loss_coef" not in x] + ["model.aux_loss_coef=0.5"]


def world1(base: list[str]) -> dict:
    return run_ranks("tests.moe_jobs:train_moe", 1, {"base": base, "steps": STEPS, "grads": True,
                                                   "layouts": [("world1", ["parallel.zero_stage=0"])]})[0]["world1"]


def check(ranks: list[dict], one: dict, name: str, grads_on: int) -> None:
    """Every rank's losses and aux losses as world 1's; the step log's routed slots too; the first step's
    router and expert gradients, gathered from the ranks (a pipeline stage holds its own), within 1e-5 and
    ``grads_on`` of them (every MoE layer's, when the ranks hold every stage)."""
    for rank, res in enumerate(ranks):
        got = res[name]
        for step, (a, b) in enumerate(zip(got["losses"], one["losses"])):
            assert abs(a - b) <= 1e-4 * abs(b), f"{name} rank {rank} step {step + 1}: {a} vs world 1 {b}"
        assert got["aux"] == pytest.approx(one["aux"], rel=1e-5), (name, got["aux"], one["aux"])
        assert got["tokens_per_expert"][0].keys() == one["tokens_per_expert"][0].keys()
        for loads, ref in zip(got["tokens_per_expert"], one["tokens_per_expert"]):  # every slot counted once
            assert all(sum(v) == sum(ref[k]) for k, v in loads.items()), (name, loads, ref)
    grads = {n: g for res in ranks for n, g in res[name].get("grads", {}).items()}
    assert len(grads) == grads_on, (name, sorted(grads))
    for n, g in grads.items():
        diff = (g - one["grads"][n]).abs().max()
        assert diff <= 1e-5, (name, n, float(diff))


@pytest.fixture(scope="module")
def reference() -> dict:
    return world1(STRONG_AUX)


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_ranks("tests.moe_jobs:train_moe", 2, {"base": STRONG_AUX, "steps": STEPS, "grads": True, "layouts": [
        ("cp2_zero3", ["parallel.cp=2"]), ("pp2_zero0", ["parallel.pp=2", "parallel.zero_stage=0"])]})


def test_cp2_matches_world1(reference, world2):
    """cp 2 at world 2 (ZeRO-3 over dp_shard x cp: the experts are block parameters there): each rank routes
    its half of every sequence, the aux loss counts the slots of the whole sequence (all-reduced over cp),
    the step log's slots are the sequence's (summed over cp)."""
    check(world2, reference, "cp2_zero3", len(reference["grads"]))


def test_pp2_matches_world1_with_every_stages_aux_loss(reference, world2):
    """pp 2 at world 2 with a strong balancing loss: the first stage's MoE layer trains its aux loss (its
    router's gradient has it) though the loss is the last stage's, and the step log's loss and aux hold both
    stages' aux losses; the schedule's metadata inference (a forward and backward before the first step) is
    not counted."""
    assert all(a > 0.5 * 2 * 0.9 for a in reference["aux"]), reference["aux"]  # about coef x 2 layers x 1
    check(world2, reference, "pp2_zero0", len(reference["grads"]))
    assert {n.split(".")[1] for n in world2[0]["pp2_zero0"]["grads"]} == {"1"}  # stage 0 holds MoE block 1


@pytest.mark.slow
def test_cp2_ep2_and_pp2_ep2_at_world4_match_world1(reference):
    """ep 2 beside cp 2, and beside pp 2, at world 4: the experts' own FSDP units shard over the ranks outside
    ep and the cp ranks (which route different tokens through the same experts: their gradients are summed),
    divided by dp x cp; under pp every stage's aux loss trains, with recomputation and two stages a rank too."""
    one = reference
    layouts = [
        ("cp2_ep2_zero3", ["parallel.cp=2", "parallel.ep=2"]),
        ("cp2_ep2_zero1", ["parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"]),
        ("pp2_ep2_zero3_ac", ["parallel.pp=2", "parallel.ep=2", 'parallel.activation_checkpoint="full"']),
        ("pp2_ep2_interleaved", ["parallel.pp=2", "parallel.ep=2", 'parallel.pp_schedule="interleaved_1f1b"',
                                 "parallel.pp_stages_per_rank=2"]),
        ("pp2_ep2_zero0", ["parallel.pp=2", "parallel.ep=2", "parallel.zero_stage=0"])]
    four = run_ranks("tests.moe_jobs:train_moe", 4, {"base": STRONG_AUX, "steps": STEPS, "grads": True,
                                                    "layouts": layouts}, timeout=600)
    experts = sum(1 for n in one["grads"] if ".experts." in n)
    from trainer.config.load import load_config
    from trainer.observe.device_memory import predict
    from trainer.parallel.dims import ParallelDims

    for name, overrides in layouts:
        check_memory(name, four)  # the experts' FSDP shards (over dp_shard / ep x cp) beside the stage's
        cfg = load_config(None, STRONG_AUX + overrides)  # and the planner's count, from the config alone
        for rank in (0, 3):  # the first and the last stage
            assert predict(cfg, ParallelDims.from_config(cfg, 4), rank) == four[rank][name]["predicted"], name
    for name in four[0]:
        # ZeRO-1 reduces the dense gradients into shards: its experts' (FSDP's) reach the optimizer whole
        check(four, one, name, experts if "zero1" in name else len(one["grads"]))
        assert four[-1][name]["comm"]["all_to_all/ep"]["calls"] > 0  # the last stage has an MoE layer


@pytest.mark.slow
def test_tp2_beside_cp2_and_beside_pp2_at_world4_match_world1(reference):
    """tp 2 (the MoE layers whole on every tp rank) beside cp 2, and beside pp 2, at world 4: the same losses,
    aux losses, routed slots and first-step gradients as world 1."""
    layouts = [("tp2_cp2", ["parallel.tp=2", "parallel.cp=2"]),
               ("tp2_sp_pp2", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                               "parallel.zero_stage=0"])]
    four = run_ranks("tests.moe_jobs:train_moe", 4, {"base": STRONG_AUX, "steps": STEPS, "grads": True,
                                                    "layouts": layouts}, timeout=600)
    for name, _ in layouts:
        check(four, reference, name, len(reference["grads"]))


@pytest.mark.slow
def test_pp2_router_bias_balancing_matches_world1():
    """Auxiliary-loss-free balancing under pp 2: each stage moves its layers' biases as world 1 does, and the
    trainer state a checkpoint records holds every stage's biases on every rank (rank 0 writes it)."""
    base = BASE + ["model.router_bias_update_rate=0.01"]
    one = world1(base)
    two = run_ranks("tests.moe_jobs:train_moe", 2, {"base": base, "steps": STEPS, "grads": True, "layouts": [
        ("pp2_bias", ["parallel.pp=2", "parallel.zero_stage=0"])]})
    check(two, one, "pp2_bias", len(one["grads"]))
    assert set(one["router_bias"]) == {"layers.1.feed_forward", "layers.3.feed_forward"}
    for res in two:
        got = res["pp2_bias"]["router_bias"]
        assert got.keys() == one["router_bias"].keys()
        for k, v in got.items():
            assert v == pytest.approx(one["router_bias"][k], abs=1e-6), k


def test_the_planner_searches_cp_and_pp_for_moe():
    """etrain plan offers cp and pp (with ep) for the built-in MoE; a pipeline stage counts its own experts
    (a stage's compute is positive, its all-to-alls those of its MoE layers) and a cp rank routes seq_len / cp."""
    from trainer.config.load import load_config
    from trainer.parallel.dims import ParallelDims
    from trainer.plan.cost import DEVICES
    from trainer.plan.experts import all_to_all_per_step, expert_counts
    from trainer.plan.search import enumerate_layouts, evaluate
    from trainer.plan.shape import planning_config

    cfg = load_config(None, BASE + ["train.micro_batch=1"])
    layouts = enumerate_layouts(planning_config(cfg), 4)
    assert {(lay.cp, lay.ep) for lay in layouts if lay.cp == 2} == {(2, 1), (2, 2)}
    assert {(lay.pp, lay.ep) for lay in layouts if lay.pp == 2} == {(2, 1), (2, 2)}
    pp = next(lay for lay in layouts if lay.pp == 2 and lay.ep == 2)
    got = evaluate(planning_config(cfg), pp, DEVICES["cpu"])
    assert got.valid and got.time["compute_s"] > 0, got
    pp_cfg = load_config(None, BASE + ["parallel.pp=2", "parallel.ep=2"])
    dims = ParallelDims.from_config(pp_cfg, 4)
    whole = expert_counts(cfg, ParallelDims.from_config(cfg, 4))
    assert expert_counts(pp_cfg, dims, 0)["experts"] == whole["experts"] // 2  # one of the two MoE layers
    assert expert_counts(pp_cfg, dims, 0)["moe_layers"] == 1
    cp_cfg = load_config(None, BASE + ["parallel.cp=2", "parallel.ep=2"])
    cp_dims = ParallelDims.from_config(cp_cfg, 4)
    assert expert_counts(cp_cfg, cp_dims)["expert_shards"] == 4  # split by ep 2, sharded over dp_shard / ep x cp 2
    ep_cfg = load_config(None, BASE + ["parallel.ep=2"])
    full = all_to_all_per_step(ep_cfg, ParallelDims.from_config(ep_cfg, 2), 4)[0]
    assert all_to_all_per_step(cp_cfg, cp_dims, 4)[0] == pytest.approx(full / 2, rel=0.01)  # half the tokens


@pytest.mark.slow
def test_pp2_and_cp2_eval_loss_holds_every_stages_aux_loss():
    """The held-out loss of a pipelined MoE adds every stage's aux loss, as world 1's does (and cp's)."""
    evals = ["eval.every_steps=2", "eval.batches=2", "eval.val_fraction=0.1", "train.steps=2",
             "metrics.enabled=false"]
    payload = {"base": STRONG_AUX + evals, "runs": [("w1", ["parallel.zero_stage=0"])]}
    one = run_ranks("tests.eval_jobs:train_with_eval", 1, payload)[0]["w1"]
    two = run_ranks("tests.eval_jobs:train_with_eval", 2, {**payload, "runs": [
        ("pp2", ["parallel.pp=2", "parallel.zero_stage=0"]), ("cp2", ["parallel.cp=2"])]})
    ref = one["stats"][-1]["eval_loss"]
    assert ref == pytest.approx(one["again"], rel=1e-6)  # evaluation does not count routing or move anything
    for rank in two:
        for name in ("pp2", "cp2"):
            assert rank[name]["stats"][-1]["eval_loss"] == pytest.approx(ref, rel=1e-5), name
            assert rank[name]["again"] == pytest.approx(ref, rel=1e-5), name


@pytest.mark.exhaustive  # world 8; cp 2 x ep 2 at world 4 runs in the slow tier
def test_cp2_ep2_under_hsdp_at_world8_matches_world1(reference):
    """dp_replicate 2 x dp_shard 2 (ep 2) x cp 2: the experts' units replicate across dp_replicate and shard
    over dp_shard / ep x cp (a 2-D mesh of the replicas and that flattened axis)."""
    eight = run_ranks("tests.moe_jobs:train_moe", 8, {"base": STRONG_AUX, "steps": STEPS, "grads": True,
                                                     "layouts": [("hsdp_cp2_ep2", ["parallel.cp=2", "parallel.ep=2",
                                                                                   "parallel.dp_replicate=2"])]},
                      timeout=600)
    check(eight, reference, "hsdp_cp2_ep2", len(reference["grads"]))
