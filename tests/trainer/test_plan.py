"""etrain plan: the accounting against published figures, the search, the elastic plan and the command line.

Pure logic (no process group): the planner's arithmetic is compared with the ZeRO paper's, Korthikanti
et al.'s and the published Llama 3 70B layouts; measured accuracy is bench/plan_accuracy.py's job.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from checkpointing.errors import ConfigError
from trainer.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from trainer.config.load import load_config
from trainer.observe.device_memory import paper_bytes_per_param, predict
from trainer.plan.accounting import Layout, block_activation_elems, korthikanti_bytes, rank_memory
from trainer.plan.cli import main as plan_main
from trainer.plan.cli import parse_bytes, parse_workers
from trainer.plan.cost import DEVICES, step_flops
from trainer.plan.search import evaluate, plan_elastic, plan_size, resize_bytes, shard_overlap
from trainer.plan.shape import LLAMA3, model_shape

TINY = ["data.seq_len=64", "train.global_batch=12", "train.micro_batch=1"]


def llama(size: str, seq: int, global_batch: int, micro: int = 1) -> RunConfig:
    return RunConfig(model=ModelConfig(**LLAMA3[size]), data=DataConfig(seq_len=seq),
                     train=TrainConfig(global_batch=global_batch, micro_batch=micro))


# --- the seed's table and the ZeRO paper's figures ------------------------------------------------


@pytest.mark.parametrize("stage,formula", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n),
                                           (3, lambda n: 16 / n)])
def test_16p_table(stage, formula):
    for n in (1, 2, 8, 64, 1024):
        assert paper_bytes_per_param(stage, n, True) == pytest.approx(formula(n))


def test_70b_needs_1_12_tb_before_activations():
    assert 70e9 * paper_bytes_per_param(0, 1, True) == pytest.approx(1.12e12)
    shape = model_shape(llama("70b", 8192, 64))
    assert shape.n_params == pytest.approx(70.55e9, rel=1e-3)  # Meta's 70.6B for Llama 3 70B
    assert 16 * shape.n_params == pytest.approx(1.12e12, rel=0.01)


@pytest.mark.parametrize("stage,gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_7_5b_on_64_gpus(stage, gb):
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12."""
    assert 7.5e9 * paper_bytes_per_param(stage, 64, True) / 1e9 == pytest.approx(gb, abs=0.05)


def test_planner_model_states_at_zero3_are_the_papers_16p_over_n():
    cfg = llama("8b", 4096, 64)
    new, dims = Layout(1, 64, 1, 1, zero_stage=3).apply(cfg)
    mem = rank_memory(new, dims, 0, mixed=True)
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(16 / 64 * mem["param_count"], rel=1e-6)
    assert mem["param_count"] == model_shape(cfg).n_params  # pp 1, tp 1: the whole model
    assert states == sum(predict(new, dims, 0, True).values())  # trainer.observe.device_memory's own prediction, reused


# --- activations -----------------------------------------------------------------------------------


