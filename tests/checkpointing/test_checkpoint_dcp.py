"""Checkpoints are standard DCP: stock PyTorch reads what etrain commits, and etrain adopts what stock
DCP writes.

Stock readers (``FileSystemReader`` with ``dcp.load``, ``dcp_to_torch_save``, ``FsspecReader`` on the
moto S3 server) load committed step directories, a ZeRO-3 world-2 one included, and get exactly the
tensors etrain's own load gets. A training state written by stock ``dcp.save`` is adopted
(``etrain ckpt adopt``) and resumed by the trainer, which then trains on exactly as the run that
wrote it. Anything else given to adopt exits 2 naming what is wrong. The manifest records the
resolved config; a resume under a changed config names the fields, and a format-2 checkpoint
(raw items, ``ItemLocation``) still loads.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from checkpointing import cli as ckpt_cli
from checkpointing.dcp.format import envelope, item_tensor
from checkpointing.dcp.reader import load_metadata
from checkpointing.lock import WriterLock
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import MANIFEST_NAME, config_changes
from checkpointing.names import redact_config
from tests.harness import ROOT, run_ranks

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "checkpoint_v2")
BASE = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "data.max_bytes=60000", "data.seq_len=16",
        "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1", "train.steps=20",
        "metrics.enabled=false"]


def varied_state(seed: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(int(seed * 1000))
    return {"model": {"w": torch.randn(33, 7, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(6, dtype=torch.int64) * int(seed), "mask": torch.tensor([True, False, True]),
                      "scalar": torch.tensor(seed), "empty": torch.zeros(0, 5)},
            "optim": {"w": {"exp_avg": torch.randn(33, 7, generator=g), "step": torch.tensor(3.0)}},
            "extra": {"note": f"v{seed}"}}


def zeros_like(state):
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else ""


def assert_equal(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (path, sorted(a.keys() ^ b.keys()))
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, path


def save(mgr: CheckpointManager, step: int, state: dict):
    res = mgr.save(step, state, layout={"world_size": 1}, config_hash="h",
                   trainer_state={"step": step, "samples_consumed": 4 * step}, config={"train": {"lr": 0.1}})
    mgr.wait()
    assert res is not None and res.status == "committed", res
    return res


# --- stock readers load what etrain commits ------------------------------------------------------


@pytest.mark.compat
def test_stock_dcp_readers_load_a_committed_step_directory(storage_url, tmp_path):
    mgr = CheckpointManager(storage_url, "r", async_save=False, keep_last=10)
    save(mgr, 1, varied_state(1.0))
    save(mgr, 2, varied_state(2.0))  # the second save reuses the first's plan: the same format
    for step in (1, 2):
        url = mgr.url_of(step)
        into = zeros_like(varied_state())
        if storage_url.startswith("file://"):
            path = url.removeprefix("file://")
            dcp.load(into, storage_reader=FileSystemReader(path), no_dist=True)
            out = str(tmp_path / f"step{step}.pt")
            dcp_to_torch_save(path, out)
            assert_equal(torch.load(out, weights_only=True), varied_state(float(step)))
        else:
            dcp.load(into, storage_reader=FsspecReader(url), no_dist=True)
        assert_equal(into, varied_state(float(step)))
        ours = zeros_like(varied_state())
        assert mgr.load(ours, step=step).format_version == 3
        assert_equal(ours, varied_state(float(step)))


@pytest.mark.compat
def test_dcp_to_torch_save_reads_a_zero3_checkpoint_of_a_trainer_at_world_2(tmp_path):
    url = f"file://{tmp_path}/ck"
    res = run_ranks("tests.ckpt_jobs:run_plan", 2, {"base": BASE + [f'checkpoint.url="{url}"'], "actions": [
        {"layout": ["parallel.zero_stage=3"], "train": 2, "save": "z3"}]}, timeout=600)
    assert res[0][0]["saves"] == [(2, "committed", "")], res[0][0]["saves"]
    out = str(tmp_path / "z3.pt")
    dcp_to_torch_save(f"{tmp_path}/ck/z3/checkpoints/step_000000002", out)
    stock = torch.load(out, weights_only=True)
    flat = {f"model.{k}": v for k, v in stock["model"].items()}
    flat.update({f"optim.{k}.{name}": v for k, st in stock["optim"].items() for name, v in st.items()})
    assert_equal(flat, res[0][0]["state"])


@pytest.mark.compat
def test_the_envelope_is_torch_save_and_etrain_reads_it_in_place():
    for dtype, shape in [(torch.float32, (3, 4)), (torch.bfloat16, (5,)), (torch.int64, ()), (torch.bool, (7,)),
                         (torch.float16, (0, 3)), (torch.float64, (2, 1, 3))]:
        t = torch.arange(max(1, int(torch.Size(shape).numel()))).to(dtype)[: torch.Size(shape).numel()].reshape(shape)
        env = envelope(dtype, shape)
        assert len(env.prefix) % 64 == 0  # the tensor's bytes stay 64-byte aligned in the file
        blob = env.prefix + t.numpy().tobytes() + env.suffix if dtype != torch.bfloat16 else \
            env.prefix + t.view(torch.int16).numpy().tobytes() + env.suffix
        assert_equal(torch.load(io.BytesIO(blob), weights_only=True), t)
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        got = item_tensor(b"x" * 64 + blob, _StorageInfo("f.distcp", 64, len(blob)), dtype, shape, "t")
        assert_equal(got, t)
    # An archive that torch.save wrote for a non-contiguous tensor is read through torch.load.
    nc = torch.arange(12.0).reshape(3, 4).t()
    buf = io.BytesIO()
    torch.save(nc, buf)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    got = item_tensor(buf.getvalue(), _StorageInfo("f.distcp", 0, len(buf.getvalue())), torch.float32, (4, 3), "t")
    assert torch.equal(got, nc)


@pytest.mark.compat
def test_a_format_2_checkpoint_still_loads(tmp_path, capsys):
    shutil.copytree(FIXTURE, tmp_path / "old")
    mgr = CheckpointManager(f"file://{tmp_path}/old", "v2")
    expected = torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=True)
    into = zeros_like(expected)
    into["extra"]["ids"] = torch.zeros(5, dtype=torch.int64)
    m = mgr.load(into)
    assert m.format_version == 2 and m.config == {} and m.step == 3
    assert_equal(into, expected)
    assert mgr.verify(3) == []
    assert ckpt_cli.main(["inspect", f"file://{tmp_path}/old/v2"]) == 0
    assert "hash 0123456789abcdef" in capsys.readouterr().out


# --- adopt ----------------------------------------------------------------------------------------


def stock_save_job(payload: dict) -> dict:
    """World 1: train, save the training state with stock ``dcp.save`` (plain tensors) to
    ``payload["dir"]``, then train on: what a run resumed from that save must reproduce."""
    from torch.distributed.tensor import DTensor

    from tests.ckpt_jobs import CPU, full_state
    from trainer.config.load import load_config
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    def plain(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    world = World.from_env()
    init_distributed(world, CPU)
    try:
        trainer = Trainer(load_config(None, payload["base"]), world, device=CPU)
        for _ in range(payload["steps"]):
            trainer.train_step()
        state = trainer.optimizer.checkpoint_state()
        state = {"model": {k: plain(v) for k, v in state["model"].items()},
                 "optim": {k: {n: plain(v) for n, v in st.items()} for k, st in state["optim"].items()}}
        dcp.save(state, storage_writer=FileSystemWriter(payload["dir"]), no_dist=True)
        out = {"samples_consumed": trainer.samples_consumed, "state": full_state(trainer)}
        out["losses"] = [trainer.train_step().loss for _ in range(payload["more"])]
        return out
    finally:
        shutdown_distributed()


@pytest.mark.compat
def test_a_stock_dcp_checkpoint_is_adopted_and_resumed(tmp_path, capsys):
    url = f"file://{tmp_path}/ck"
    step_dir = tmp_path / "ck/adopted/checkpoints/step_000000002"
    (ref,) = run_ranks("tests.checkpointing.test_checkpoint_dcp:stock_save_job", 1,
                       {"base": BASE, "dir": str(step_dir), "steps": 2, "more": 2})
    assert ref["samples_consumed"] == 8
    assert CheckpointManager(url, "adopted").committed_steps() == []  # no manifest: not a checkpoint yet
    code = ckpt_cli.main(["adopt", f"{url}/adopted/checkpoints/step_000000002", "--samples-consumed", "8"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "adopted file://" in out.out and "as step 2 of run 'adopted'" in out.out
    mgr = CheckpointManager(url, "adopted")
    m = mgr.read_manifest(2)
    assert m.trainer_state == {"step": 2, "samples_consumed": 8} and m.config_hash == "" and mgr.verify(2) == []
    assert {f.path for f in m.files} == {".metadata", "__0_0.distcp"}
    # Adopting it again is refused: committed means immutable.
    assert ckpt_cli.main(["adopt", f"{url}/adopted/checkpoints/step_000000002", "--samples-consumed", "8"]) == 2
    assert "is committed already" in capsys.readouterr().err
    (res,) = run_ranks("tests.ckpt_jobs:run_plan", 1, {"base": BASE + [f'checkpoint.url="{url}"'], "actions": [
        {"load": "adopted", "state_before_train": True, "train": 2, "state": False}]})
    res = res[0]
    assert res["loaded_step"] == 2 and res["samples_consumed"] == 16
    assert_equal(res["state_loaded"], ref["state"])
    assert res["losses"] == ref["losses"]  # the same data, the same optimizer state: the same run
    assert any("records no config (adopted)" in w for w in res["warnings"]), res["warnings"]


def test_an_fsspec_written_checkpoint_on_s3_is_adopted_into_a_run(s3_server):
    from tests.conftest import new_bucket

    bucket = new_bucket(s3_server)
    state = varied_state(3.0)
    state["model"]["t"] = torch.arange(12.0).reshape(3, 4).t()  # torch.save keeps its strides: read via torch.load
    dcp.save(state, storage_writer=FsspecWriter(f"s3://{bucket}/exported"), no_dist=True)
    run = f"s3://{bucket}/runs/imported"
    assert ckpt_cli.main(["adopt", f"s3://{bucket}/exported", "--into", run, "--samples-consumed", "40"]) == 2
    assert ckpt_cli.main(["adopt", f"s3://{bucket}/exported", "--into", run, "--step", "10",
                          "--samples-consumed", "40"]) == 0
    mgr = CheckpointManager(f"s3://{bucket}/runs", "imported")
    assert mgr.committed_steps() == [10] and mgr.verify(10) == []
    into = zeros_like(state)
    m = mgr.load(into)
    assert m.step == 10 and m.trainer_state["samples_consumed"] == 40 and m.extra["adopted_from"].endswith("exported")
    assert_equal(into, state)


def _stock_dir(path) -> dict:
    dcp.save(varied_state(), storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return {n: (path / n).read_bytes() for n in os.listdir(path)}


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_adopt_refuses_what_is_not_a_dcp_checkpoint(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    step = tmp_path / "ck/r/checkpoints/step_000000005"
    url = f"file://{step}"

    def refused(*expect: str, args=("--samples-consumed", "20"), target=url) -> None:
        code = ckpt_cli.main(["adopt", target, *args])
        err = capsys.readouterr().err
        assert code == 2 and "Zq9sEkr1t" not in err, err
        for e in expect:
            assert e in err, err
        assert not (step / MANIFEST_NAME).exists() and not marker.exists()

    refused("is not a DCP checkpoint: nothing is there")
    step.mkdir(parents=True)
    (step / "notes.txt").write_text("hello")
    refused("is not a DCP checkpoint: it has no .metadata")
    (step / ".metadata").write_bytes(os.urandom(200))
    refused("is not a DCP checkpoint", ".metadata is not valid DCP metadata")
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    refused("is not allowed in DCP metadata")
    shutil.rmtree(step)
    good = _stock_dir(step)
    md = load_metadata(good[".metadata"], "x")
    (shard,) = [n for n in good if n.endswith(".distcp")]
    (step / shard).unlink()
    refused(f"an item is in {shard}, which is missing")
    (step / shard).write_bytes(good[shard][:-100])
    refused("an item lies outside the files")
    # A tensor item's bytes that are no torch.save archive; a non-tensor item that is a pickle payload.
    bad = bytearray(good[shard])
    loc_w = next(loc for idx, loc in md.storage_data.items() if idx.fqn == "model.w")
    bad[loc_w.offset : loc_w.offset + 64] = b"\0" * 64
    (step / shard).write_bytes(bytes(bad))
    refused("'model.w' is not a tensor saved by torch.save")
    payload = pickle.dumps(_Payload(str(marker)))
    loc_n = next(loc for idx, loc in md.storage_data.items() if idx.fqn == "extra.note")
    bad = bytearray(good[shard])
    bad[loc_n.offset : loc_n.offset + loc_n.length] = (payload + b"." * loc_n.length)[: loc_n.length]
    (step / shard).write_bytes(bytes(bad))
    refused("'extra.note' is not plain data")
    # An item location that leaves the directory.
    (step / shard).write_bytes(good[shard])
    escaped = dataclasses.replace(md, storage_data={idx: dataclasses.replace(loc, relative_path="../" + loc.relative_path)
                                                    for idx, loc in md.storage_data.items()})
    (step / ".metadata").write_bytes(pickle.dumps(escaped))
    refused("not a *.distcp file of the directory")
    (step / ".metadata").write_bytes(good[".metadata"])
    # Bad flags and URLs, and a live writer of the run.
    refused("is not a step directory of a run", target=f"file://{tmp_path}/ck/r")
    refused("--samples-consumed must be an integer >= 0", args=("--samples-consumed", "-1"))
    refused("carries credentials", target="s3://AKIA:Zq9sEkr1t@b/x/checkpoints/step_000000005")
    lock = WriterLock(CheckpointManager(f"file://{tmp_path}/ck", "r").storage, "r")
    lock.acquire()
    try:
        refused("is being written by another process")
    finally:
        lock.release()
    # Through the real command line: exit 2, no traceback, and then the good directory is adopted.
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "ckpt", "adopt", url]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--samples-consumed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (step / shard).write_bytes(good[shard][:-1])
    r = subprocess.run([*cmd, "--samples-consumed", "20"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "lies outside the files" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (step / shard).write_bytes(good[shard])
    r = subprocess.run([*cmd, "--samples-consumed", "20"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert CheckpointManager(f"file://{tmp_path}/ck", "r").verify(5) == []


# --- the resolved config --------------------------------------------------------------------------


def test_the_manifest_records_the_config_and_a_changed_resume_names_the_fields(tmp_path):
    url = f"file://{tmp_path}/ck"
    res = run_ranks("tests.ckpt_jobs:run_plan", 1, {"base": BASE + [f'checkpoint.url="{url}"'], "actions": [
        {"train": 2, "save": "cfg", "state": False},
        {"load": "cfg", "state": False},
        {"load": "cfg", "layout": ["train.lr=0.001", "train.steps=30", "data.seq_len=8"], "state": False},
    ]})[0]
    assert not [w for w in res[1]["warnings"] if "config" in w], res[1]["warnings"]  # the same config: nothing said
    (warning,) = [w for w in res[2]["warnings"] if "different config" in w]
    assert "checkpoint step 2 was written with a different config: data.seq_len 16 -> 8, train.lr 0.003 -> 0.001, " \
           "train.steps 20 -> 30; the learning-rate schedule moves (train.lr, train.steps): step 2 trains at lr " \
           in warning, warning
    m = CheckpointManager(url, "cfg").read_manifest(2)
    assert m.format_version == 3 and m.config["model"]["dim"] == 32 and m.config["train"]["steps"] == 20
    assert "run_id" in m.config and m.config["checkpoint"]["url"] == url and len(m.config_hash) == 16


def test_config_redaction_and_changes():
    cfg = {"data": {"source": "s3://AKIA:SECRET@b/x?X-Amz-Signature=abc", "tokenizer": "bytes", "files": ("a", "b")},
           "checkpoint": {"url": "s3://b/runs?token=t0ps3cret"}, "train": {"lr": 0.1, "steps": 5}}
    clean = redact_config(cfg)
    text = json.dumps(clean)
    assert "SECRET" not in text and "abc" not in text and "t0ps3cret" not in text
    assert clean["data"]["tokenizer"] == "bytes" and clean["data"]["files"] == ["a", "b"]
    assert config_changes(clean, {**clean, "train": {"lr": 0.2, "steps": 5, "new": 1}}, ("train", "model")) == [
        ("train.lr", 0.1, 0.2)]
    assert config_changes({}, clean, ("train",)) == []
