"""Checkpoints in real multi-process groups, on a local directory and on S3 (moto).

Round trips are bitwise: after loading at layout Y a checkpoint saved at
layout X, every parameter and AdamW tensor, gathered to its full form, equals
what layout X held when it saved.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from checkpointing.manager import CheckpointManager
from tests.harness import ROOT, run_ranks

BASE = ["data.max_bytes=300000", "data.seq_len=16", "train.global_batch=24", "train.micro_batch=2",
        "model.dim=64", "model.n_layers=2", "model.ffn_hidden=128",
        "train.warmup_steps=2", "train.steps=40", "train.grad_clip=1.0", "checkpoint.timeout_s=20"]


def base(url):
    return BASE + [f'checkpoint.url="{url}"']


def merged(results, key="state"):
    """One state dict from every rank's gathered tensors (pipeline stages hold different keys)."""
    out = {}
    for rank_result in results:
        for k, v in rank_result[key].items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between ranks"
            out[k] = v
    return out


def assert_same(a, b, what):
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def plan(world, url, actions, timeout=600):
    return run_ranks("tests.ckpt_jobs:run_plan", world, {"base": base(url), "actions": actions}, timeout=timeout)


ZERO3 = ["parallel.zero_stage=3"]
ZERO0 = ["parallel.zero_stage=0"]
HSDP = ["parallel.dp_replicate=2", "parallel.zero_stage=3"]
TP2 = ["parallel.tp=2"]
PP2 = ["parallel.pp=2"]


@pytest.mark.compat
@pytest.mark.exhaustive_on_s3
def test_reshard_between_layouts(storage_url):
    """ZeRO 3 <-> 0, FSDP <-> HSDP, TP 1 <-> 2, PP 1 <-> 2, all at world 4."""
    acts = [
        {"layout": ZERO3, "train": 2, "save": "z3"},
        {"layout": ZERO0, "load": "z3", "state_before_train": True, "train": 1, "save": "z0"},
        {"layout": ZERO3, "load": "z0", "state_before_train": True, "state": False},
        {"layout": HSDP, "load": "z3", "state_before_train": True, "train": 1, "save": "h"},
        {"layout": ZERO3, "load": "h", "state_before_train": True, "state": False},
        {"layout": TP2, "load": "z3", "state_before_train": True, "train": 1, "save": "t2"},
        {"layout": ZERO3, "load": "t2", "state_before_train": True, "state": False},
        {"layout": PP2, "load": "z3", "state_before_train": True, "train": 1, "save": "p2"},
        {"layout": ZERO3, "load": "p2", "state_before_train": True, "state": False},
    ]
    res = plan(4, storage_url, acts)
    per = [[r[i] for r in res] for i in range(len(acts))]
    saved = {"z3": merged(per[0]), "z0": merged(per[1]), "h": merged(per[3]), "t2": merged(per[5]),
             "p2": merged(per[7])}
    for i, act in enumerate(acts):
        if "load" in act:
            assert per[i][0]["loaded_step"] is not None
            assert_same(merged(per[i], "state_loaded"), saved[act["load"]], f"{act['load']} -> {act['layout']}")
        for r in per[i]:
            assert all(status == "committed" for _, status, _ in r.get("saves", [])), r.get("saves")
    # The state really is what training produced: AdamW moved and counted its steps.
    assert float(saved["z3"]["optim.layers.0.attention.wq.weight.step"]) == 2.0
    assert saved["z3"]["optim.layers.0.attention.wq.weight.exp_avg"].abs().sum() > 0


@pytest.mark.exhaustive_on_s3
def test_reshard_data_parallel_4_3_2_1_4(storage_url):
    """Each world loads the previous one's checkpoint, checks it bitwise, trains a step and saves."""
    chain = [4, 3, 2, 1, 4]
    prev_state, prev_run, prev_consumed = None, None, None
    for i, world in enumerate(chain):
        act = {"layout": ZERO3 if world != 1 else ZERO0, "train": 1, "save": f"dp{i}", "state_before_train": True}
        if prev_run:
            act["load"] = prev_run
        res = plan(world, storage_url, [act])
        r = [x[0] for x in res]
        if prev_state is not None:
            assert_same(merged(r, "state_loaded"), prev_state, f"world {chain[i - 1]} -> {world}")
            # The data cursor came back exactly and advanced by one global batch.
            assert r[0]["samples_consumed"] == prev_consumed + 24
        prev_state, prev_run, prev_consumed = merged(r), f"dp{i}", r[0]["samples_consumed"]


