"""bench/gpu_suite.py cannot rot: its --cpu-smoke mode runs every row's code on a tiny model in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_cpu_smoke_runs_every_row():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench/gpu_suite.py", "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON line is last
    errors = {k: v for k, v in out.items() if k.endswith("_error")}
    assert not errors, errors
    assert out["bench"] == "gpu_suite" and out["smoke"] is True
    for key in ("tokens_s_etrain", "tokens_s_hand", "tokens_s_torchtitan"):
        assert out[key] > 0, key
    assert out["memory_predicted_bytes"] > 0 and out["checkpoint_bytes"] > 0 and out["checkpoint_gb_s"] > 0
    assert out["tier_step_ratio"] > 0 and out["tier_side_copy_step_ratio"] > 0 and out["tier_bytes"] > 0
    assert isinstance(out["wheels_missing"], list) and isinstance(out["wheels_optional_missing"], list)
    assert out["mfu_eager_vs_hand"] > 0
    assert out["health_overhead_ratio"] > 0 and out["health_overhead_ratio_every_step"] > 0
    assert out["health_check_s"] > 0 and out["health_ring_bytes"] > 0
