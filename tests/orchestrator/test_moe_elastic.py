"""``parallel.ep = 0``: each size takes its own expert-parallel degree (ParallelDims.expert_degree), the one rule
the trainer, the orchestrator's valid sizes and the planner ask; a fixed ep keeps its refusals. Pure logic;
the Ray run that resizes across ep is tests/orchestrator/test_chaos_moe.py."""

from __future__ import annotations

import pytest

from checkpointing.errors import ConfigError
from tests.trainer.test_moe import BASE
from trainer.config.load import load_config
from trainer.parallel.dims import ParallelDims, valid_world_sizes

# 4 experts, a global batch of 24 samples one at a time: every world size up to 8 but 5 and 7.
AUTO = BASE + ["parallel.ep=0", "train.global_batch=24", "train.micro_batch=1"]


@pytest.mark.parametrize("extra, eps", [
    ([], {1: 1, 2: 2, 3: 1, 4: 4, 6: 2, 8: 4}),  # the largest divisor of dp_shard that divides 4
    (["model.n_experts=6"], {1: 1, 2: 2, 3: 3, 4: 2, 6: 6, 8: 2}),
    (["parallel.dp_replicate=2"], {2: 1, 4: 2, 6: 1, 8: 4}),  # carved from dp_shard = world / 2
])
def test_auto_ep_is_the_largest_divisor_of_dp_shard_and_the_experts(extra, eps):
    cfg = load_config(None, AUTO + extra)
    assert {w: ParallelDims.from_config(cfg, w).ep for w in eps} == eps
    assert valid_world_sizes(cfg, 8) == [w for w in (1, 2, 3, 4, 6, 8) if w % cfg.parallel.dp_replicate == 0]


def test_auto_ep_serves_every_size_a_fixed_ep_refuses():
    """ep 2 refuses odd groups; ep 0 takes them (at ep 1), in the orchestrator's range check too."""
    from orchestrator.config import ElasticConfig, allowed_sizes, check_sizes

    fixed = load_config(None, AUTO[:-3] + ["parallel.ep=2", "train.global_batch=24", "train.micro_batch=1"])
    auto = load_config(None, AUTO)
    assert allowed_sizes(fixed, 1, 4) == [2, 4]
    assert allowed_sizes(auto, 1, 4) == [1, 2, 3, 4]
    assert check_sizes(auto, ElasticConfig(workers=3, min_workers=3, max_workers=3)) == [3]
    with pytest.raises(ConfigError, match=r"at size 3, parallel\.ep=2 is carved from dp_shard=3 .* or "
                                          r"parallel\.ep=0 \(the largest that fits each size\)"):
        check_sizes(fixed, ElasticConfig(workers=3, min_workers=3, max_workers=3))
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 is carved from dp_shard=3 .* or parallel\.ep=0"):
        ParallelDims.from_config(fixed, 3)


def test_auto_ep_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"parallel\.ep=-1 must be >= 1, or 0 to choose it at each size"):
        load_config(None, BASE + ["parallel.ep=-1"])
    with pytest.raises(ConfigError, match=r"parallel\.ep=0 splits the experts .* the model has none"):
        load_config(None, ["parallel.ep=0"])


def test_auto_ep_is_refused_for_a_transformers_moe(tmp_path):
    """A transformers config keeps its expert count to itself: ep must be given."""
    from tests.trainer.test_hf_moe import MIXTRAL, write
    from tests.trainer.test_models import TRAIN, hf
    from trainer.models import spec_for

    cfg = load_config(None, TRAIN + hf(write(tmp_path, MIXTRAL)) + ["parallel.ep=0"])
    with pytest.raises(ConfigError, match=r"parallel\.ep=0 \(automatic\) is for the built-in MoE"):
        spec_for(cfg.model).check_moe(cfg)


def test_the_planner_reports_the_ep_each_size_takes(capsys):
    """`etrain plan` costs the config's layout at each size with that size's ep, and keeps the search to it."""
    from trainer.plan.accounting import Layout
    from trainer.plan.cli import main as plan_main
    from trainer.plan.cost import DEVICES
    from trainer.plan.search import plan_size

    cfg = load_config(None, AUTO)
    assert [Layout.of(cfg, w).ep for w in (1, 2, 3, 4)] == [1, 2, 1, 4]
    assert plan_size(cfg, 4, DEVICES["cpu"], budget_s=0.5, fixed_mp=True, losers=0)["best"].layout.ep == 4
    code = plan_main(["--workers", "1..4", "--device", "cpu", "--budget-s", "0.5",
                      *[a for o in AUTO for a in ("--set", o)], "examples/tiny.toml"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.split("sizes (")[1].splitlines()[1:5]
    assert [line.split(",")[0].split() for line in lines] == [["1", "ep", "1"], ["2", "ep", "2"], ["3", "ep", "1"],
                                                              ["4", "ep", "4"]], out
