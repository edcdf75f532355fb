"""Metrics: collective bytes against the analytic FSDP volume, the exporter's accounting, torchrun's
rank-0 endpoint. (A real Prometheus scraping a run on Ray: tests/orchestrator/test_orchestrator.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.cli.main import main as etrain
from tests.harness import ROOT, free_port, run_ranks
from trainer.observe.metrics import RunMetrics
from trainer.observe.endpoint import MetricsEndpoint
from trainer.observe.telemetry import SECONDS_BUCKETS

TINY = ["data.seq_len=32", "data.max_bytes=200000", "train.micro_batch=2"]


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of an endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    want = {k: str(v) for k, v in labels.items()}
    hits = [v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items()]
    assert len(hits) == 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0]


def test_fsdp_bytes_match_the_analytic_volume():
    """ZeRO-3 at dp=2, one micro-batch per rank and step. Forward all-gathers every FSDP unit
    (the full parameters P); backward all-gathers again every unit that resharded after forward
    (all but the last block, which trainer.parallel.fsdp keeps unsharded); backward reduce-scatters
    every unit's gradients (P)."""
    res = run_ranks("tests.jobs:comm_volume", 2, {"steps": 3, "overrides": [*TINY, "train.global_batch=4",
                                                                            "parallel.zero_stage=3"]})
    for rank in res:
        per_step, p = rank["per_step"], rank["param_bytes"]
        expected_ag = p + (p - rank["block_bytes"][-1])
        ag, rs = per_step["all_gather/dp_shard"], per_step["reduce_scatter/dp_shard"]
        assert ag["bytes"] == pytest.approx(expected_ag, rel=0.10)
        assert rs["bytes"] == pytest.approx(p, rel=0.10)
        # nccl-tests bus bytes at n=2: (n-1)/n of the size; every call timed
        assert ag["bus_bytes"] == pytest.approx(ag["bytes"] / 2)
        assert ag["seconds"] > 0 and rs["seconds"] > 0
        # the loss / norm / stop-vote / [health] flag reduction: 4 fp32 values over the whole world, once per step
        assert per_step["all_reduce/world"] == pytest.approx({"bytes": 16, "calls": 1, "bus_bytes": 16,
                                                              "seconds": per_step["all_reduce/world"]["seconds"]})


def test_tensor_parallel_collectives_are_labelled_by_axis():
    """tp2 x dp2: DTensor's functional collectives count under the tp axis, FSDP's under dp_shard."""
    res = run_ranks("tests.jobs:comm_volume", 4, {"steps": 2, "overrides": [*TINY, "train.global_batch=4",
                                                                            "parallel.tp=2"]})
    keys = set(res[0]["per_step"])
    assert "all_gather/dp_shard" in keys and "reduce_scatter/dp_shard" in keys
    tp = {k: v for k, v in res[0]["per_step"].items() if k.endswith("/tp")}
    assert tp and all(v["calls"] > 0 and v["bytes"] > 0 for v in tp.values()), res[0]["per_step"]


def telemetry(rank: int, calls: int, nbytes: int, seconds: float, steps: int = 0) -> dict:
    buckets = [0] * (len(SECONDS_BUCKETS) + 1)
    buckets[3] = calls
    return {"rank": rank, "time": time.time(),
            "comm": [{"kind": "all_gather", "axis": "dp_shard", "calls": calls, "bytes": nbytes,
                      "bus_bytes": nbytes / 2, "seconds": seconds, "buckets": buckets}],
            "memory": {"params": 100, "rss": 1000},
            "steps": {"buckets": [steps] + [0] * 12, "seconds": 0.001 * steps, "data_seconds": 0.0}}


def test_counters_stay_monotonic_when_a_worker_is_replaced_or_changes_rank():
    m = RunMetrics("r")
    m.observe_ranks("w0", telemetry(0, 10, 1000, 0.1, steps=5))
    m.observe_ranks("w1", telemetry(1, 10, 1000, 0.1))
    m.observe_ranks("w0", telemetry(0, 15, 1500, 0.2, steps=8))
    # w1 dies; its replacement w2 starts from zero as rank 1: its counts add, never subtract
    m.observe_ranks("w2", telemetry(1, 4, 400, 0.05))
    assert m.comm[("0", "all_gather", "dp_shard")]["calls"] == 15
    assert m.comm[("1", "all_gather", "dp_shard")]["calls"] == 14
    assert m.comm[("1", "all_gather", "dp_shard")]["bytes"] == 1400
    assert m.comm[("1", "all_gather", "dp_shard")]["hist"].counts[3] == 14
    assert m.step_seconds.counts[0] == 8  # rank 0's steps, counted once each
    # a survivor whose meter was reset (a fresh process under the same name) is taken whole
    m.observe_ranks("w0", telemetry(0, 3, 300, 0.01))
    assert m.comm[("0", "all_gather", "dp_shard")]["calls"] == 18
    m.observe_step({"step": 10, "tokens_per_s": 100.0, "step_seconds": 1.0})
    m.observe_step({"step": 12, "tokens_per_s": 100.0, "step_seconds": 1.0})
    m.observe_step({"step": 12, "tokens_per_s": 100.0, "step_seconds": 1.0})  # the same step again
    m.observe_step({"step": 9, "tokens_per_s": 100.0, "step_seconds": 1.0})  # a restore went back
    assert m.steps_total == 4 and m.tokens_total == 400


