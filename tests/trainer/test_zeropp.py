"""ZeRO++: int8 weights in the all-gather (qwZ), int8 gradients in an all-to-all reduce-scatter (qgZ), a
secondary weight shard within groups of ranks (hpZ); what each sends, that training follows the
unquantized run, that replicas never drift apart, and the refusals.

One 4-process gloo group trains each layout (the parity tests' narrow tiny model, fp32) for 20 steps;
the comm meter's bytes per step are compared with the unquantized run's and with the exact size of
int8 rows plus one fp32 scale per block. bf16's all-gather moves exactly half of fp32's bytes (its
parameters are 2-byte), which a 3-step bf16 run confirms.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpointing.errors import ConfigError
from tests.harness import run_ranks
from tests.orchestrator.test_cli import run_trainer
from tests.trainer.test_parity import BASE
from trainer.config.load import load_config
from trainer.parallel.dims import ParallelDims
from trainer.zero.quantize import dequantize, quantize, row_bytes

STEPS = 20
RTOL = 0.01
QW, QG, HPZ = "parallel.quantized_weights=true", "parallel.quantized_gradients=true", "parallel.hpz_partition_size=2"


def layout(z: int, *extra: str, prec: str = "fp32") -> list[str]:
    return [f"parallel.zero_stage={z}", f'parallel.mixed_precision="{prec}"', *extra]


# --- quantize / dequantize ----------------------------------------------------------------------------------


def test_round_trip_is_within_half_a_step_of_each_block():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.linspace(0.01, 100.0, 4096)  # blocks of very different ranges
    y = dequantize(quantize(x, 256), x.numel(), 256)
    for b in range(0, 4096, 256):
        bound = x[b : b + 256].abs().max() / 254
        assert (x[b : b + 256] - y[b : b + 256]).abs().max() <= bound * (1 + 1e-6)
    assert not torch.equal(x, y)  # it did quantize


def test_a_block_of_zeros_comes_back_as_zeros_beside_a_live_one():
    x = torch.cat([torch.zeros(256), torch.full((256,), 3.0)])
    y = dequantize(quantize(x, 256), 512, 256)
    assert torch.equal(y[:256], torch.zeros(256)) and torch.allclose(y[256:], x[256:])
    assert torch.isfinite(y).all()


def test_the_last_partial_block_has_its_own_scale_and_is_cut_back():
    x = torch.cat([torch.full((256,), 1000.0), torch.tensor([1e-3, -2e-3, 5e-4])])
    packed = quantize(x, 256)
    assert packed.numel() == row_bytes(259, 256) == 2 * 256 + 2 * 4  # two blocks of int8, two fp32 scales
    y = dequantize(packed, 259, 256, torch.bfloat16)
    assert y.shape == (259,) and y.dtype == torch.bfloat16
    assert torch.allclose(y[256:].float(), x[256:], rtol=0.02)  # not flattened by the big block's scale


# --- refusals, before any process group ---------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["parallel.zero_stage=0", QW], "parallel.quantized_weights=true quantizes a ZeRO collective, and "
                                    "parallel.zero_stage=0 has none"),
    (["parallel.zero_stage=0", QG], "set parallel.zero_stage to 1, 2 or 3, or quantized_gradients=false"),
    (["parallel.zero_stage=2", HPZ], "parallel.zero_stage=2 does not shard them; set parallel.zero_stage=3"),
    (["parallel.quantization_block=10"], "parallel.quantization_block=10 must be a multiple of 4"),
])
def test_config_refuses_zeropp_without_its_collective(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_hpz_must_divide_the_shard_group():
    batch = ["train.global_batch=8", "train.micro_batch=1"]
    cfg = load_config(None, ["parallel.hpz_partition_size=3", *batch])
    with pytest.raises(ConfigError, match=r"hpz_partition_size=3 must divide the ZeRO-3 shard group \(dp_shard = 4 "
                                          r"ranks at world size 4\); use hpz_partition_size=2 or 4"):
        ParallelDims.from_config(cfg, 4)
    ParallelDims.from_config(load_config(None, ["parallel.hpz_partition_size=2", *batch]), 4)


def test_cli_refusal_exits_2_before_any_process_group():
    # No peer listens on MASTER_PORT: reaching init_process_group would hang, not exit 2.
    r = run_trainer(["--config", "examples/tiny.toml", "--set", "parallel.hpz_partition_size=3"],
                    env={"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "parallel.hpz_partition_size=3 must divide the ZeRO-3 shard group" in r.stderr
    assert "Traceback" not in r.stderr


# --- training at world 4 ------------------------------------------------------------------------------------

LAYOUTS = [
    ("z3", layout(3), STEPS), ("z3_qw", layout(3, QW), STEPS), ("z3_qg", layout(3, QG), STEPS),
    ("z3_all", layout(3, QW, QG, HPZ), STEPS), ("z3_bf16", layout(3, prec="bf16"), 3),
    ("z2", layout(2), STEPS), ("z2_qw", layout(2, QW), STEPS), ("z2_qg", layout(2, QG), STEPS),
    ("z1_qw_qg", layout(1, QW, QG), 5),
]


# The world-4 runs (9 layouts, 4 processes) take about half a minute: they run with the slow tier (make test-ray)
# and, where marked compat, on the oldest torch (make test-compat).
WORLD4_TIER = pytest.mark.slow


@pytest.fixture(scope="module")
def world4():
    return run_ranks("tests.zeropp_jobs:train_zeropp", 4, {"base": BASE, "layouts": LAYOUTS}, timeout=600)


def close(a: list[float], b: list[float], rtol: float = RTOL) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


def comm(res, name: str, key: str) -> float:
    return res[0][name]["comm"][key]["bytes"]


@WORLD4_TIER
@pytest.mark.compat  # FSDP2's custom all-gather / reduce-scatter hooks and reshard_after_forward=<int> on 2.11 too
@pytest.mark.parametrize("z", [2, 3])
def test_qwz_all_gather_sends_int8_blocks_and_follows_the_unquantized_losses(world4, z):
    base, q = comm(world4, f"z{z}", "all_gather/dp_shard"), comm(world4, f"z{z}_qw", "all_gather/dp_shard")
    bf16 = comm(world4, "z3_bf16", "all_gather/dp_shard")
    assert bf16 == comm(world4, "z3", "all_gather/dp_shard") / 2
    assert q <= 0.30 * base and q <= 0.55 * (base / 2), (q, base)
    if z == 2:  # one bucket (the tiny model is far under bucket_mb): n rows of int8 and scales, exactly
        n, width = 4, base / 4 / 4
        assert q == n * row_bytes(int(width), 256)
    assert close(world4[0][f"z{z}_qw"]["losses"], world4[0][f"z{z}"]["losses"])
    assert world4[0][f"z{z}_qw"]["losses"] != world4[0][f"z{z}"]["losses"]  # the weights were quantized


@WORLD4_TIER
def test_qwz_replicas_never_drift_apart(world4):
    """ZeRO-2 keeps whole parameters on every rank: after 20 quantized steps they are bitwise identical
    (the owner of each chunk computes with the dequantized values every other rank received)."""
    assert len({r["z2_qw"]["digest"] for r in world4}) == 1
    assert len({r["z1_qw_qg"]["digest"] for r in world4}) == 1


@WORLD4_TIER
def test_zero1_quantizes_both_collectives_and_memory_counts_the_separate_master(world4):
    res = world4[0]["z1_qw_qg"]
    assert {"all_to_all/dp_shard", "all_gather/dp_shard"} <= res["comm"].keys()
    assert close(res["losses"], world4[0]["z2"]["losses"][:5])
    for r in world4:  # fp32 qwZ: a master copy beside the parameter, in the prediction too
        for name in ("z2_qw", "z1_qw_qg"):
            m, p = r[name]["memory"], r[name]["predicted"]
            assert abs(m["optimizer"] - p["optimizer"]) <= 0.05 * p["optimizer"], (name, m, p)


@WORLD4_TIER
@pytest.mark.parametrize("z", [2, 3])
def test_qgz_reduce_scatters_int8_by_all_to_all(world4, z):
    base = comm(world4, f"z{z}", "reduce_scatter/dp_shard")
    res = world4[0][f"z{z}_qg"]
    assert "reduce_scatter/dp_shard" not in res["comm"]
    q = res["comm"]["all_to_all/dp_shard"]["bytes"]
    assert q <= 0.55 * (base / 2) and q <= 0.30 * base, (q, base)
    assert close(res["losses"], world4[0][f"z{z}"]["losses"])


@WORLD4_TIER
@pytest.mark.compat
def test_all_three_keep_the_backward_all_gather_inside_each_group(world4):
    """World 4 as two "nodes" of 2 ranks (hpz_partition_size=2): the forward all-gathers go across all
    four ranks (int8), every backward all-gather stays within the rank's own pair, counted per group."""
    base = world4[0]["z3"]["gathers"]
    for rank, r in enumerate(world4):
        pair = (0, 1) if rank < 2 else (2, 3)
        groups: dict[tuple, int] = {}
        for ranks, _ in r["z3_all"]["gathers"]:
            groups[ranks] = groups.get(ranks, 0) + 1
        assert set(groups) == {(0, 1, 2, 3), pair}, groups
        # What crossed the pairs without hpZ, beyond the forward's gathers, now stays within the pair.
        assert groups[pair] == len(base) - groups[(0, 1, 2, 3)] > 0
    assert close(world4[0]["z3_all"]["losses"], world4[0]["z3"]["losses"])


