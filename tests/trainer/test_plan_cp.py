"""etrain plan with context parallelism: activations divided by cp, the cp styles' traffic, the search over cp and
cp_style, --explain's forced-CP line, the command line (pure logic, no process group)."""

from __future__ import annotations

import json

import pytest

from trainer.config.load import load_config
from trainer.plan.accounting import Layout, rank_memory
from trainer.plan.cli import main as plan_main
from trainer.plan.comm import step_comm
from trainer.plan.cost import DEVICES, custom, step_flops
from trainer.plan.explain import context_parallel_line
from trainer.plan.search import enumerate_layouts, evaluate, plan_elastic, plan_size
from trainer.plan.shape import planning_config

LAYERS, SEQ = 4, 1024  # the tiny preset: dim 128, 4 heads (as many K/V heads)
BASE = [f"data.seq_len={SEQ}", f"model.max_seq_len={SEQ}", "train.global_batch=4", "train.micro_batch=1"]
# One head: no tensor parallelism and no ulysses; at seq 32768 one sample's activations need 567 MiB at best
# without cp on 2 ranks (pp 2, full checkpointing), 342 MiB at cp 2.
ONE_HEAD = ["model.n_heads=1", "model.n_kv_heads=1", "data.seq_len=32768", "model.max_seq_len=32768",
            "train.global_batch=4", "train.micro_batch=1"]


def cfg_of(*over: str):
    return planning_config(load_config(None, [*BASE, *over]))


def memory(cfg, layout: Layout) -> dict:
    new, dims = layout.apply(cfg)
    return rank_memory(new, dims, 0, mixed=False)


def test_activations_and_compute_divide_by_cp():
    cfg = cfg_of()
    one = memory(cfg, Layout(1, 1, 1, 1, 0))
    for n in (2, 4):
        got = memory(cfg, Layout(1, 1, 1, 1, 0, cp=n))
        assert got["activations"] == pytest.approx(one["activations"] / n)
        assert got["logits"] == pytest.approx(one["logits"] / n)
        new1, d1 = Layout(1, 1, 1, 1, 0).apply(cfg)
        new, d = Layout(1, 1, 1, 1, 0, cp=n).apply(cfg)
        assert step_flops(new, d, 0) == pytest.approx(step_flops(new1, d1, 0) / n)
    # allgather holds every rank's K/V while a block attends: more workspace than the ring's two blocks
    ring, gather = (memory(cfg, Layout(1, 1, 1, 1, 0, cp=4, cp_style=s))["workspace"] for s in ("ring", "allgather"))
    assert gather > ring


def cp_entries(cfg, layout: Layout) -> dict:
    new, dims = layout.apply(cfg)
    return {c["kind"]: c for c in step_comm(new, dims, 0, mixed=False) if c["axis"] == "cp"}


@pytest.mark.parametrize("n", [2, 4])
def test_cp_traffic_per_style_matches_the_collectives_counted_in_training(n):
    """The formulas tests/trainer/test_context_parallel.py checks against real gloo runs, per layer and micro-batch
    (micro-batches per rank: global batch 4 at dp 1), as volumes one rank sends: E = one rank's q, kv its K and V."""
    cfg = cfg_of()
    mb = 4
    e = SEQ // n * 128 * 4
    kv = 2 * e
    per = LAYERS * mb
    ring = cp_entries(cfg, Layout(1, 1, 1, 1, 0, cp=n, cp_style="ring"))
    assert set(ring) == {"send_recv"}
    assert (ring["send_recv"]["calls"], ring["send_recv"]["bytes"]) == (per * (3 * n - 2), per * kv * (3 * n - 2))
    gather = cp_entries(cfg, Layout(1, 1, 1, 1, 0, cp=n, cp_style="allgather"))
    assert {k: (c["calls"], c["bytes"]) for k, c in gather.items()} == {
        "all_gather": (per, per * (n - 1) * kv), "reduce_scatter": (per, per * (n - 1) * kv)}
    a2a = cp_entries(cfg, Layout(1, 1, 1, 1, 0, cp=n, cp_style="ulysses"))["all_to_all"]
    assert (a2a["calls"], a2a["bytes"]) == (4 * per, round(per * (n - 1) / n * 8 * e))
    # full checkpointing repeats the forward's exchanges
    full = cp_entries(cfg, Layout(1, 1, 1, 1, 0, False, "full", cp=n))["send_recv"]
    assert full["calls"] == per * (4 * n - 3)