def test_korthikanti_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B, the paper's Table 3 model
    assert korthikanti_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_bytes(s, b, h, a, t, sp=True) == pytest.approx(korthikanti_bytes(s, b, h, a) / t)
    assert korthikanti_bytes(s, b, h, a, t, sp=True, recompute=True) == 2 * s * b * h / t
    # Tensor parallelism alone leaves 10 sbh unsharded (the paper's 10 + 24/t).
    assert korthikanti_bytes(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_block_activations_shrink_with_tp_sp_and_checkpointing():
    cfg = llama("8b", 4096, 64)
    one, tp8, sp8 = (block_activation_elems(cfg, t, sp) for t, sp in ((1, False), (8, False), (8, True)))
    assert one > tp8 > sp8 > one / 8
    mems = {ac: evaluate(cfg, Layout(1, 8, 8, 1, 3, True, ac, 1), DEVICES["h100"]).memory["activations"]
            for ac in ("none", "every_k", "full")}
    assert mems["none"] > mems["every_k"] > mems["full"]


# --- the search -------------------------------------------------------------------------------------


def test_layouts_are_refused_by_the_configs_own_checks():
    cfg = llama("8b", 4096, 64)
    bad = evaluate(cfg, Layout(1, 2, 3, 1), DEVICES["h100"])  # 32 heads are not divisible by 3
    assert not bad.valid and "parallel.tp=3" in bad.reason
    bad = evaluate(cfg, Layout(1, 3, 1, 1), DEVICES["h100"])  # 64 samples on 3 ranks
    assert not bad.valid and "train.global_batch=64" in bad.reason


def test_llama3_70b_on_64_h100_lands_on_the_megatron_layout_family():
    """Megatron-Bridge's Llama 3 70B pretraining preset for 64 H100s in bf16 (global batch 128, micro-batch 1,
    seq 8192): tensor parallelism inside a node with sequence parallelism, an interleaved pipeline, data
    parallelism with sharded optimizer state over the rest, no full recomputation (docs/planning.md)."""
    res = plan_size(llama("70b", 8192, 128), 64, DEVICES["h100"])
    best = res["best"].layout
    assert best.tp in (4, 8) and best.sequence_parallel
    assert best.pp > 1 and best.pp_schedule == "interleaved_1f1b"
    assert best.zero_stage >= 1 and best.dims.dp > 1 and best.ac != "full"
    assert res["best"].fits and res["runner_up"] is not None and res["losers"]
    assert all(c.reason for c in res["losers"])
    # Plain data parallelism of 70B cannot fit: the first reason a family lost.
    dp = evaluate(llama("70b", 8192, 128), Layout(1, 64, 1, 1, 0), DEVICES["h100"])
    assert not dp.fits


def test_search_of_1024_devices_is_simulator_guided():
    """Its time is bench/plan_accuracy.py's search_1024_devices_s (under 10 s)."""
    res = plan_size(llama("70b", 8192, 1024), 1024, DEVICES["h100"], budget_s=2.0)
    assert res["method"].startswith("simulator-guided") and res["best"] is not None and res["best"].fits
    assert res["best"].layout.tp <= 8  # never tensor parallelism across nodes


def test_small_spaces_are_enumerated():
    cfg = load_config(None, TINY)
    res = plan_size(cfg, 4, DEVICES["cpu"])
    assert res["method"] == "exhaustive" and res["searched"] == res["space"]


# --- elastic ----------------------------------------------------------------------------------------


def test_elastic_plan_marks_invalid_sizes_with_the_reason():
    cfg = load_config(None, TINY)
    el = plan_elastic(cfg, 1, 6, DEVICES["cpu"], budget_s=0.5)
    by = {s["world"]: s for s in el["sizes"]}
    assert el["valid"] == [1, 2, 3, 4, 6]
    assert not by[5]["valid"] and "train.global_batch=12" in by[5]["reason"]
    assert [(r["from"], r["to"]) for r in el["resizes"][:4]] == [(1, 2), (2, 3), (3, 4), (4, 6)]


def test_resize_moves_the_resharded_state():
    assert shard_overlap(4, 4) == pytest.approx(1.0)
    assert shard_overlap(2, 4) == pytest.approx(0.25)  # rank 0 keeps its first half; rank 1 holds none of its new shard
    cfg = load_config(None, TINY + ["parallel.zero_stage=3"])
    new, dims = Layout.of(cfg, 2).apply(cfg, 2)
    held = sum(v for k, v in predict(new, dims, 0, False).items() if k != "grads")  # parameters and optimizer state
    assert resize_bytes(cfg, 4, 4, DEVICES["cpu"]) == 0
    assert resize_bytes(cfg, 2, 4, DEVICES["cpu"]) == pytest.approx(2 * held * 0.75, rel=0.01)


# --- the command line -------------------------------------------------------------------------------


def test_parse_sizes_and_ranges():
    assert parse_bytes("80GiB", "--device-memory") == 80 * 2**30
    assert parse_bytes("450GB/s", "--intra-node-bw", True) == 450e9
    assert parse_workers("8..64") == (8, 64) and parse_workers("16") == (16, 16)
    with pytest.raises(ConfigError, match="--workers"):
        parse_workers("64..8")


@pytest.mark.parametrize("argv,field", [
    (["--workers", "eight"], "--workers"),
    (["--device-memory", "80XB"], "--device-memory"),
    (["--inter-node-bw", "fast"], "--inter-node-bw"),
    (["--set", "parallel.tp=3"], "parallel.tp"),
    (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--budget-s", "0"], "--budget-s"),
])
def test_bad_input_exits_2_naming_the_field(argv, field, capsys):
    assert plan_main(["examples/tiny.toml", "--device", "cpu", "--workers", "2", *argv]) == 2
    assert field in capsys.readouterr().err


def test_json_document(capsys):
    assert plan_main(["examples/tiny.toml", "--device", "cpu", "--workers", "4..6", "--json", "--explain"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"model", "device", "workers", "sizes", "resizes", "plan", "explain"}
    assert doc["model"]["params"] == model_shape(load_config("examples/tiny.toml")).n_params
    assert [s["world"] for s in doc["sizes"]] == [4, 5, 6] and not doc["sizes"][1]["valid"]
    best = doc["plan"]["best"]
    assert set(best["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "transient",
                                         "recovery_tier", "host_staging", "host_recovery_tier", "total"}
    assert set(best["time"]) >= {"compute_s", "bubble", "comm_s", "exposed_s", "step_s"}
    assert all(set(c) >= {"kind", "axis", "bytes", "link"} for c in best["comm"])
    assert doc["plan"]["runner_up"]["reason"] and doc["explain"]


def test_help_does_not_import_torch():
    code = ("import sys\nfrom orchestrator.cli.main import main\ntry:\n    main(['plan', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "--workers" in r.stdout


def test_models_of_other_sources_are_counted_on_the_meta_device():
    cfg = load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:build"',
                             "model.args.width=48", "model.args.depth=3", "data.seq_len=32"])
    shape = model_shape(cfg)
    from tests.custom_model import build

    real = build({"vocab_size": cfg.model.vocab_size, "args": {"width": 48, "depth": 3}})
    assert shape.how == "meta device" and shape.n_params == sum(p.numel() for p in real.parameters())
    assert shape.model.n_layers == 3 and shape.model.dim == 48


# --- the pre-flight warning --------------------------------------------------------------------------


def test_fit_warning_names_a_layout_that_fits():
    import torch

    from trainer.plan.fit import fit_warning

    cfg = load_config(None, ['model.preset="small"', "data.seq_len=64", "train.global_batch=8",
                             "train.micro_batch=2", "parallel.zero_stage=0"])
    cpu = torch.device("cpu")
    assert fit_warning(cfg, 4, cpu) is None  # the CPU: nothing known to check against
    assert fit_warning(cfg, 4, cpu, memory_bytes=8 * 2**30) is None
    msg = fit_warning(cfg, 4, cpu, memory_bytes=300 * 2**20)
    assert msg and "predicted to need" in msg and "predicted to fit" in msg and "set parallel." in msg
    assert "no layout" in fit_warning(cfg, 4, cpu, memory_bytes=2**20)


def test_the_fit_warning_is_printed_on_stderr_and_never_stops_a_run(capsys):
    """What python -m trainer and a Ray group's rank 0 call before the first step at each size."""
    import torch

    from trainer.plan.fit import warn_if_not_fitting

    cfg = load_config(None, ['model.preset="small"', "data.seq_len=64", "train.global_batch=8",
                             "train.micro_batch=2", "parallel.zero_stage=0"])
    msg = warn_if_not_fitting(cfg, 4, torch.device("cpu"), memory_bytes=300 * 2**20)
    assert capsys.readouterr().err == f"etrain: warning: {msg}\n" and "predicted to need" in msg
    assert warn_if_not_fitting(cfg, 3, torch.device("cpu"), memory_bytes=300 * 2**20) is None  # no plan at 3
    assert warn_if_not_fitting(cfg, 4, torch.device("cpu")) is None and capsys.readouterr().err == ""


# --- calibration ---------------------------------------------------------------------------------------


def test_calibration_is_stored_under_etrain_home_and_reused(tmp_path, monkeypatch):
    from trainer.plan.calibrate import apply, load, save, store_path
    from trainer.plan.cost import step_time

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path))
    assert load("cpu") is None
    fit = {"flops": 4e10, "bandwidth": 2e9, "latency": 5e-5, "cores": 2, "crowded_call_s": 0.004}
    assert save("cpu", fit) == store_path() and store_path().startswith(str(tmp_path))
    assert load("cpu") == fit and load("h100") is None
    dev = apply(DEVICES["cpu"], load("cpu"))
    assert dev.flops == 4e10 and dev.intra_bw == 2e9 and dev.cores == 2
    cfg = load_config(None, TINY + ["parallel.zero_stage=1"])
    new, dims = Layout.of(cfg, 4).apply(cfg, 4)
    crowded = step_time(new, dims, 0, dev)  # 4 ranks on 2 cores: each call waits for the scheduler
    calm = step_time(new, dims, 0, apply(DEVICES["cpu"], {**fit, "crowded_call_s": 1e-9}))
    calls = sum(c["calls"] for c in crowded["comm"])
    assert crowded["comm_s"] - calm["comm_s"] == pytest.approx(calls * 0.004, rel=0.01)
    # The host's rate is shared by its ranks: each of 4 ranks computes at a quarter of it.
    assert crowded["compute_s"] == pytest.approx(step_flops(new, dims, 0) / (4e10 / 4))


def test_elastic_section_gives_the_sizes_and_its_errors_exit_2(tmp_path, capsys):
    from orchestrator.cli.main import main as etrain_main

    with open("examples/tiny.toml") as f:
        base = f.read()
    good = tmp_path / "good.toml"
    good.write_text(base + "\n[elastic]\nworkers = 4\nmin_workers = 3\nmax_workers = 6\n")
    assert etrain_main(["plan", str(good), "--device", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workers"] == [3, 6] and [s["world"] for s in doc["sizes"]] == [3, 4, 5, 6]
    bad = tmp_path / "bad.toml"
    bad.write_text(base + "\n[elastic]\nmin_workers = 8\nmax_workers = 4\n")
    assert etrain_main(["plan", str(bad), "--device", "cpu"]) == 2
    assert "elastic.max_workers" in capsys.readouterr().err


def test_a_factory_model_is_offered_only_what_it_can_take():
    cfg = load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:build"',
                             "model.args.width=48", "model.args.depth=4", "data.seq_len=32", "train.global_batch=8",
                             "train.micro_batch=1"])
    from trainer.plan.shape import planning_config

    res = plan_size(planning_config(cfg), 4, DEVICES["cpu"])
    seen = [c.layout for c in [res["best"], res["runner_up"], *res["losers"]]]
    # no pipeline cut, no TP plan given
    assert all(lay.pp == 1 and lay.tp == 1 and not lay.sequence_parallel for lay in seen)
    with_plan = planning_config(load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:build"',
                                                   'model.tp_plan="tests.custom_model:tp_plan"', "data.seq_len=32"]))
    assert "tp" in with_plan.plan_allows and "pp" not in with_plan.plan_allows


