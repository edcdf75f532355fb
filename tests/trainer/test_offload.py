"""``[parallel] offload = "nvme"``: AdamW's state in per-rank files (trainer.zero.offload, trainer.zero.swapper).

Checked: the swapper's buffer pool bound, read-ahead order and write-back before a buffer is reused;
the piecewise update equal to torch's AdamW bit for bit; real gloo groups at world 1 (fp32, 20 steps;
bf16 with offload_params, 10) and world 2 (ZeRO-2, 20 steps; ZeRO-1 and 3, 10) with losses bitwise equal to
offload="none"; the peak resident set lower by more than 80% of the optimizer state; checkpoints and
the memory tier reading and loading the offloaded state like in-memory state, across world sizes with
offload on one side only; the refusals (exit 2); the planner's accounting.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from checkpointing.errors import ConfigError
from checkpointing.recovery.snapshot import MemorySnapshot
from tests.harness import run_ranks
from tests.checkpointing.test_checkpoint import assert_same, merged, plan
from trainer.config.load import load_config
from trainer.parallel.dims import ParallelDims
from trainer.zero.offload import NvmeAdamState
from trainer.zero.swapper import BufferPool, StateFile, Swapper

# Clipping active (a wrong global norm would show); buckets and offload buffers small enough for several.
BASE = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "data.max_bytes=60000", "data.seq_len=16",
        "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=0", "train.lr=3e-3",
        "train.grad_clip=0.5", "parallel.bucket_mb=0.02"]


def nvme(where, mb: float = 0.02) -> list[str]:
    """offload="nvme" with buffers small enough that the tiny model's state takes many units (and
    parameters larger than a unit are cut into pieces)."""
    return ['parallel.offload="nvme"', f'parallel.offload_dir="{where}"', f"parallel.offload_buffer_mb={mb}"]


# --- the swapper ------------------------------------------------------------------------------


class LoggedFile(StateFile):
    """A real state file that records each read and write: (op, file offset, buffer address)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.log: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def read_into(self, offset, out):
        super().read_into(offset, out)
        with self.lock:
            self.log.append(("r", offset, out.untyped_storage().data_ptr()))

    def write_from(self, offset, src):
        time.sleep(0.002)  # a slow disk: reads run ahead of writes
        super().write_from(offset, src)
        with self.lock:
            self.log.append(("w", offset, src.untyped_storage().data_ptr()))


