"""``train.lr_schedule``: each schedule's learning rate per step against torch's own schedulers stepped on a
dummy optimizer (or closed-form numbers where torch has no such shape), the config errors that name the field,
and a resume whose schedule changed saying how the rate moves."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

from checkpointing.errors import ConfigError
from trainer.config import TrainConfig
from trainer.config.load import load_config
from trainer.loop import lr_at


def torch_lrs(build, steps: int, lr: float) -> list[float]:
    """The rate each of ``steps`` steps trains at under the scheduler ``build(optimizer)`` (read before its
    step, as a training loop does)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's own deprecation notes
        sched = build(opt)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return out


def ours(t: TrainConfig) -> list[float]:
    return [t.lr_at(s) for s in range(t.steps)]


def warmup(opt, w: int) -> LinearLR:
    """lr * (s + 1) / w for s < w, then lr."""
    return LinearLR(opt, start_factor=1 / w, end_factor=1.0, total_iters=max(w - 1, 1))  # w = 1: flat


@pytest.mark.parametrize("steps,w,ratio", [(40, 5, 0.1), (17, 3, 0.0), (9, 1, 0.5)])
def test_cosine_is_warmup_then_cosine_annealing(steps, w, ratio):
    t = TrainConfig(steps=steps, warmup_steps=w, lr=2e-3, min_lr_ratio=ratio)
    ref = torch_lrs(lambda o: SequentialLR(o, [warmup(o, w), CosineAnnealingLR(o, T_max=steps - w,
                                                                              eta_min=2e-3 * ratio)],
                                           milestones=[w]), steps, 2e-3)
    assert ours(t) == pytest.approx(ref, rel=1e-9, abs=1e-15)


def test_cosine_is_the_schedule_runs_had_before_lr_schedule():
    """The default: warmup then cosine, the formula checkpoints written before train.lr_schedule trained by."""
    t = TrainConfig(steps=30, warmup_steps=4, lr=1.0, min_lr_ratio=0.1)
    assert t.lr_schedule == "cosine"
    for s in range(35):
        if s < 4:
            want = (s + 1) / 4
        else:
            p = min(1.0, (s - 4) / 26)
            want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
        assert t.lr_at(s) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("steps,w,ratio", [(40, 5, 0.1), (12, 2, 0.0), (10, 9, 0.25)])
def test_linear_is_warmup_then_linear_decay_to_the_floor_at_the_last_step(steps, w, ratio):
    t = TrainConfig(steps=steps, warmup_steps=w, lr=1e-3, min_lr_ratio=ratio, lr_schedule="linear")
    ref = torch_lrs(lambda o: SequentialLR(o, [warmup(o, w), LinearLR(o, start_factor=1.0, end_factor=ratio,
                                                                    total_iters=steps - w)],
                                           milestones=[w - 1]), steps, 1e-3)
    got = ours(t)
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-15)
    assert got[-1] == pytest.approx(1e-3 * ratio, abs=1e-15)  # the last step trains at the floor
    assert got[w - 1] == pytest.approx(1e-3)  # the peak, once