def test_zero_shards_over_dp_shard_x_cp():
    cfg = cfg_of()
    new, dims = Layout(1, 2, 1, 1, 3, cp=2).apply(cfg)
    got = {(c["kind"], c["axis"]): c["ranks"] for c in step_comm(new, dims, 0, mixed=False)}
    assert got[("all_gather", "dp_shard_cp")] == got[("reduce_scatter", "dp_shard_cp")] == 4
    new, dims = Layout(1, 2, 1, 1, 0, cp=2).apply(cfg)
    assert {(c["kind"], c["axis"], c["ranks"]) for c in step_comm(new, dims, 0, False)} >= {("all_reduce", "dp_cp", 4)}


def test_search_covers_cp_and_its_styles_only_where_the_trainer_takes_them():
    layouts = enumerate_layouts(cfg_of(), 4)
    with_cp = [x for x in layouts if x.cp > 1]
    assert {(x.cp, x.cp_style) for x in with_cp} == {(c, s) for c in (2, 4) for s in ("ring", "allgather", "ulysses")}
    assert any(x.tp == 2 for x in with_cp) and any(x.pp == 2 for x in with_cp)  # cp x tp, cp x pp
    assert {x.zero_stage for x in with_cp} == {0, 1, 2, 3}  # every stage shards over dp_shard x cp
    assert all(evaluate(cfg_of(), x, DEVICES["h100"]).valid for x in with_cp[:50])
    one_head = enumerate_layouts(planning_config(load_config(None, ONE_HEAD)), 4)
    assert {x.cp_style for x in one_head if x.cp > 1} == {"ring", "allgather"}  # ulysses splits heads
    # seq 1026 does not split into 2 x cp chunks for cp 2 or 4
    assert all(x.cp == 1 for x in enumerate_layouts(cfg_of("data.seq_len=1026", "model.max_seq_len=1026"), 4))


def test_the_plan_picks_cp_when_one_sample_does_not_fit_otherwise():
    cfg = planning_config(load_config(None, ONE_HEAD))
    dev = custom(DEVICES["cpu"], memory=480 * 2**20)
    res = plan_size(cfg, 2, dev)
    assert res["best"] is not None and res["best"].layout.cp == 2 and res["best"].fits
    line = context_parallel_line(cfg, 2, dev)
    assert line.startswith("Context parallelism is forced") and "parallel.cp=2" in line, line
    roomy = context_parallel_line(cfg, 2, custom(DEVICES["cpu"], memory=64 * 2**30))
    assert roomy.startswith("Context parallelism is not forced"), roomy


def test_elastic_sizes_keep_the_configs_cp():
    cfg = cfg_of("parallel.cp=2", 'parallel.cp_style="ulysses"', "parallel.zero_stage=3")
    el = plan_elastic(cfg, 1, 4, DEVICES["h100"], budget_s=0.5)
    assert el["valid"] == [2, 4]
    assert all(s["best"].layout.cp == 2 for s in el["sizes"] if s["valid"])
    assert not el["sizes"][0]["valid"] and "parallel.cp=2" in el["sizes"][0]["reason"]


def test_cli_plans_a_cp_run_with_explain(capsys):
    argv = ["examples/tiny.toml", *sum((["--set", s] for s in ONE_HEAD + ["parallel.cp=2"]), []),
            "--device", "cpu", "--device-memory", "480MiB", "--workers", "2", "--explain", "--json"]
    assert plan_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["config_layout"]["layout"]["cp"] == 2  # no checkpointing: does not fit
    assert doc["plan"]["best"]["fits"] and doc["plan"]["best"]["layout"]["ac"] != "none"
    assert doc["plan"]["best"]["layout"]["cp"] == 2
    assert any(c["axis"] == "cp" for c in doc["plan"]["best"]["comm"])
    assert any(line.startswith("Context parallelism is forced") for line in doc["explain"])


def test_settings_name_cp_fields_only_where_they_change():
    cfg = cfg_of("parallel.cp=2", 'parallel.cp_style="ulysses"')
    assert Layout(1, 4, 1, 1, 3, cp=1).settings(cfg, 4) == "parallel.cp=1"
    assert Layout(1, 1, 1, 1, 3, cp=4, cp_style="ring").settings(cfg, 4) == 'parallel.cp=4 parallel.cp_style="ring"'
