"""Expert parallelism trains without torch's FSDP2 "returned a view tensor ... wrong gradients" warning: the
view it warns of (the experts' output under ep) is never changed in place (trainer/models/moe.py), so the
warning does not apply and is silenced there, for that call only."""

from __future__ import annotations

import warnings

import pytest

from tests.harness import run_ranks
from tests.trainer.test_moe import BASE

VIEW_WARNING = "returned a view tensor"


def train_recording_warnings(payload: dict) -> dict:
    """Runs in each rank: a trainer of ``payload["overrides"]`` for two steps, every warning recorded."""
    from tests.jobs import CPU, trainers
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, CPU)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _, _, trainer in trainers(world, BASE, [("ep", payload["overrides"])]):
                losses = [trainer.train_step().loss for _ in range(2)]
                del trainer
        return {"losses": losses, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
    finally:
        shutdown_distributed()


@pytest.mark.slow  # two ranks of a MoE trainer: about 50 s on two shared cores
def test_ep2_trains_without_the_fsdp_view_warning():
    ranks = run_ranks("tests.trainer.test_moe_warnings:train_recording_warnings", 2,
                      {"overrides": ["parallel.ep=2"]})
    for rank, r in enumerate(ranks):
        assert len(r["losses"]) == 2
        assert not [w for w in r["warnings"] if VIEW_WARNING in w], (rank, r["warnings"])