def test_step_log_has_comm_bytes_per_kind(tmp_path):
    """``--log-file`` rows carry this step's bytes per collective kind; qwZ's all-gather is the int8 rows
    (trainer.cli's run in 4 processes: qwZ end to end in the fast tier)."""
    log = tmp_path / "steps.jsonl"
    over = ["parallel.zero_stage=2", QW, "train.steps=3", "data.max_bytes=300000", 'parallel.mixed_precision="fp32"',
            "train.global_batch=8", "train.micro_batch=1"]
    codes = run_ranks("tests.zeropp_jobs:logged_run", 4, {"config": "examples/tiny.toml", "overrides": over,
                                                          "log": str(log)})
    assert codes == [0] * 4
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 3
    for row in rows[1:]:
        c = row["comm_bytes"]
        assert c == rows[1]["comm_bytes"]  # the same traffic every step
        # fp32 gradients reduce-scattered (4 rows of width w) after each of 2 micro-batches (8 samples over
        # dp 4), the parameters all-gathered once as 4 int8 rows with their scales.
        width = c["reduce_scatter"] // (4 * 4 * 2)
        assert c["all_gather"] == 4 * row_bytes(width, 256)


def _200_steps_end_within_1_percent(pair: tuple[str, str], plain: list[str], quantized: list[str]) -> None:
    base, q = pair
    layouts = [(base, plain, 200), (q, quantized, 200)]
    res = run_ranks("tests.zeropp_jobs:train_zeropp", 4, {"base": BASE, "layouts": layouts}, timeout=1200)[0]
    assert abs(res[q]["losses"][-1] - res[base]["losses"][-1]) <= RTOL * res[base]["losses"][-1], (
        base, res[base]["losses"][-1], res[q]["losses"][-1])