@pytest.mark.compat
@pytest.mark.slow_on_s3
def test_bit_exact_resume(storage_url):
    """20 steps straight == 10 steps + save + new processes + load + 10 steps, bitwise."""
    straight = plan(2, storage_url, [{"train": 20}])
    # The first half saves synchronously, the rest asynchronously.
    first = plan(2, storage_url, [{"train": 10, "save": "half", "state": False,
                                   "save_overrides": ["checkpoint.async_save=false"]}])
    second = plan(2, storage_url, [{"load": "half", "train": 10}])
    assert second[0][0]["loaded_step"] == 10
    assert second[0][0]["losses"] == straight[0][0]["losses"][10:]
    assert_same(merged([r[0] for r in second]), merged([r[0] for r in straight]), "resumed vs straight")
    assert first[0][0]["samples_consumed"] == 10 * 24
    # On another world size (and ZeRO stage) the math is the same up to reduction order.
    other = plan(3, storage_url, [{"layout": ["parallel.zero_stage=2"], "load": "half", "train": 10,
                                   "state": False}])
    for a, b in zip(other[0][0]["losses"], straight[0][0]["losses"][10:]):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)


@pytest.mark.slow_on_s3
def test_crash_during_save_leaves_step_invisible(storage_url):
    out = run_ranks("tests.ckpt_jobs:crash_during_save", 2,
                    {"base": base(storage_url) + ["checkpoint.timeout_s=4"]}, expect_exit={1: 17})
    assert out[0]["first"] == [(1, "committed")]
    (step, status, error), = out[0]["second"]
    assert (step, status) == (2, "failed") and "rank 1" in error
    mgr = CheckpointManager(storage_url, "run")
    assert mgr.steps() == [1, 2]  # step 2's shards are there...
    assert mgr.committed_steps() == [1]  # ...but without a manifest it does not exist
    res = plan(1, storage_url, [{"load": "run", "state": False}])
    assert res[0][0]["loaded_step"] == 1


