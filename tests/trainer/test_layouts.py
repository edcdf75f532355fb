"""Layouts that cannot train are refused before any process group starts; activation checkpointing
recomputes what it claims and holds less.

Refusals call ``python -m trainer``'s ``main`` in this process with the launcher's environment
(WORLD_SIZE, RANK, a MASTER_PORT nobody listens on: reaching the process group would hang or fail,
not exit 2). Activation checkpointing trains on one process (tests.jobs.ac_probe).
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from trainer.cli import main

# (world size, overrides, what the message must say: the field, and the nearest layout that works)
REFUSED = {
    "world_not_multiple_of_tp_pp": (6, ["parallel.tp=2", "parallel.pp=2"],
                                    "world size 6 is not a multiple of parallel.dp_replicate=1 x parallel.tp=2 "
                                    "x parallel.pp=2 = 4; run on 4, 8, 12, 16 processes"),
    "dp_shard_does_not_fill_world": (8, ["parallel.tp=2", "parallel.dp_shard=2"],
                                     "= 4, but the world size is 8; set parallel.dp_shard=-1"),
    "batch_not_divisible_by_dp": (4, ["train.global_batch=6", "train.micro_batch=2"],
                                  "train.global_batch=6 is not divisible by data-parallel size 4 x "
                                  "train.micro_batch=2; data-parallel sizes that work: 1, 3"),
    "pipeline_microbatches_do_not_divide_batch": (4, ["parallel.pp=2", "parallel.pp_microbatches=3"],
                                                  "parallel.pp_microbatches=3 does not divide the local batch 4"),
    "1f1b_with_fewer_microbatches_than_stages": (4, ["parallel.pp=2", "train.micro_batch=4"],
                                                 "needs at least pp=2 micro-batches, got 1"),
    "interleaved_microbatches_not_multiple_of_pp": (2, ["parallel.pp=2", 'parallel.pp_schedule="interleaved_1f1b"',
                                                        "parallel.pp_stages_per_rank=2", "train.global_batch=6",
                                                        "train.micro_batch=2"],
                                                    "needs the micro-batch count (3) to be a multiple of pp=2"),
    "sequence_parallel_uneven_sequence": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=63"],
                                          "splits every sample's data.seq_len=63 positions evenly across "
                                          "parallel.tp=2 ranks; use data.seq_len=62 or 64"),
    "offload_without_data_parallelism": (4, ["parallel.tp=2", "parallel.pp=2", 'parallel.offload="cpu"'],
                                         "has a data-parallel size of 1 at world size 4 (tp=2 x pp=2); run on 8 "
                                         'processes with parallel.dp_shard=-1, or set parallel.offload="none"'),
    # Refused by the config itself, at any world size.
    "sequence_parallel_without_tp": (2, ["parallel.sequence_parallel=true"],
                                     "parallel.sequence_parallel=true needs parallel.tp > 1"),
    "offload_below_zero_3": (4, ['parallel.offload="cpu"', "parallel.zero_stage=2"],
                             'parallel.offload="cpu" needs parallel.zero_stage=3'),
    "tp_not_dividing_heads": (4, ["parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=4; use 1, 2 or 4"),
    "more_stages_than_layers": (8, ["parallel.pp=8"], "pipeline stages exceed model.n_layers=4"),
    "stages_per_rank_without_interleaving": (4, ["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
                                             'needs parallel.pp_schedule="interleaved_1f1b"'),
    "interleaving_one_stage_per_rank": (4, ["parallel.pp=2", 'parallel.pp_schedule="interleaved_1f1b"'],
                                        "needs parallel.pp_stages_per_rank >= 2"),
    "interleaving_without_a_pipeline": (2, ['parallel.pp_schedule="interleaved_1f1b"', "parallel.pp_stages_per_rank=2"],
                                        'parallel.pp_schedule="interleaved_1f1b" needs parallel.pp > 1 (got pp=1)'),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_layout_exits_2_with_the_reason(name, monkeypatch, capsys):
    world, overrides, message = REFUSED[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    argv = [a for o in ["data.max_bytes=100000", *overrides] for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("etrain: invalid config: ") and message in err, err
    assert "Traceback" not in err


AC_BASE = ["data.max_bytes=2000000", "data.seq_len=128", "train.global_batch=8", "train.micro_batch=4",
           "train.warmup_steps=0"]
AC_MODES = {
    "none": [],
    "full": ['parallel.activation_checkpoint="full"'],
    "every_2": ['parallel.activation_checkpoint="every_k"', "parallel.ac_every_k=2"],
    "every_3": ['parallel.activation_checkpoint="every_k"', "parallel.ac_every_k=3"],
}


@pytest.fixture(scope="module")
def ac():
    return run_ranks("tests.jobs:ac_probe", 1, {"base": AC_BASE, "steps": 2, "modes": list(AC_MODES.items())})[0]


def test_checkpointed_blocks_run_forward_twice(ac):
    """One micro-batch's forward and backward: a checkpointed block is recomputed in backward (its
    attention runs twice), every block under "full", blocks 0, k, 2k, ... under "every_k"."""
    assert ac["none"]["calls"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert ac["full"]["calls"] == {"0": 2, "1": 2, "2": 2, "3": 2}
    assert ac["every_2"]["calls"] == {"0": 2, "1": 1, "2": 2, "3": 1}
    assert ac["every_3"]["calls"] == {"0": 2, "1": 1, "2": 1, "3": 2}


def test_checkpointing_holds_less_and_peaks_lower(ac):
    """Bytes that forward leaves for backward, and the peak over forward and backward (micro-batch 4 x
    128 tokens of the tiny model): each fewer with more blocks checkpointed."""
    held = {m: ac[m]["held"] for m in AC_MODES}
    peak = {m: ac[m]["peak"] for m in AC_MODES}
    assert held["full"] < held["every_2"] == held["every_3"] < held["none"], held  # 2 of 4 blocks each
    assert held["full"] < 0.5 * held["none"], held
    assert peak["full"] < peak["every_2"] < peak["none"], peak
    assert peak["full"] < 0.75 * peak["none"], peak


def test_checkpointing_keeps_the_math(ac):
    """Recomputation is the same arithmetic: the losses are identical, bit for bit."""
    for mode in AC_MODES:
        assert ac[mode]["losses"] == ac["none"]["losses"], mode


def test_sequence_parallel_dropout_is_the_whole_sequences_draw():
    """Under sequence parallelism each tp rank drops out its slice of the mask drawn for the whole
    sequence (every tp rank is seeded alike), so the result is F.dropout's on the CPU, whatever tp."""
    import torch
    import torch.nn.functional as F

    from trainer.config import ModelConfig
    from trainer.models.decoder.model import Block

    block = Block(ModelConfig(dropout=0.25))
    h = torch.randn(2, 8, 128)
    torch.manual_seed(7)
    whole = F.dropout(h, 0.25)
    for n in (2, 4):
        parts = []
        for rank in range(n):
            block.seq_shard = (rank, n)
            torch.manual_seed(7)
            parts.append(block._dropout(h[:, rank * 8 // n : (rank + 1) * 8 // n]))
        assert torch.equal(torch.cat(parts, dim=1), whole), n