def test_linear_without_warmup_starts_one_step_down():
    t = TrainConfig(steps=4, warmup_steps=0, lr=1.0, min_lr_ratio=0.0, lr_schedule="linear")
    assert ours(t) == pytest.approx([0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("w", [0, 1, 6])
def test_constant_is_warmup_then_flat(w):
    t = TrainConfig(steps=20, warmup_steps=w, lr=5e-4, lr_schedule="constant")
    if w:
        ref = torch_lrs(lambda o: warmup(o, w), 20, 5e-4)
    else:
        ref = torch_lrs(lambda o: ConstantLR(o, factor=1.0, total_iters=0), 20, 5e-4)
    assert ours(t) == pytest.approx(ref, rel=1e-12)
    assert t.lr_at(10**6) == 5e-4


@pytest.mark.parametrize("steps,w,decay,ratio", [(50, 5, 10, 0.1), (20, 2, 18, 0.0), (12, 3, 1, 0.2)])
def test_wsd_linear_is_warmup_stable_then_linear_decay(steps, w, decay, ratio):
    """The decay's i-th of d steps trains at floor + (lr - floor) * (1 - i/d): torch's LinearLR from
    1 - (1 - ratio)/d to ratio over d - 1 iterations, after a flat stretch."""
    t = TrainConfig(steps=steps, warmup_steps=w, lr=1e-3, min_lr_ratio=ratio, lr_schedule="wsd",
                    decay_steps=decay)
    start = steps - decay
    ref = torch_lrs(lambda o: SequentialLR(o, [
        warmup(o, w), ConstantLR(o, factor=1.0, total_iters=0),
        LinearLR(o, start_factor=1 - (1 - ratio) / decay, end_factor=ratio, total_iters=max(decay - 1, 1))],
        milestones=[w, start]), steps, 1e-3)
    got = ours(t)
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-15)
    assert got[w:start] == [1e-3] * (start - w)  # stable
    assert got[-1] == pytest.approx(1e-3 * ratio, abs=1e-15)


def test_wsd_cosine_decay_is_cosine_annealing_over_the_decay():
    steps, w, decay, ratio = 40, 4, 12, 0.1
    t = TrainConfig(steps=steps, warmup_steps=w, lr=3e-3, min_lr_ratio=ratio, lr_schedule="wsd",
                    decay_steps=decay, decay_type="cosine")
    # CosineAnnealingLR begins at the peak one step before the decay's first step (which is one step down).
    ref = torch_lrs(lambda o: SequentialLR(o, [warmup(o, w), ConstantLR(o, factor=1.0, total_iters=0),
                                               CosineAnnealingLR(o, T_max=decay, eta_min=3e-3 * ratio)],
                                           milestones=[w, steps - decay - 1]), steps, 3e-3)
    assert ours(t) == pytest.approx(ref, rel=1e-9)


def test_wsd_decay_shapes_closed_form():
    """steps 10, warmup 2, a decay of 4 steps from 1 to 0: progress 1/4, 2/4, 3/4, 1 over steps 6-9."""
    base = {"steps": 10, "warmup_steps": 2, "lr": 1.0, "min_lr_ratio": 0.0, "lr_schedule": "wsd", "decay_steps": 4}
    head = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    want = {"linear": [0.75, 0.5, 0.25, 0.0],
            "sqrt": [0.5, 0.29289321881345254, 0.1339745962155614, 0.0],
            "cosine": [0.8535533905932737, 0.5, 0.14644660940672627, 0.0]}
    for kind, tail in want.items():
        assert ours(TrainConfig(**base, decay_type=kind)) == pytest.approx(head + tail, abs=1e-12), kind


def test_wsd_decay_ratio_is_a_share_of_steps_and_decay_steps_wins():
    t = TrainConfig(steps=100, warmup_steps=10, lr_schedule="wsd", decay_ratio=0.25)
    assert t.wsd_decay_steps == 25 and t.lr_at(74) == t.lr and t.lr_at(75) < t.lr
    assert TrainConfig(steps=30, lr_schedule="wsd", decay_ratio=0.15).wsd_decay_steps == 5  # 4.5 rounds half up
    assert TrainConfig(steps=100, lr_schedule="wsd", decay_ratio=0.25, decay_steps=7).wsd_decay_steps == 7
    flat = TrainConfig(steps=20, warmup_steps=0, lr_schedule="wsd", decay_ratio=0.0)
    assert ours(flat) == [flat.lr] * 20


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_is_a_pure_function_of_the_step_and_keeps_its_floor_after_the_end(schedule):
    t = TrainConfig(steps=25, warmup_steps=3, lr=1e-3, lr_schedule=schedule, decay_steps=5 * (schedule == "wsd"))
    again = TrainConfig(**{k: getattr(t, k) for k in ("steps", "warmup_steps", "lr", "lr_schedule",
                                                      "decay_steps")})
    assert [t.lr_at(s) for s in range(30)] == [again.lr_at(s) for s in reversed(range(30))][::-1]
    floor = t.lr if schedule == "constant" else t.lr * t.min_lr_ratio
    assert t.lr_at(25) == pytest.approx(floor) and t.lr_at(10**9) == pytest.approx(floor)
    assert all(0 < t.lr_at(s) <= t.lr for s in range(30))


def test_the_loop_reads_the_configured_schedule():
    cfg = load_config(None, ['train.lr_schedule="wsd"', "train.steps=20", "train.warmup_steps=2",
                             "train.decay_steps=4", 'train.decay_type="sqrt"'])
    assert [lr_at(cfg, s) for s in range(20)] == [cfg.train.lr_at(s) for s in range(20)]
    assert lr_at(cfg, 15) == cfg.train.lr and lr_at(cfg, 19) == pytest.approx(cfg.train.lr * 0.1)


@pytest.mark.parametrize("overrides,named", [
    (['train.lr_schedule="foo"'], "train.lr_schedule"),
    (['train.decay_type="exp"'], "train.decay_type"),
    (["train.decay_ratio=1.5"], "train.decay_ratio"),
    (["train.decay_ratio=-0.1"], "train.decay_ratio"),
    (["train.decay_steps=-3"], "train.decay_steps"),
    (['train.lr_schedule="wsd"', "train.steps=20", "train.warmup_steps=10", "train.decay_steps=11"],
     "train.decay_steps=11"),
    (['train.lr_schedule="wsd"', "train.steps=20", "train.warmup_steps=19", "train.decay_ratio=0.5"],
     "train.decay_ratio=0.5"),
    (['train.lr_schedule="wsd"', "train.steps=5"], "train.warmup_steps=10"),
])
def test_bad_schedule_config_names_the_field(overrides, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace(".", r"\.")):
        load_config(None, overrides)


def test_bad_schedule_values_built_in_python_name_the_field_and_the_choices():
    with pytest.raises(ConfigError, match='train.lr_schedule=\'foo\' must be one of "cosine", "linear", '
                                          '"constant", "wsd"'):
        TrainConfig(lr_schedule="foo")
    with pytest.raises(ConfigError, match=r'train.decay_type=\'exp\' must be one of "linear", "sqrt", "cosine"'):
        TrainConfig(decay_type="exp")
    with pytest.raises(ConfigError, match=r"make the decay at most 10 step\(s\), or raise train.steps"):
        TrainConfig(steps=20, warmup_steps=10, lr_schedule="wsd", decay_steps=11)
    with pytest.raises(ConfigError, match="lower train.warmup_steps below 5"):
        TrainConfig(steps=5, warmup_steps=10, lr_schedule="wsd")


def test_a_bad_schedule_exits_2_naming_the_field(monkeypatch, capsys):
    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert main(["--set", 'train.lr_schedule="wsd"', "--set", "train.steps=8", "--set", "train.decay_steps=9",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "train.decay_steps=9" in err and "Traceback" not in err, err


def test_keys_a_schedule_does_not_read_are_reported():
    assert TrainConfig(decay_type="sqrt", decay_ratio=0.3).inert_keys() == ["train.decay_ratio",
                                                                           "train.decay_type"]
    assert TrainConfig(lr_schedule="constant", min_lr_ratio=0.5).inert_keys() == ["train.min_lr_ratio"]
    assert TrainConfig(lr_schedule="wsd", decay_type="sqrt", min_lr_ratio=0.5).inert_keys() == []
    assert TrainConfig().inert_keys() == []


def test_new_schedule_keys_enter_the_config_hash_only_when_set():
    base = load_config(None, ["train.steps=50"])
    assert load_config(None, ["train.steps=50", 'train.lr_schedule="cosine"', "train.decay_ratio=0.1",
                              "train.decay_steps=0", 'train.decay_type="linear"']).config_hash() == base.config_hash()
    assert load_config(None, ["train.steps=50", 'train.lr_schedule="wsd"']).config_hash() != base.config_hash()


def test_a_changed_schedule_is_told_with_the_rate_before_unless_the_recorded_values_are_bad():
    t = load_config(None, ['train.lr_schedule="wsd"', "train.steps=40", "train.decay_steps=8"]).train
    assert t.schedule_moves({"log_every": 3, "seed": 1}, 35) == ""  # not the schedule's
    told = t.schedule_moves({"lr_schedule": "cosine", "steps": 30, "seed": 1}, 35)
    assert told == ("; the learning-rate schedule moves (train.lr_schedule, train.steps): step 35 trains at "
                    f"lr {t.lr_at(35):.4g}, not {t.lr * t.min_lr_ratio:.4g}")
    for saved in ({"lr_schedule": "exp"}, {"steps": "many"}, {"decay_steps": 39}, {"lr": True},
                  {"decay_type": 3}, {"lr": float("nan")}):
        key = next(iter(saved))
        assert t.schedule_moves(saved, 35) == f"; the learning-rate schedule moves (train.{key})", saved


def test_resuming_with_another_schedule_says_how_the_rate_moves(tmp_path, monkeypatch, capsys):
    """A live change of train.lr_schedule (and the wsd keys) between a checkpoint and its resume: the run
    resumes under the new schedule and says which keys moved it and the step's rate before and after."""
    import json

    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    base = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch=2", "train.micro_batch=2",
            "train.warmup_steps=1", "train.lr=1e-3", "metrics.enabled=false", f'checkpoint.url="file://{tmp_path}/c"']

    def sets(extra: list[str]) -> list[str]:
        return [a for o in base + extra for a in ("--set", o)]

    assert main(sets(["train.steps=2"]) + ["--quiet"]) == 0
    log = tmp_path / "steps.jsonl"
    resumed = ["train.steps=4", "checkpoint.resume=true", 'train.lr_schedule="wsd"', "train.decay_steps=2",
               'train.decay_type="cosine"']
    assert main(sets(resumed) + ["--log-file", str(log), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "the learning-rate schedule moves" in err and "train.lr_schedule" in err, err
    assert "step 2 trains at lr 0.00055, not 0.0001" in err, err  # halfway down wsd's decay; past cosine's end
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    assert [r["lr"] for r in rows] == pytest.approx([0.001 * (0.1 + 0.9 * 0.5), 0.0001])
