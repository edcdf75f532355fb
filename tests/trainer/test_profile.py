"""``[profile]``: real ``python -m trainer`` runs (its ``train_config`` in each rank process, or its ``main``
in this one) trace the chosen steps on the chosen ranks only, as Chrome traces of profiler events; a bad
``[profile]`` exits 2 naming the field; disabled, no profiler is made."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.harness import run_ranks
from trainer.config.load import load_config

BASE = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
        "train.warmup_steps=1", "metrics.enabled=false", 'run_id="prof"']


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def traced_steps(path: str) -> list[int]:
    """The step numbers whose ``etrain.step#N`` ranges the Chrome trace at ``path`` holds (it must be JSON
    with profiler events: operators that ran)."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert any(e.get("cat") == "cpu_op" and e.get("ph") == "X" for e in events), "no operator events"
    return sorted(int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("etrain.step#"))


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def train_rank(payload: dict) -> int:
    """One rank of ``python -m trainer`` (tests.harness runs it in each rank process)."""
    from trainer.cli import train_config

    return train_config(lambda: load_config(None, payload["overrides"]), quiet=True).exit_code


def test_a_two_rank_run_traces_the_chosen_steps_on_the_chosen_rank_only(tmp_path):
    out = tmp_path / "traces"
    sets = BASE + ["train.steps=5", "profile.enabled=true", "profile.steps=[2, 3]", "profile.ranks=[1]",
                   f'profile.dir="{out}"']
    assert run_ranks("tests.trainer.test_profile:train_rank", 2, {"overrides": sets}, timeout=240) == [0, 0]
    assert files_under(out) == ["prof/steps_2-3/rank1.pt.trace.json"]  # rank 0 made none
    assert traced_steps(str(out / "prof/steps_2-3/rank1.pt.trace.json")) == [2, 3]  # not the warm-up step 1


@pytest.fixture
def train(monkeypatch):
    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    return main


def test_the_first_step_traces_without_warmup_and_cpu_runs_never_touch_cuda(train, tmp_path, monkeypatch,
                                                                            caplog):
    def no_cuda(*a, **k):
        raise AssertionError("a CPU run called a CUDA memory API")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", no_cuda)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", no_cuda)
    out = tmp_path / "p"
    sets = BASE + ["train.steps=2", "profile.enabled=true", "profile.steps=[1, 1]", f'profile.dir="{out}"']
    assert train(_sets(sets) + ["--quiet"]) == 0
    assert files_under(out) == ["prof/steps_1-1/rank0.pt.trace.json"]
    assert traced_steps(str(out / "prof/steps_1-1/rank0.pt.trace.json")) == [1]


def test_a_window_past_the_last_step_traces_what_the_run_reaches_and_says_so(train, tmp_path, capsys):
    out = tmp_path / "p"
    sets = BASE + ["train.steps=3", "profile.enabled=true", "profile.steps=[3, 9]", "profile.ranks=[0, 4]",
                   f'profile.dir="{out}"']
    assert train(_sets(sets) + ["--quiet"]) == 0
    assert traced_steps(str(out / "prof/steps_3-3/rank0.pt.trace.json")) == [3]
    err = capsys.readouterr().err
    assert "profile.steps=[3, 9] ends after the last step this run trains (3)" in err, err
    assert "profile.ranks names rank(s) 4, beyond this world of 1 rank(s)" in err, err


def test_disabled_or_another_rank_or_a_window_behind_makes_no_profiler(monkeypatch):
    from trainer.observe.profile import step_profiler
    from trainer.world import World

    def boom(*a, **k):
        raise AssertionError("a profiler was made")

    monkeypatch.setattr(torch.profiler, "profile", boom)
    cpu = torch.device("cpu")
    rank1 = World(rank=1, size=2, local_rank=1)
    assert step_profiler(load_config(None, []), rank1, cpu, done=0, until=10) is None
    on = ["profile.enabled=true", "profile.steps=[2, 3]"]
    assert step_profiler(load_config(None, on), rank1, cpu, done=0, until=10) is None  # ranks = [0]
    rank0 = World(rank=0, size=2, local_rank=0)
    assert step_profiler(load_config(None, on), rank0, cpu, done=3, until=10) is None  # resumed past it
    assert step_profiler(load_config(None, on), rank0, cpu, done=1, until=10) is not None


@pytest.mark.parametrize("value,named", [
    ("profile.steps=[7, 5]", "profile.steps=[7, 5] must be [first, last] with first <= last"),
    ("profile.steps=[0, 3]", "profile.steps=0 must be in [1, "),
    ("profile.steps=[5]", "profile.steps=[5] must be [first, last]"),
    ('profile.steps="5..7"', "profile.steps must be a list"),
    ("profile.ranks=[-1]", "profile.ranks=-1 must be in [0, "),
    ("profile.ranks=[]", "profile.ranks is empty"),
    ("profile.ranks=[0, 0]", "names a rank twice"),
    ('profile.dir="s3://bucket/traces"', "profile.dir='s3://bucket/traces' is a URL"),
    ("profile.enabled=1", "profile.enabled must be true or false"),
    ("profile.every=3", "unknown key profile.every"),
])
def test_a_bad_profile_section_exits_2_naming_the_field(train, capsys, value, named):
    assert train(_sets(BASE + ["profile.enabled=true", value]) + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and named in err and "Traceback" not in err, err


def test_the_profile_section_leaves_the_config_hash_alone():
    assert load_config(None, BASE).config_hash() == load_config(
        None, BASE + ["profile.enabled=true", "profile.steps=[1, 2]", "profile.ranks=[0, 1]"]).config_hash()
