"""The Python API (``import etrain``): train in this process, or submit an elastic run to Ray and drive it.

The Ray tests use the session's real cluster (tests/conftest.py) and a Hugging Face Llama built from a
config written here: a killed worker recovers and the run passes the chaos oracle against a
failure-free run of the same model submitted through the same API.
"""

from __future__ import annotations

import json
import uuid

import pytest

import etrain
from tests.cluster import RUN_BASE
from tests.trainer.test_models import LLAMA

SMALL = {"data": {"seq_len": 32, "max_bytes": 300000}, "train": {"steps": 4, "global_batch": 4, "micro_batch": 2,
                                                               "log_every": 100},
         "metrics": {"enabled": False}}


def test_train_a_dict_config_in_this_process(tmp_path):
    result = etrain.train(SMALL, overrides=["train.lr=1e-3"], quiet=True, log_file=str(tmp_path / "steps.jsonl"))
    assert result.step == 4 and result.loss < result.first_loss
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == result.loss


def test_train_a_runconfig_and_resume_it(tmp_path):
    from trainer.config.load import config_from_dict

    cfg = config_from_dict({**SMALL, "run_id": "api", "checkpoint": {"url": f"file://{tmp_path}/ck"}})
    first = etrain.train(cfg, quiet=True)
    more = etrain.train(cfg, overrides=["train.steps=6"], resume=True, quiet=True)
    assert first.step == 4 and more.step == 6
    with pytest.raises(etrain.ConfigError, match="committed checkpoints"):
        etrain.train(cfg, quiet=True)  # a fresh start over committed checkpoints is refused


@pytest.mark.parametrize("config,message", [
    ({"train": {"steps": 0}}, "train.steps=0 must be >= 1"),
    ({"model": {"sourc": "hf"}}, "unknown key model.sourc; did you mean 'source'?"),
    (42, "config must be a TOML path, a dict or a RunConfig"),
    ("/nonexistent/run.toml", "config file '/nonexistent/run.toml' does not exist"),
])
def test_bad_configs_raise_config_error(config, message):
    with pytest.raises(etrain.ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        etrain.train(config, quiet=True)


def _doc(root: str, *extra: str) -> tuple[dict, list[str]]:
    return {}, [*RUN_BASE, f'checkpoint.url="{root}"', 'model.preset="tiny"', *extra]


@pytest.mark.ray
@pytest.mark.exhaustive  # a killed worker: tests/test_chaos*.py; an HF model and the API: make test and below
def test_submit_an_hf_model_kill_a_worker_and_pass_the_oracle(ray_cluster, tmp_path):
    from orchestrator.chaos.cli import judge
    from orchestrator.chaos.injector import Chaos
    from orchestrator.chaos.plan import load_plan

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    root = f"file://{tmp_path}/runs"
    doc, overrides = _doc(root, 'model.source="hf"', f'model.hf_config="{tmp_path}/llama"', "train.steps=100",
                          "elastic.hang_timeout_s=6")
    ref = etrain.submit(doc, workers=2, store=root, overrides=overrides, run_id="hf-ref")
    final_ref = ref.wait(timeout=300)
    assert final_ref["phase"] == "FINISHED", final_ref
    assert ref.status()["step"] == 100

    run = etrain.submit(doc, workers=2, min_workers=1, max_workers=2, store=root, overrides=overrides,
                        run_id=f"hf-{uuid.uuid4().hex[:6]}")
    plan_file = tmp_path / "plan.toml"
    # The tiny HF model steps in tens of milliseconds: the fault waits for step 24, well after the driver attached.
    plan_file.write_text('[[fault]]\nkind = "kill_worker"\nat_step = 24\nrank = 1\n')
    plan = load_plan(str(plan_file))
    chaos = Chaos(run.run_id, run._store(), plan)
    final = chaos.run(timeout_s=300)
    run.wait(timeout=120)
    result = judge(run.run_id, run._store(), plan, chaos, final, "hf-ref")
    assert result["passed"], json.dumps(result, indent=1, default=str)
    assert result["faults_injected"] == result["faults_recovered"] == 1, json.dumps(result, indent=1, default=str)
    assert result["committed_steps_lost"] == 0
    assert run.events("recovered")


@pytest.mark.ray
def test_submitted_run_is_resized_suspended_and_resumed_through_the_api(ray_cluster, tmp_path):
    root = f"file://{tmp_path}/runs"
    doc, overrides = _doc(root, "train.steps=24", "eval.every_steps=4", "eval.val_fraction=0.1", "eval.batches=1")
    run = etrain.submit(doc, workers=2, min_workers=1, max_workers=2, store=root, overrides=overrides,
                        run_id=f"api-{uuid.uuid4().hex[:6]}")
    run._bg.wait(lambda s: s.get("phase") == "RUNNING" and (s.get("step") or 0) >= 4, timeout=120,
                 what="step 4")
    run.resize(1)
    run._bg.wait(lambda s: s.get("world_size") == 1 and (s.get("step") or 0) >= 8, timeout=120,
                 what="the resize to 1 worker")
    with pytest.raises(etrain.ConfigError, match="workers=5 is not a valid size"):
        run.resize(5)  # 12 samples a step: no split on 5 (a valid size beyond max_workers would raise it)
    assert [e for e in run.events("allocator") if e["action"] == "registered"], "not the allocator's"
    run.suspend()
    assert run.wait(timeout=120)["phase"] == "SUSPENDED"
    stopped_at = run.status()["step"]
    assert 8 <= stopped_at < 24
    final = run.resume(workers=2).wait(timeout=300)
    assert final["phase"] == "FINISHED" and final["step"] == 24, final
    assert len([e for e in run.events("allocator") if e["action"] == "registered"]) == 2  # its start and its resume
    assert run.events("resized")
    assert run.status()["eval_loss"] > 0 and run.status()["eval_step"] == 24  # as `etrain status` shows it
