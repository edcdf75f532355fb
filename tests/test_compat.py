"""trainer.compat: etrain on what each supported torch (2.11, 2.12, 2.13) provides.

torch 2.13 added ``torch.distributed.all_gather_single`` and ``reduce_scatter_single`` (and deprecated
``all_gather_into_tensor`` and ``reduce_scatter_tensor``, the only names 2.11 and 2.12 have). ZeRO 1 and
2 train at world 2 with the 2.13 names hidden from ``torch.distributed``, as on 2.11 and 2.12, and must
train bit for bit as with them, the communication meter counting the same collectives. On 2.11 both runs
take the old names; ``make test-compat`` runs this file there, and the rest of the compat subset
(``-m compat``: layouts, checkpoints, the memory tier, an HF model, export).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.harness import run_ranks

NEW = ("all_gather_single", "reduce_scatter_single")  # torch >= 2.13 only
BASE = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "data.max_bytes=60000", "data.seq_len=16",
        "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=0", "parallel.bucket_mb=0.01"]
LAYOUTS = [("zero1", ["parallel.zero_stage=1"]), ("zero2", ["parallel.zero_stage=2"]),
           ("zero2_bf16", ["parallel.zero_stage=2", 'parallel.mixed_precision="bf16"'])]


def train_hiding(payload: dict) -> dict:
    """tests.jobs.train_layouts with the names ``payload["hide"]`` removed from ``torch.distributed``
    meanwhile (put back after: the rank processes serve later jobs)."""
    from tests.jobs import train_layouts

    hidden = {name: getattr(dist, name) for name in payload["hide"] if hasattr(dist, name)}
    for name in hidden:
        delattr(dist, name)
    try:
        return train_layouts(payload)
    finally:
        for name, fn in hidden.items():
            setattr(dist, name, fn)


@pytest.mark.compat
def test_zero_1_and_2_train_alike_without_the_collectives_torch_2_13_added():
    payload = {"base": BASE, "steps": 3, "layouts": [*LAYOUTS, ("zero0", ["parallel.zero_stage=0"])]}
    new = run_ranks("tests.test_compat:train_hiding", 2, {**payload, "hide": []})
    old = run_ranks("tests.test_compat:train_hiding", 2, {**payload, "hide": list(NEW)})
    for rank in range(2):
        for name, _ in LAYOUTS:
            assert old[rank][name]["losses"] == new[rank][name]["losses"], name
            for kind in ("all_gather", "reduce_scatter"):
                calls = new[rank][name]["comm"][f"{kind}/dp_shard"]["calls"]
                assert calls > 1, (name, kind)  # bucket by bucket
                assert old[rank][name]["comm"][f"{kind}/dp_shard"]["calls"] == calls, (name, kind)
    # And right: ZeRO 0 all-reduces whole gradients, with neither collective.
    for name in ("zero1", "zero2"):
        assert old[0][name]["losses"] == pytest.approx(old[0]["zero0"]["losses"], rel=1e-5), name