@pytest.mark.slow
def test_200_steps_of_zero3_with_qwz_qgz_and_hpz_end_within_1_percent_of_unquantized():
    _200_steps_end_within_1_percent(("z3", "z3_all"), layout(3), layout(3, QW, QG, HPZ))


@pytest.mark.exhaustive  # the same two quantized collectives as the ZeRO-3 run above (slow tier), under ZeRO-2
def test_200_steps_of_zero2_with_qwz_and_qgz_end_within_1_percent_of_unquantized():
    _200_steps_end_within_1_percent(("z2", "z2_qw_qg"), layout(2), layout(2, QW, QG))


# --- the planner ---------------------------------------------------------------------------------------------


def test_plan_counts_int8_rows_hpz_groups_and_the_secondary_shard():
    from trainer.plan.accounting import Layout, hpz_secondary_bytes
    from trainer.plan.comm import step_comm, zeropp_savings
    from trainer.plan.cost import DEVICES
    from trainer.plan.search import evaluate

    batch = ["train.global_batch=16", "train.micro_batch=1", 'model.preset="small"']
    plain = load_config(None, batch)
    zpp = load_config(None, [*batch, QW, QG, "parallel.hpz_partition_size=4"])
    dims = ParallelDims.from_config(zpp, 16)

    def by(cfg):
        return {(c["kind"], c["axis"]): c["bytes"] for c in step_comm(cfg, dims, 0, mixed=True)}

    before, after = by(plain), by(zpp)
    wire = 1 + 4 / 256
    # The forward's gathers go int8 across the 16 ranks, the backward's bf16 within groups of 4.
    assert after[("all_gather", "dp_shard")] == pytest.approx(before[("all_gather", "dp_shard")] / 2 * wire / 2, 1e-6)
    assert after[("all_gather", "hpz")] == pytest.approx(before[("all_gather", "dp_shard")] / 2 * (3 / 4) / (15 / 16),
                                                         1e-6)
    assert after[("all_to_all", "dp_shard")] == pytest.approx(before[("reduce_scatter", "dp_shard")] * wire / 4, 1e-6)
    saved = zeropp_savings(zpp, dims, 0, mixed=True)
    assert saved["qwZ"]["shard_axis_bytes_saved"] > 0 and saved["qgZ"]["shard_axis_bytes_saved"] > 0
    assert saved["hpZ"]["shard_axis_bytes_saved"] > 0
    assert hpz_secondary_bytes(zpp, dims, 0, mixed=True) > 0 == hpz_secondary_bytes(plain, dims, 0, mixed=True)
    # A ZeRO-2 candidate of the search drops hpZ (it has no sharded parameters) rather than being refused.
    assert evaluate(zpp, Layout(1, 16, 1, 1, 2), DEVICES["h100"]).valid