def test_calibration_times_real_steps_of_the_model():
    from trainer.plan.calibrate import measure_compute

    fit = measure_compute(load_config(None, TINY), "cpu")
    assert fit["steps"] >= 2 and fit["step_seconds"] > 0 and fit["flops_per_core"] > 1e6
    assert fit["flops"] == pytest.approx(fit["step_flops"] / fit["step_seconds"] * (fit["flops"] / fit["flops_per_core"]))


def test_the_configs_own_layout_keeps_its_pipeline_micro_batches():
    """parallel.pp_microbatches is part of the layout a config asks for: its bubble and activations are
    costed with it (the search's own candidates use the automatic count)."""
    cfg = load_config(None, [*TINY, "parallel.pp=2", "parallel.pp_microbatches=4", "train.global_batch=16"])
    lay = Layout.of(cfg, 4)
    new, dims = lay.apply(cfg, 4)
    assert lay.pp_microbatches == 4 and new.parallel.pp_microbatches == 4
    assert dims.pp_microbatches(new) == 4


def test_a_layouts_settings_name_every_field_that_differs():
    """What the fit warning tells a user to set: every field of the layout the config does not ask for,
    interleaving's stages per rank with its schedule; dp_shard only when the config fixes it."""
    cfg = load_config(None, TINY)
    lay = Layout(1, 2, 1, 2, 1, False, "full", 1, "interleaved_1f1b", 2)
    assert lay.settings(cfg, 4) == ('parallel.pp=2 parallel.zero_stage=1 parallel.activation_checkpoint="full" '
                                    'parallel.pp_schedule="interleaved_1f1b" parallel.pp_stages_per_rank=2')
    fixed = load_config(None, [*TINY, "parallel.dp_shard=4"])
    assert "parallel.dp_shard=2" in lay.settings(fixed, 4)
    assert Layout.of(fixed, 4).settings(fixed, 4) == ""