def test_swapper_bounds_its_buffers_reads_ahead_and_writes_back_before_reuse(tmp_path):
    n_units, width = 12, 64
    f = LoggedFile(str(tmp_path / "s.f32"), n_units * width)
    pool = BufferPool(3, width)
    swapper = Swapper(f, pool)
    units = [[(k * width, width)] for k in range(n_units)]
    seen = []

    def compute(k, buf):
        seen.append((k, pool.in_use))
        time.sleep(0.003)
        buf.add_(k + 1)

    for _ in range(2):
        stats = swapper.run(units, compute)
    assert [k for k, _ in seen] == list(range(n_units)) * 2
    assert pool.max_in_use <= 3 and max(u for _, u in seen) <= 3 and pool.in_use == 0
    assert stats.read_bytes == stats.written_bytes == n_units * width * 4
    # Every write is done when run returns: the file holds both runs' updates.
    want = torch.arange(1, n_units + 1, dtype=torch.float32).repeat_interleave(width) * 2
    assert torch.equal(f.mapped(), want)
    reads = [off for op, off, _ in f.log if op == "r"]
    assert reads == [k * width for k in range(n_units)] * 2  # in unit order
    first_write = next(i for i, (op, _, _) in enumerate(f.log) if op == "w")
    assert first_write >= 2  # two reads ahead of the first write-back
    # A buffer is read into again only after the write of what was computed in it: r, w, r, w, ...
    for ptr in {p for _, _, p in f.log}:
        ops = [op for op, _, p in f.log if p == ptr]
        assert ops == ["r", "w"] * (len(ops) // 2), ops
    swapper.close()
    assert not os.path.exists(f.path)


def test_swapper_returns_every_buffer_when_the_update_fails(tmp_path):
    f = StateFile(str(tmp_path / "s.f32"), 8 * 16)
    pool = BufferPool(2, 16)
    swapper = Swapper(f, pool)

    def compute(k, buf):
        if k == 3:
            raise RuntimeError("boom")
        buf.add_(1)

    with pytest.raises(RuntimeError, match="boom"):
        swapper.run([[(k * 16, 16)] for k in range(8)], compute)
    assert pool.in_use == 0
    assert torch.equal(f.mapped()[:48], torch.ones(48)) and not f.mapped()[48:].any()  # units 0-2 written back
    swapper.close()


def test_piecewise_update_is_adamw_bit_for_bit(tmp_path):
    """Parameters larger than a unit (cut into pieces), a non-contiguous one, two weight-decay groups."""
    torch.manual_seed(0)
    cfg = load_config(None, nvme(tmp_path, mb=0.004))  # units of 128 elements
    shapes = [(40, 9), (3,), (300,), (17, 5)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    big = torch.randn(6, 20)
    ref.append(torch.nn.Parameter(big[:, :10]))  # non-contiguous, fits a unit
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref[:-1]]
    mine.append(torch.nn.Parameter(big.clone()[:, :10]))

    def adamw(params):
        return torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                                  {"params": params[2:], "weight_decay": 0.0}], lr=1e-2, foreach=True)

    a, b = adamw(ref), adamw(mine)
    state = NvmeAdamState(b, cfg, rank=0)
    assert len(state.units) > 5 and any(hi - lo < p.numel() for u in state.pieces for p, lo, hi, _ in u)
    for step in range(4):
        grads = [torch.randn(s) for s in shapes] + [torch.randn(6, 10)]
        for p, q, g in zip(ref, mine, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        state.step()
        for p, q in zip(ref, mine):
            assert torch.equal(p, q), step
    st = state.states()
    for p, q in zip(ref, mine):
        assert torch.equal(a.state[p]["exp_avg"], st[q]["exp_avg"])
        assert torch.equal(a.state[p]["exp_avg_sq"], st[q]["exp_avg_sq"])
        assert torch.equal(a.state[p]["step"], st[q]["step"])
    assert not any(b.state.values())  # torch's own AdamW never held the state
    path = state.file.path
    state.close()
    assert not os.path.exists(path)


def test_scratch_of_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    cfg = load_config(None, nvme(tmp_path))
    where = tmp_path / "run" / "rank0"
    where.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (where / f"adam-{gone.pid}-0.f32").write_bytes(b"\0" * 8)  # what a crashed run leaves
    (where / f"adam-{os.getppid()}-0.f32").write_bytes(b"\0" * 8)  # a live process's
    p = torch.nn.Parameter(torch.zeros(4))
    state = NvmeAdamState(torch.optim.AdamW([p]), cfg, rank=0)
    assert sorted(os.listdir(where)) == sorted([f"adam-{os.getppid()}-0.f32", os.path.basename(state.file.path)])
    state.close()


# --- training in real gloo groups -------------------------------------------------------------


BF16 = ['parallel.mixed_precision="bf16"']
PARAMS = ["parallel.offload_params=true"]


def test_world1_losses_bitwise_equal_to_no_offload(tmp_path):
    """fp32 for 20 steps; bf16 with its fp32 masters in the file too (offload_params) for 10."""
    layouts = [("none", []), ("nvme", nvme(tmp_path)), ("bf16", BF16, 10),
               ("bf16_params", BF16 + nvme(tmp_path) + PARAMS, 10)]
    res = run_ranks("tests.jobs:train_layouts", 1, {"base": BASE, "steps": 20, "layouts": layouts, "params": True})[0]
    assert res["nvme"]["losses"] == res["none"]["losses"]
    assert_same(res["nvme"]["params"], res["none"]["params"], "world 1")
    assert res["bf16_params"]["losses"] == res["bf16"]["losses"]
    assert_same(res["bf16_params"]["params"], res["bf16"]["params"], "world 1, bf16, offload_params")
    # The masters left memory with the state: what the optimizer holds is the buffer pool (and step counts).
    assert res["bf16_params"]["memory"]["optimizer"] < 0.2 * res["bf16"]["memory"]["optimizer"]
    assert os.listdir(tmp_path / "run" / "rank0") == []  # the scratch file went with its optimizer


def test_world2_zero1_2_3_losses_bitwise_equal_to_no_offload(tmp_path):
    """ZeRO-2 for 20 steps, ZeRO-1 and ZeRO-3 (FSDP2's DTensor shards) for 10 (the fast tier's time)."""
    layouts = [(f"{o}{z}", [f"parallel.zero_stage={z}", *(nvme(tmp_path) if o == "nvme" else [])], 20 if z == 2 else 10)
               for z in (1, 2, 3) for o in ("none", "nvme")]
    res = run_ranks("tests.jobs:train_layouts", 2, {"base": BASE, "steps": 20, "layouts": layouts})
    for r in res:
        assert r["nvme1"]["losses"] == r["none1"]["losses"]
        assert r["nvme2"]["losses"] == r["none2"]["losses"]
        assert r["nvme3"]["losses"] == r["none3"]["losses"]
        # Held: the buffer pool instead of the state (a quarter of the tiny model's 8 bytes per parameter).
        assert r["nvme2"]["memory"]["optimizer"] < 0.25 * r["none2"]["memory"]["optimizer"]


SMALL = ["model.preset=\"small\"", "model.n_layers=2", "data.max_bytes=300000", "data.seq_len=16",
         "train.global_batch=2", "train.micro_batch=2", "train.warmup_steps=0"]


@pytest.mark.slow  # two fresh processes (the peak is per process) with a 6.6M-parameter model
def test_peak_rss_drops_by_the_optimizer_state(tmp_path):
    """Fresh processes (VmHWM is the process's own peak): the small preset's widths, two blocks, ~6.6M
    parameters, ~53 MB of AdamW state against 1 MiB of buffers."""
    none = run_ranks("tests.offload_jobs:peak_rss", 1, {"base": SMALL, "steps": 1}, fresh=True)[0]
    off = run_ranks("tests.offload_jobs:peak_rss", 1, {"base": SMALL, "steps": 1, "layout": nvme(tmp_path, 1)},
                    fresh=True)[0]
    assert off["losses"] == none["losses"]
    assert none["state_bytes"] > 40e6
    saved = none["peak_rss"] - off["peak_rss"]
    assert saved >= 0.8 * none["state_bytes"], (saved, none["state_bytes"], none["peak_rss"], off["peak_rss"])
    assert off["swap"]["max_buffers_in_use"] <= 4 and off["swap"]["read_bytes"] == 2 * none["state_bytes"]


# --- checkpoints and the memory tier ----------------------------------------------------------


def test_checkpoints_carry_offloaded_state_across_world_sizes(tmp_path):
    """Saved from offload at world 2 (ZeRO-2), loaded without it at world 1 and with it at world 1: the
    same state, the same losses after; and back: saved without offload at world 1, loaded into it at
    world 2 under ZeRO-3 (DTensor state over the file). The checkpoint holds the state itself: the
    offload files are deleted before the loads."""
    url = f"file://{tmp_path / 'ckpt'}"
    z2 = ["parallel.zero_stage=2"]
    saved = [r[0] for r in plan(2, url, [{"layout": z2 + nvme(tmp_path / "a"), "train": 3, "save": "off2"}])]
    assert not os.listdir(tmp_path / "a" / "run" / "rank0")
    w1 = plan(1, url, [{"layout": [], "load": "off2", "state_before_train": True, "train": 3, "save": "none1"},
                       {"layout": nvme(tmp_path / "b"), "load": "off2", "state_before_train": True, "train": 3}])[0]
    assert_same(w1[0]["state_loaded"], merged(saved), "offload world 2 -> none world 1")
    assert_same(w1[1]["state_loaded"], merged(saved), "offload world 2 -> offload world 1")
    assert w1[0]["losses"] == w1[1]["losses"]
    assert_same(w1[0]["state"], w1[1]["state"], "after 3 more steps")
    back = [r[0] for r in plan(2, url, [{"layout": ["parallel.zero_stage=3"] + nvme(tmp_path / "c"), "load": "none1",
                                         "state_before_train": True}])]
    assert_same(merged(back, "state_loaded"), w1[0]["state"], "none world 1 -> offload world 2")


def test_checkpoints_carry_offloaded_masters(tmp_path):
    """bf16 with offload_params: the checkpoint's weights are the file's masters; loaded into in-memory
    masters and back into the file, the same state and the same losses after."""
    url = f"file://{tmp_path / 'ckpt'}"
    off = BF16 + nvme(tmp_path / "p") + PARAMS
    w1 = plan(1, url, [{"layout": off, "train": 3, "save": "p"},
                       {"layout": BF16, "load": "p", "state_before_train": True, "train": 2},
                       {"layout": off, "load": "p", "state_before_train": True, "train": 2}])[0]
    assert_same(w1[1]["state_loaded"], w1[0]["state"], "masters in the file -> in memory")
    assert_same(w1[2]["state_loaded"], w1[0]["state"], "masters in the file -> in the file")
    assert w1[1]["losses"] == w1[2]["losses"]
    assert_same(w1[1]["state"], w1[2]["state"], "after 2 more steps")


def _sources(ranks):
    out = {}
    for r in ranks:
        out.update({k: bytes(v) for k, v in MemorySnapshot.from_bytes(r["snapshot"]).sources().items()})
    return out


def test_memory_tier_snapshots_and_restores_offloaded_state(tmp_path):
    """A world-2 snapshot of offloaded state, restored into offloaded state at world 2 (what a killed rank's
    replacement does): bitwise the durable checkpoint of the same step, and the same next loss."""
    base = BASE + [f'checkpoint.url="file://{tmp_path / "ckpt"}"']
    layout = ["parallel.zero_stage=1"] + nvme(tmp_path / "o")
    ranks = run_ranks("tests.memory_tier_jobs:snapshot", 2, {"base": base, "layout": layout, "train": 2,
                                                             "run_id": "t"})
    assert all(r["status"] == "agreed" for r in ranks)
    out = run_ranks("tests.memory_tier_jobs:restore", 2, {"base": base, "layout": layout, "run_id": "t",
                                                          "snapshot": ranks[1]["snapshot"],
                                                          "sources": _sources(ranks)})
    for r in out:
        assert r["memory_step"] == r["durable_step"] == 2
        assert_same(r["memory"], r["durable"], "memory vs durable")
        assert_same(r["memory"], merged(ranks), "memory vs the saved state")
        assert r["memory_loss"] == r["durable_loss"]


# --- refusals ---------------------------------------------------------------------------------


def test_offload_params_needs_nvme():
    with pytest.raises(ConfigError, match=r'offload_params=true needs parallel.offload="nvme"'):
        load_config(None, ["parallel.offload_params=true"])


@pytest.mark.parametrize("case", ["unwritable", "no_room", "no_dir"])
def test_refusals_exit_2_naming_the_key(case, tmp_path, capsys, monkeypatch):
    """``python -m trainer``'s path, in this process: refused before any process group, exit 2."""
    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "a_file").write_text("")
    sets = {
        "unwritable": nvme(tmp_path / "a_file" / "offload"),  # a directory that cannot be made
        "no_room": nvme(tmp_path) + ["model.dim=65536", "model.n_layers=20000"],  # petabytes of state
        "no_dir": ['parallel.offload="nvme"'],
    }[case]
    assert main([a for s in ("train.steps=1", *BASE, *sets) for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    want = {"unwritable": "is not writable", "no_room": "MiB free", "no_dir": "needs parallel.offload_dir"}[case]
    assert "parallel.offload" in err and want in err, err[-2000:]


# --- the planner -------------------------------------------------------------------------------


def test_plan_moves_the_offloaded_state_to_disk_and_reports_the_bandwidth(tmp_path, capsys):
    from trainer.observe.device_memory import local_param_count
    from trainer.plan.accounting import rank_memory
    from trainer.plan.cli import main

    z2 = ["parallel.zero_stage=2"]
    on_cfg, off_cfg = load_config(None, BASE + z2), load_config(None, BASE + z2 + nvme(tmp_path, mb=1))
    on = rank_memory(on_cfg, ParallelDims.from_config(on_cfg, 2), 0, mixed=False)
    off = rank_memory(off_cfg, ParallelDims.from_config(off_cfg, 2), 0, mixed=False)
    share = -(-local_param_count(off_cfg, ParallelDims.from_config(off_cfg, 2), 0) // 2)
    assert off["nvme_state"] == on["optimizer"] - off["optimizer"] == 8 * share
    assert off["nvme_bytes_per_step"] == 16 * share and off["host_offload_buffers"] == 2**20
    assert off["total"] < on["total"] and off["host_staging"] == on["host_staging"]  # a checkpoint copies it all
    args = ["examples/tiny.toml", "--workers", "2", "--device", "cpu", "--budget-s", "0.5", "--json",
            "--nvme-bw", "2GB/s", *[a for s in z2 + nvme(tmp_path, mb=1) for a in ("--set", s)]]
    bf16 = load_config(None, BASE + z2 + BF16 + nvme(tmp_path, mb=1) + PARAMS)
    masters = rank_memory(bf16, ParallelDims.from_config(bf16, 2), 0, mixed=True)
    assert masters["nvme_state"] == 12 * share and masters["optimizer"] == 0  # m, v and the fp32 master
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)["plan"]["nvme"]
    assert doc["io_s"] == pytest.approx(doc["bytes_per_step"] / 2e9) and doc["needed_bw"] > 0
    assert main(args[:-len(z2 + nvme(tmp_path, mb=1)) * 2 - 2] + ["--nvme-bw", "fast"]) == 2
    assert "--nvme-bw 'fast'" in capsys.readouterr().err
