"""[health]: silent faults caught within steps, rolled back in place from the verified ring, attributed.

The detectors and the ring as pure values; then real gloo groups of 4 processes (tests.harness) that
train the same run twice in the same processes, clean and with a fault injected (``[health] faults``),
and compare every model and optimizer tensor bit for bit (fp32); then ``python -m trainer`` under
torchrun (the fault caught and rolled back; a persistent one exits 3 naming the rank and its host) and
bad ``[health]`` values (exit 2 naming the field)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from checkpointing.errors import ConfigError
from tests.harness import ROOT, free_port, run_ranks
from tests.orchestrator.test_cli import PY, TORCHRUN, run_trainer
from trainer.config.health import HealthConfig
from trainer.health.detect import SpikeWindow, first_divergence, replica_findings
from trainer.health.digest import digest
from trainer.health.faults import flip_bit
from trainer.health.ring import VerifiedRing

BASE = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch=8", "train.micro_batch=2",
        "train.warmup_steps=2", "train.steps=24", "metrics.enabled=false", "health.check_every_steps=8"]


# --- pure parts ---------------------------------------------------------------------------------


def test_a_spike_is_far_above_the_windows_median_and_only_above():
    w = SpikeWindow(window=32, zscore=8.0)
    assert w.score(100.0) is None  # nothing to compare with yet
    for i in range(32):
        w.accept(2.0 + 0.01 * (i % 5))
    assert w.is_spike(2.6)[0]  # far above the median
    assert not w.is_spike(2.03)[0]  # within the window's spread
    assert not w.is_spike(0.1)[0]  # a drop is never a spike


def test_a_flat_window_flags_nothing_within_one_percent():
    w = SpikeWindow(window=16, zscore=8.0)
    for _ in range(16):
        w.accept(3.0)
    assert not w.is_spike(3.2)[0]  # the spread is floored at 1% of the median: 8 x 0.03 = 0.24
    assert w.is_spike(3.3)[0]


def test_replicas_name_the_minority_and_a_two_way_split_names_nobody():
    ident = ("model.w", ("dp",), ())
    three = replica_findings(5, {0: {ident: 1}, 1: {ident: 1}, 2: {ident: 9}})
    assert [(f.kind, f.rank, f.target) for f in three] == [("replica", 2, "param")]
    two = replica_findings(5, {0: {ident: 1}, 1: {ident: 9}})
    assert [(f.rank, f.evidence["holders"]) for f in two] == [(None, [0, 1])]
    # a shard held by one rank alone (ZeRO-3) is nobody's replica
    assert replica_findings(5, {0: {("optim.w.exp_avg", ("dp",), (("dp", 0),)): 1},
                                1: {("optim.w.exp_avg", ("dp",), (("dp", 1),)): 2}}) == []


def test_the_replay_departs_first_on_the_rank_the_fault_struck():
    before = {0: {5: (2.0, 1.0, 11), 6: (2.1, 1.0, 12)}, 1: {5: (2.0, 1.0, 21), 6: (9.9, 7.0, 99)}}
    after = {0: {5: (2.0, 1.0, 11), 6: (2.1, 1.0, 12)}, 1: {5: (2.0, 1.0, 21), 6: (2.2, 1.0, 22)}}
    assert first_divergence(before, after) == (6, "local_loss", [1])
    # a state-only change at step 5 on rank 0 comes first
    before[0][5] = (2.0, 1.0, 13)
    assert first_divergence(before, after) == (5, "state", [0])
    assert first_divergence(after, after) is None


def test_the_ring_keeps_sparse_verified_steps_and_refuses_a_corrupted_copy():
    t = torch.arange(8, dtype=torch.float32)
    ring = VerifiedRing(depth=3, every=1)
    for step in range(1, 40):
        t += 1
        ring.add(step, [("model.w", t)], {"step": step})
    assert [s.step for s in ring.newest_first()] == [39, 32, 1]  # newest, newest of every 16th, of every 256th (none)
    snap = ring.newest()
    assert snap.intact()
    flip_bit(snap.tensors[0], 3, 30)
    assert not snap.intact()  # host memory flips too: a copy is checked before it is read back
    live = torch.zeros(8)
    ring.slots[1].restore([("model.w", live)])
    assert torch.equal(live, torch.arange(8, dtype=torch.float32) + 32)


def test_a_digest_sees_one_bit():
    t = torch.randn(1000)
    d = digest(t)
    flip_bit(t, 500, 0)  # the lowest mantissa bit
    assert digest(t) != d
    flip_bit(t, 500, 0)
    assert digest(t) == d


def test_a_transient_fault_fires_once_per_process_even_across_trainers():
    from trainer.health.faults import Faults

    fired: set = set()
    spec = {"kind": "bitflip", "step": 3, "rank": 1, "target": "param", "element": 2, "bit": 31}
    t = torch.ones(4)
    Faults([spec], 1, seed=0, fired=fired).at_boundary(3, [("model.w", t)])
    assert t.tolist() == [1.0, 1.0, -1.0, 1.0]
    # the worker re-formed at rank 0 (its process keeps what fired): the same fault does not fire again
    Faults([{**spec, "rank": 0}], 0, seed=0, fired=fired).at_boundary(3, [("model.w", t)])
    assert t.tolist() == [1.0, 1.0, -1.0, 1.0]
    persistent = Faults([{**spec, "persistent": True}], 1, seed=0)
    for step in (2, 3, 4):
        persistent.at_boundary(step, [("model.w", t)])
    assert t.tolist() == [1.0, 1.0, -1.0, 1.0]  # flipped at steps 3 and 4: twice


@pytest.mark.parametrize("field, value, message", [
    ("check_every_steps", -1, "health.check_every_steps=-1"),
    ("spike_zscore", 1.0, "health.spike_zscore=1.0 must be in [2, 1e6]"),
    ("spike_window", 4, "health.spike_window=4"),
    ("rollback_depth", 0, "health.rollback_depth=0"),
    ("on_persistent", "reboot", "health.on_persistent='reboot'"),
    ("max_skipped_batches", -2, "health.max_skipped_batches=-2"),
    ("faults", [{"kind": "bitflip", "step": 3, "target": "weights"}], "health.faults[0].target='weights'"),
    ("faults", [{"kind": "meteor", "step": 3}], "health.faults[0].kind='meteor'"),
])
def test_bad_health_values_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        HealthConfig(**{field: value})


@pytest.mark.slow  # two processes that import torch: the ConfigErrors above are the fast tier's
def test_bad_health_values_exit_2_before_training():
    r = run_trainer(["--config", "examples/tiny.toml", "--set", "health.on_persistent=reboot"], timeout=60)
    assert r.returncode == 2, r.stderr
    assert "health.on_persistent='reboot'" in r.stderr and "Traceback" not in r.stderr
    r = run_trainer(["--config", "examples/tiny.toml", "--set", "data.skip_ranges=[[5,12]]"], timeout=60)
    assert r.returncode == 2 and "data.skip_ranges: [5, 12) is not whole steps of train.global_batch=12" in r.stderr


# --- real groups of 4 ---------------------------------------------------------------------------


def _faulty(layout: list[str], fault: dict, ref: list[str] | None = None, world: int = 4) -> list[dict]:
    spec = "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in fault.items()) + "}"
    return run_ranks("tests.health_jobs:clean_and_faulty", world,
                     {"base": BASE + layout, "fault": [f"health.faults=[{spec}]"], "ref": ref or []}, timeout=300)


def _verdicts(res) -> list[tuple]:
    return [(e["verdict"], e["rank"], e["step"]) for e in res[0]["events"] if e["kind"] == "sdc"]


@pytest.mark.parametrize("name, layout, fault, caught_at", [
    # a replicated parameter (DDP): the seal on its rank finds it before its next update
    ("replicated param", ["parallel.zero_stage=0"], {"kind": "bitflip", "step": 13, "rank": 2, "target": "param"}, 13),
    # a ZeRO-3 shard (one owner), and the AdamW moments of a ZeRO-1 shard (one owner)
    ("zero3 shard", ["parallel.zero_stage=3"], {"kind": "bitflip", "step": 13, "rank": 1, "target": "param"}, 13),
    ("adamw state", ["parallel.zero_stage=1"],
     {"kind": "bitflip", "step": 11, "rank": 3, "target": "optimizer"}, 11),
    # a reduced gradient on one HSDP rank, exponent's top bit: the norm is not finite at that step
    pytest.param("hsdp grad", ["parallel.zero_stage=3", "parallel.dp_replicate=2"],
                 {"kind": "bitflip", "step": 13, "rank": 1, "target": "grad", "bit": 30}, 13, marks=pytest.mark.slow),
    # a gradient's sign on one DDP replica: nothing spikes; the replicas' digests differ at the next check
    pytest.param("replica sign", ["parallel.zero_stage=0"],
                 {"kind": "bitflip", "step": 13, "rank": 1, "target": "grad", "bit": 31}, 16, marks=pytest.mark.slow),
])
def test_a_flipped_bit_is_caught_rolled_back_in_place_and_the_run_ends_bitwise_equal(name, layout, fault, caught_at):
    res = _faulty(layout, fault)
    r = res[fault["rank"]]
    assert r["fired"] and r["fired"][0]["target"] == fault["target"], r["fired"]
    assert all(x["error"] is None for x in res), res[0]["error"]
    assert _verdicts(res) == [("transient", fault["rank"], caught_at)], res[0]["events"]
    rollbacks = [e for e in res[0]["events"] if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 8 and rollbacks[0]["from_step"] >= 10, rollbacks
    assert all(x["same_process"] for x in res)  # in place: the same processes trained on
    assert all(x["same"] for x in res), f"{name}: the state differs from the failure-free run"
    assert res[0]["train_state"]["verified"]["step"] == 24


def test_a_persistent_flip_stops_at_the_verified_step_naming_the_rank():
    res = _faulty(["parallel.zero_stage=3"],
                  {"kind": "bitflip", "step": 13, "rank": 1, "target": "param", "persistent": True})
    assert all(x["error"] and x["error"].startswith("PersistentFault: a fault on rank 1") for x in res), res[0]["error"]
    assert [v[:2] for v in _verdicts(res)] == [("transient", 1), ("persistent", 1)] or \
        [v[:2] for v in _verdicts(res)] == [("persistent", 1)], res[0]["events"]
    assert res[0]["steps"][1] == 8  # back at the verified step: the flipped state is gone


def test_a_poisoned_batch_is_skipped_listed_and_the_run_equals_one_that_skips_it():
    # step 40 (the model has learned enough for wrong targets to spike its loss) reads samples [312, 320)
    res = _faulty(["parallel.zero_stage=2", "train.steps=44"], {"kind": "poison_batch", "step": 40},
                  ref=["data.skip_ranges=[[312,320]]"])
    assert all(x["error"] is None for x in res), res[0]["error"]
    data = [e for e in res[0]["events"] if e["kind"] == "sdc"]
    assert [(e["verdict"], e["samples"]) for e in data] == [("data", [312, 320])], res[0]["events"]
    assert "spike" in {e["kind"] for e in res[0]["events"]}
    assert res[0]["train_state"]["skipped_ranges"] == [[312, 320]]
    assert all(x["same"] for x in res)


def test_clean_runs_find_nothing_in_bf16_either():
    res = run_ranks("tests.health_jobs:clean_only", 4,
                    {"base": BASE + ["train.steps=36", "parallel.zero_stage=3", "parallel.dp_replicate=2",
                                     "parallel.mixed_precision=bf16", "health.check_every_steps=4"]}, timeout=300)
    assert [(r["error"], r["events"], r["step"]) for r in res] == [(None, [], 36)] * 4
    assert res[0]["checks"] >= 9


# --- python -m trainer under torchrun ---------------------------------------------------------------


def _torchrun(tmp_path, faults: str, *extra: str):
    log = tmp_path / "steps.jsonl"
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    args = [TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            "-m", "trainer", "--config", "examples/tiny.toml", "--set", "parallel.zero_stage=2",
            "--set", "train.steps=20", "--set", "data.max_bytes=200000", "--set", "health.check_every_steps=8",
            "--set", f"health.faults=[{faults}]", "--log-file", str(log), *extra]
    r = subprocess.run(args, cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    return r, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.slow  # a torchrun launch: about 15 s
def test_under_torchrun_a_flip_is_rolled_back_and_the_run_goes_on(tmp_path):
    r, rows = _torchrun(tmp_path, '{kind="bitflip", step=11, rank=1, target="optimizer"}')
    assert r.returncode == 0, r.stderr[-3000:]
    assert "health: transient fault at step 11 on rank 1" in r.stderr, r.stderr[-3000:]
    assert "etrain: health: rolled back from step 10 to verified step 8" in r.stderr
    events = [e for row in rows for e in row.get("health_events") or []]
    assert [e["kind"] for e in events] == ["rollback", "sdc"]
    assert [row["step"] for row in rows] == list(range(1, 21))
    assert [row["verified_step"] for row in rows][7:9] == [8, 8]


@pytest.mark.slow  # a torchrun launch: about 15 s
def test_under_torchrun_a_persistent_flip_exits_3_naming_the_rank_and_host(tmp_path):
    r, _ = _torchrun(tmp_path, '{kind="bitflip", step=11, rank=1, target="param", persistent=true}')
    assert r.returncode != 0
    assert "a fault on rank 1" in r.stderr and "without host" in r.stderr, r.stderr[-3000:]
    assert "exitcode  : 3" in r.stderr or "exit code 3" in r.stderr or "exitcode: 3" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # a process that imports torch: about 15 s
def test_python_m_trainer_alone_exits_3_with_the_verified_step_committed(tmp_path):
    """One process (no torchrun): the exit status itself is 3, and the verified step is made durable."""
    from checkpointing.manager import CheckpointManager

    url = f"file://{tmp_path}/ckpt"
    r = subprocess.run([PY, "-m", "trainer", "--config", "examples/tiny.toml", "--set", "train.steps=16",
                        "--set", "data.max_bytes=200000", "--set", "health.check_every_steps=4", "--set",
                        f'checkpoint.url="{url}"', "--set",
                        'health.faults=[{kind="bitflip", step=6, rank=0, target="param", persistent=true}]'],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "a fault on rank 0" in r.stderr and "the run stopped at its last verified step 4, checkpoint " \
        "committed at step 4" in r.stderr, r.stderr[-2000:]
    mgr = CheckpointManager(url, "tiny")
    assert mgr.steps() == [4] and mgr.read_manifest(4).trainer_state["verified"]["step"] == 4
