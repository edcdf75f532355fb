"""The sample ``transformers`` Llama config README and docs/models-and-data.md point at: ``transformers``
loads ``examples/llama-small/config.json`` as a ``LlamaConfig``, its vocabulary fits the bytes the
example trains on, and ``etrain train examples/llama-small.toml`` (from the repository root, as README
says) trains it as written, with a finite loss at every step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib

from tests.harness import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "llama-small.toml")


def test_transformers_loads_the_sample_llama_config():
    from transformers import AutoModelForCausalLM, LlamaConfig

    with open(EXAMPLE, "rb") as f:
        model = tomllib.load(f)["model"]
    assert model["source"] == "hf"
    config = LlamaConfig.from_pretrained(os.path.join(ROOT, model["hf_config"]))
    assert config.model_type == "llama" and config.num_hidden_layers == 2 and config.hidden_size <= 128
    assert config.vocab_size == 256  # the bytes the example's data.tokenizer (the default, "bytes") gives
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "LlamaForCausalLM"


def test_the_llama_example_trains_as_written(tmp_path):
    log = tmp_path / "steps.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, ETRAIN_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "train", "examples/llama-small.toml",
                          "--set", "metrics.enabled=false", "--log-file", str(log)],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hf model" in res.stdout + res.stderr
    with open(EXAMPLE, "rb") as f:
        steps = tomllib.load(f)["train"]["steps"]
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