def test_a_transformers_model_is_offered_what_training_accepts(tmp_path):
    """A Llama laid out as etrain cuts pipelines from, with its HF tensor-parallel plan: TP and PP; the same
    model with tied embeddings: neither (python -m trainer refuses both for it). Both take context
    parallelism (their attention routes through etrain's, trainer.models.hf.cp)."""
    from transformers import LlamaConfig

    from trainer.plan.shape import planning_config

    allows = {}
    for tied in (False, True):
        path = tmp_path / f"tied-{tied}"
        LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=tied).save_pretrained(path)
        cfg = load_config(None, ['model.source="hf"', f'model.hf_config="{path}"', "data.seq_len=32"])
        allows[tied] = set(planning_config(cfg).plan_allows)
    assert allows == {False: {"tp", "pp", "cp"}, True: {"cp"}}


def test_the_random_search_and_the_enumeration_share_one_canonical_form():
    """Every layout the exhaustive enumeration yields is canonical for the annealing's _normalize, and a
    replicated mesh below ZeRO-3 folds into one flat data-parallel axis, as the enumeration leaves it out."""
    from trainer.plan.search import _normalize, enumerate_layouts

    cfg = load_config(None, TINY)
    layouts = enumerate_layouts(cfg, 8)
    assert layouts and all(_normalize(cfg, lay) == lay for lay in layouts)
    assert _normalize(cfg, Layout(2, 2, 2, 1, 1)) == Layout(1, 4, 2, 1, 1)