@pytest.mark.slow  # three runs at world 4: about 25 s here
def test_qwz_resumes_from_a_checkpoint_exactly(world4, tmp_path):
    """The checkpoint holds the full-precision masters; a resumed ZeRO-2 qwZ run gathers them quantized again
    and trains on exactly as the uninterrupted run (fp32 losses bit for bit)."""
    over = ["parallel.zero_stage=2", QW, QG, "data.max_bytes=300000", 'parallel.mixed_precision="fp32"',
            "train.global_batch=8", "train.micro_batch=1", "train.warmup_steps=0",
            "train.min_lr_ratio=1.0"]  # a constant lr: the 2-step run's schedule is the 4-step run's
    ckpt = [f'checkpoint.url="file://{tmp_path}/ckpt"', "checkpoint.interval_steps=2"]

    def run(name: str, *extra: str) -> list[float]:
        log = tmp_path / f"{name}.jsonl"
        codes = run_ranks("tests.zeropp_jobs:logged_run", 4, {"config": "examples/tiny.toml",
                                                              "overrides": [*over, *extra], "log": str(log)})
        assert codes == [0] * 4
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    whole = run("whole", "train.steps=4")
    assert len(run("first", "train.steps=2", *ckpt)) == 2
    assert run("resumed", "train.steps=4", "checkpoint.resume=true", *ckpt) == whole[2:]


def test_a_torch_without_fsdp2_comm_hooks_is_refused_by_name(monkeypatch):
    """Where FSDP2 lacks set_custom_all_gather / set_custom_reduce_scatter (trainer.compat finds none),
    ZeRO-3 with quantized collectives is refused before any process group, naming the keys and the fix."""
    from trainer import compat
    from trainer.parallel.parallelize import check_device_features

    pcfg = load_config(None, [QW]).parallel
    check_device_features(pcfg, torch.device("cpu"))  # 2.11 and 2.13 both have the hooks
    monkeypatch.setattr(compat, "fsdp_comm_bases", lambda: None)
    with pytest.raises(ConfigError, match=r"quantized_weights / quantized_gradients at zero_stage=3 need FSDP2's "
                                          r"custom all-gather and reduce-scatter hooks.*or zero_stage=2"):
        check_device_features(pcfg, torch.device("cpu"))
    check_device_features(load_config(None, [QW, "parallel.zero_stage=2"]).parallel, torch.device("cpu"))