def ckpt_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "ckpt", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow_on_s3
def test_flipped_byte_fails_verify_and_load_falls_back(storage_url):
    plan(2, storage_url, [{"train": 1, "save": "run", "state": False},
                          {"load": "run", "train": 1, "save": "run", "state": False}])
    mgr = CheckpointManager(storage_url, "run")
    assert mgr.committed_steps() == [1, 2]
    ok = ckpt_cli("verify", f"{storage_url}/run")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    name = next(f.path for f in mgr.read_manifest(2).files if f.path.startswith("__1_0."))  # rank 1's first file
    shard = f"{mgr.step_rel(2)}/{name}"
    data = bytearray(mgr.storage.get(shard))
    data[len(data) // 2] ^= 0x01
    mgr.storage.put(shard, bytes(data))
    bad = ckpt_cli("verify", f"{storage_url}/run")
    assert bad.returncode == 1
    assert f"FAIL run/checkpoints/step_000000002/{name} fails its checksum (crc32c" in bad.stdout
    assert "ok   run/checkpoints/step_000000001" in bad.stdout
    res = plan(2, storage_url, [{"load": "run", "state": False}])
    assert res[0][0]["loaded_step"] == 1
    assert any(name in w and "step_000000002" in w for w in res[0][0]["warnings"])
    ls = ckpt_cli("ls", f"{storage_url}/run", "--json")
    assert [r["step"] for r in json.loads(ls.stdout)] == [1, 2]


@pytest.mark.slow_on_s3
def test_storage_faults_retry_then_commit_or_fail_cleanly(storage_url):
    flaky = ['checkpoint.faults={error_rate = 0.3, delay_s = 0.01, seed = 5}']
    down = ['checkpoint.faults={fail_after = 0}', "checkpoint.timeout_s=3"]
    truncating = ['checkpoint.faults={truncate_rate = 1.0, ops = ["put"], path_contains = ".distcp"}']
    res = plan(2, storage_url, [
        {"save_overrides": flaky, "train": 1, "save": "run", "state": False},
        # The storage goes away: the save fails within its bound, training goes on,
        # and the committed checkpoint is untouched.
        {"save_overrides": down, "load": "run", "train": 1, "save": "run", "state": False},
        {"load": "run", "train": 1, "state": False},
        # The storage keeps half of every shard while reporting success: the commit sees the sizes
        # and refuses; the truncated step never appears committed.
        {"save_overrides": truncating, "load": "run", "train": 1, "save": "run", "state": False},
    ])
    first, second, third, fourth = res[0]  # rank 0, one result per action
    assert first["saves"] == [(1, "committed", "")]
    assert first["faults_injected"].get("error", 0) > 0
    (step, status, error), = second["saves"]
    assert (step, status) == (2, "failed") and "injected storage fault" in error
    assert second["save_seconds"] < 15
    assert third["loaded_step"] == 1 and len(third["losses"]) == 1
    (step, status, error), = fourth["saves"]
    assert (step, status) == (2, "failed") and ".distcp holds" in error and "truncated" in error, error
    assert CheckpointManager(storage_url, "run").committed_steps() == [1]


def test_one_save_in_flight_second_waits_or_is_skipped(tmp_path):
    res = run_ranks("tests.ckpt_jobs:busy_saves", 2, {"base": base(f"file://{tmp_path}/ckpt")})[0]
    assert res["skip"] == [(1, "committed"), (2, "skipped")]
    assert res["skip_committed"] == [1]
    assert res["wait"] == [(1, "committed"), (2, "committed")]
    assert res["wait_committed"] == [1, 2]


def repeated_saves(payload: dict) -> dict:
    """Saves of one manager in a row: the first plans, later ones of the same layout reuse its plan;
    a new key, or a non-tensor item that grew, plans again. Runs in each rank."""
    from tests.ckpt_jobs import full_state
    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.checkpoints import checkpoint_manager
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    try:
        cfg = load_config(None, payload["base"] + ZERO3 + ["checkpoint.async_save=false", "checkpoint.keep_last=10"])
        corpus = load_corpus(cfg.data)
        trainer = Trainer(cfg, world, corpus=corpus, device=torch.device("cpu"))
        mgr = checkpoint_manager(cfg, world)
        saved, planned, notes = {}, {}, {}
        # Steps 3 and 4 save asynchronously (from snapshot buffers: step 3 plans again where
        # their tensor properties differ from the live tensors'). Serialized non-tensor items
        # are 64-byte aligned: a few more characters would not move anything.
        for step, note in [(1, None), (2, None), (3, None), (4, None), (5, "a"), (6, "b" * 5000), (7, "c" * 5000)]:
            trainer.train_step()
            mgr.async_save = step in (3, 4)
            state = trainer.optimizer.checkpoint_state()
            if note is not None:
                state["extra"] = {"note": note}
                notes[step] = note
            mgr.save(trainer.step, state, layout=trainer.layout(), config_hash="h", trainer_state={})
            mgr.wait()
            (res,) = mgr.poll()
            assert res.ok, res
            planned[trainer.step] = "dcp_finish" in res.phases
            saved[trainer.step] = full_state(trainer)
        loaded = {}
        for step in saved:
            fresh = Trainer(cfg, world, corpus=corpus, device=torch.device("cpu"))
            state = fresh.optimizer.checkpoint_state()
            if step in notes:
                state["extra"] = {"note": ""}
            mgr.load(state, step=step)
            got = full_state(fresh)
            same = got.keys() == saved[step].keys() and all(torch.equal(got[k], v) for k, v in saved[step].items())
            loaded[step] = (same, state.get("extra", {}).get("note"))
        return {"planned": planned, "loaded": loaded, "notes": notes}
    finally:
        shutdown_distributed()


def test_saves_of_an_unchanged_layout_reuse_the_plan(storage_url):
    res = run_ranks("tests.checkpointing.test_checkpoint:repeated_saves", 2, {"base": base(storage_url)})
    for r in res:
        planned = r["planned"]
        planned.pop(3)
        assert planned == {1: True, 2: False, 4: False, 5: True, 6: True, 7: False}
        for step, (same, note) in r["loaded"].items():
            assert same, f"step {step} loaded other values than it saved"
            assert note == r["notes"].get(step), (step, note)