def test_endpoint_serves_every_family_and_registers_for_discovery(tmp_path, capsys):
    m = RunMetrics("run-a")
    ep = MetricsEndpoint(m, addr="127.0.0.1", port=0, file_sd_dir=str(tmp_path))
    try:
        path, = tmp_path.glob("run-a-*.json")  # <run_id>-<pid>.json: two runs of one id never collide
        target = json.loads(path.read_text())
        assert target[0]["targets"] == [f"127.0.0.1:{ep.port}"]
        m.observe_ranks("w0", telemetry(0, 10, 1000, 0.1, steps=3))
        m.observe_step({"step": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 50.0, "step_seconds": 0.5})
        m.observe_save({"step": 3, "status": "committed", "bytes": 2000, "blocking_s": 0.01, "persist_s": 0.5})
        m.observe_save({"step": 6, "status": "failed", "error": "boom"})
        m.observe_failure("actor_died", 1.5)
        m.observe_recovery(2.0, steps_lost=1)
        m.observe_run(world_size=2, epoch=3, phase="RUNNING", goodput=0.9)
        s = scrape(ep.url)
        assert sample(s, "etrain_loss", run_id="run-a") == 2.5
        assert sample(s, "etrain_comm_bytes_total", rank=0, kind="all_gather", axis="dp_shard") == 1000
        assert sample(s, "etrain_comm_seconds_bucket", rank=0, kind="all_gather", le="+Inf") == 10
        assert sample(s, "etrain_memory_bytes", rank=0, kind="params") == 100
        assert sample(s, "etrain_checkpoint_saves_total") == 1
        assert sample(s, "etrain_checkpoint_failures_total") == 1
        assert sample(s, "etrain_checkpoint_throughput_bytes_per_second") == 4000
        assert sample(s, "etrain_checkpoint_last_committed_step") == 3
        assert sample(s, "etrain_failures_total", kind="actor_died") == 1
        assert sample(s, "etrain_time_to_detect_seconds_sum") == 1.5
        assert sample(s, "etrain_time_to_recover_seconds_count") == 1
        assert sample(s, "etrain_steps_lost_total") == 1
        assert sample(s, "etrain_phase", phase="RUNNING") == 1 and sample(s, "etrain_phase", phase="FAILED") == 0
        code = etrain(["top", "--url", ep.url, "--once", "--interval", "0.1"])
        out = capsys.readouterr().out
        assert code == 0 and "RUNNING" in out and "all_gather" in out and "actor_died 1" in out, out
        names = {n for n, _ in s}
        assert all(n.startswith("etrain_") for n in names)
        assert all(("run_id", "run-a") in ls for _, ls in s)
    finally:
        ep.close()
    assert not list(tmp_path.glob("run-a-*.json"))  # a finished run is no longer a target
    assert etrain(["top", "--url", ep.url, "--once"]) == 1  # gone: says so, exits 1


def test_torchrun_rank0_serves_every_ranks_figures(tmp_path):
    """``python -m trainer`` under torchrun: rank 0 serves the endpoint, rank 1's figures reach it
    through the launcher's store."""
    sd = tmp_path / "sd"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "trainer", "--set", "train.steps=400", "--set", "train.global_batch=4",
           *[a for o in TINY for a in ("--set", o)], "--set", f'metrics.file_sd_dir="{sd}"', "--set",
           "metrics.every_s=0.2", "--set", 'run_id="tr"']
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen: dict = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if files := list(sd.glob("tr-*.json")):
                try:
                    target = json.loads(files[0].read_text())[0]["targets"][0]
                    seen = scrape(f"http://{target}/metrics")
                except (OSError, ValueError, IndexError):
                    seen = {}
                ranks = {dict(ls).get("rank") for n, ls in seen if n == "etrain_comm_bytes_total"}
                if {"0", "1"} <= ranks and seen.get(("etrain_step", (("run_id", "tr"),)), 0) >= 3:
                    break
            time.sleep(0.5)
        else:
            out = proc.stdout.read() if proc.poll() is not None else ""
            pytest.fail(f"no endpoint with both ranks' figures; trainer output:\n{out[-3000:]}")
        assert sample(seen, "etrain_memory_bytes", rank=1, kind="optimizer") > 0
        assert sample(seen, "etrain_comm_calls_total", rank=1, kind="reduce_scatter", axis="dp_shard") > 0
        assert sample(seen, "etrain_world_size") == 2
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_the_dashboard_charts_only_documented_metrics_and_every_panel_has_a_unique_place():
    """deploy/grafana-dashboard.json: each metric an expression reads (histogram suffixes aside) is one
    docs/metrics.md documents, every panel id is unique, and no two panels overlap on the grid."""
    import re

    with open(os.path.join(ROOT, "deploy", "grafana-dashboard.json")) as f:
        panels = json.load(f)["panels"]
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        documented = set(re.findall(r"`(etrain_[a-z0-9_]+)`", f.read()))
    read = {re.sub(r"_(sum|count|bucket)$", "", name) for p in panels for t in p.get("targets", [])
            for name in re.findall(r"\betrain_[a-z0-9_]+", t["expr"])}
    assert read and read <= documented, sorted(read - documented)
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
