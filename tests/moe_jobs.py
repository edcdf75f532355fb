"""Mixture-of-Experts functions run inside real process groups (tests.harness.run_ranks)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from tests.jobs import CPU, comm_per_step, trainers
from trainer.world import World, init_distributed, shutdown_distributed


def train_moe(payload: dict) -> dict:
    """Each layout of ``payload["layouts"]`` for ``payload["steps"]`` steps: its losses, aux losses,
    imbalance ratios and (``payload["params"]``, world 1) the trained parameters."""
    from trainer.observe.telemetry import comm_meter

    meter = comm_meter()
    meter.enabled = True
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, _, trainer in trainers(world, payload["base"], payload["layouts"]):
            grads = capture_first_grads(trainer) if payload.get("grads") else {}
            meter.name_axes(trainer.mesh)
            before = meter.snapshot()
            stats = [trainer.train_step() for _ in range(payload["steps"])]
            out[name] = {"losses": [s.loss for s in stats], "aux": [s.aux_loss for s in stats],
                         "grad_norms": [s.grad_norm for s in stats],
                         "imbalance": [s.moe_imbalance for s in stats],
                         "tokens_per_expert": [s.moe_tokens_per_expert for s in stats],
                         "dropped": [s.moe_dropped for s in stats],
                         "comm": comm_per_step(meter, before, payload["steps"]),
                         "memory": trainer.memory_measured, "predicted": trainer.memory_predicted()}
            if grads:
                out[name]["grads"] = grads
            out[name]["experts"] = experts_held(trainer)
            out[name]["router_bias"] = trainer.train_state().get("router_bias")  # what a checkpoint records
            if payload.get("params"):
                out[name]["params"] = {n: p.detach().clone() for n, p in trainer.parts.named_parameters()}
            del trainer
        return out
    finally:
        shutdown_distributed()


def capture_first_grads(trainer) -> dict:
    """Filled at the first optimizer step: the averaged gradient of every router and expert weight, as the
    optimizer receives it (whole tensors: ZeRO 0)."""
    grads: dict = {}
    step = trainer.optimizer.step

    def first(lr, coef):
        if not grads:
            for n, p in trainer.parts.named_parameters():
                dense_whole = trainer.dims.zero_stage in (0, 3)  # else the stage's unreduced local gradient
                if (".experts." in n or (".router." in n and dense_whole)) and p.grad is not None:
                    g = p.grad.detach()  # ZeRO-3 (and ep): a shard, gathered whole on every rank
                    grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
        return step(lr, coef)

    trainer.optimizer.step = first
    return grads


def experts_held(trainer) -> dict:
    """The first MoE layer's first expert weight on this rank (the built-in ``w1``, transformers'
    ``gate_up_proj``): its placement over the ep dimension, the first expert and the number of experts this
    rank computes ({} without expert parallelism)."""
    for _, p in trainer.parts.named_parameters():
        names = list(getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names or ())
        if isinstance(p, DTensor) and "ep" in names:
            chunk = p.__create_chunk_list__()[0]  # where this rank's block sits in the global tensor, as DCP sees it
            return {"placement": repr(p.placements[names.index("ep")]), "first": chunk.offsets[0],
                    "n": chunk.sizes[0]}
    return {}


def assert_matches_world1(ranks: list[dict], one: dict, loss_tol: float = 1e-4, grad_tol: float = 1e-5) -> None:
    """Every layout of every rank of ``ranks`` (train_moe's results) against world 1's ``one``: its losses
    within ``loss_tol`` (relative) and the first step's expert (and router) gradients it captured within
    ``grad_tol``, with at least one expert gradient among them."""
    for rank, res in enumerate(ranks):
        for name, got in res.items():
            assert any(".experts." in n for n in got["grads"]), (name, list(got["grads"]))
            for n, g in got["grads"].items():
                diff = (g - one["grads"][n]).abs().max()
                assert diff <= grad_tol, (name, rank, n, diff)
            assert len(got["losses"]) == len(one["losses"])
            for step, (a, b) in enumerate(zip(got["losses"], one["losses"])):
                assert abs(a - b) <= loss_tol * abs(b), f"{name} rank {rank} step {step + 1}: {a} vs world 1 {b}"
