"""The throughput features (docs/parallelism.md, "Throughput features"): ``parallel.compile``, the AdamW
implementation, selective activation checkpointing, the float8 refusal, and the CPU paths of the CUDA-only parts.

The compiled model must train as the eager one does: 5 losses within 1e-5 (inductor reorders
floating-point sums, so not bit for bit), on one process and in a 2-rank gloo FSDP group.
"""

from __future__ import annotations

import time

import pytest
import torch

from checkpointing.errors import ConfigError
from tests.harness import run_ranks
from trainer.config.load import load_config
from trainer.loop import Trainer
from trainer.parallel.compile import check_compile
from trainer.world import World

CPU = torch.device("cpu")
# The tiny preset, narrower and two blocks deep: one block graph to compile, in seconds.
BASE = ["model.dim=64", "model.ffn_hidden=192", "model.n_kv_heads=2", "model.n_layers=2",
        "data.max_bytes=200000", "data.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
        "train.warmup_steps=0", 'parallel.mixed_precision="fp32"']
STEPS = 5


def losses(overrides: list[str], steps: int = STEPS) -> list[float]:
    trainer = Trainer(load_config(None, BASE + overrides), World(), device=CPU)
    return [trainer.train_step().loss for _ in range(steps)]


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


# --- parallel.compile -------------------------------------------------------------------------


def test_compile_refused_without_a_compiler(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CXX", "no-such-c++")
    cfg = load_config(None, BASE + ["parallel.compile=true"])
    with pytest.raises(ConfigError, match=r"parallel\.compile=true .*C\+\+ compiler"):
        check_compile(cfg.parallel, CPU)


@pytest.mark.slow  # inductor's first build of the block takes a minute on a shared 2-core machine
def test_compiled_equals_eager_world_1():
    # On a machine without a C++ compiler this fails with the ConfigError that says so.
    check_compile(load_config(None, BASE + ["parallel.compile=true"]).parallel, CPU)
    eager = losses([])
    compiled = losses(["parallel.compile=true"])
    assert close(eager, compiled, 1e-5), (eager, compiled)
    # And under activation checkpointing (recomputation inside the compiled block).
    ac = losses(['parallel.activation_checkpoint="full"', "parallel.compile=true"])
    assert close(eager, ac, 1e-5), (eager, ac)


@pytest.mark.slow
def test_compiled_equals_eager_fsdp_and_pipeline_world_2():
    on, pp, sel = ["parallel.compile=true"], ["parallel.pp=2"], ['parallel.activation_checkpoint="selective"']
    out = run_ranks("tests.throughput_jobs:losses", 2, {"base": BASE, "steps": STEPS, "layouts": [
        ("eager", []), ("compiled", on), ("pp", pp), ("pp_compiled", pp + on), ("pp_compiled_sel", pp + on + sel)]})
    for rank in out:
        assert close(rank["eager"], rank["compiled"], 1e-5), rank
        assert close(rank["pp"], rank["pp_compiled"], 1e-5) and close(rank["pp"], rank["pp_compiled_sel"], 1e-5), rank
    assert out[0]["compiled"] == out[1]["compiled"]


# --- train.optimizer_impl ---------------------------------------------------------------------


def trained(overrides: list[str], steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(load_config(None, BASE + overrides), World(), device=CPU)
    out = [trainer.train_step().loss for _ in range(steps)]
    return out, {n: p.detach().clone() for n, p in trainer.parts.named_parameters()}, trainer


def test_adamw_auto_is_foreach_on_cpu_and_fused_agrees():
    auto, auto_params, trainer = trained([])
    group = trainer.optimizer.optimizer.param_groups[0]
    assert group["foreach"] and not group["fused"]  # the CPU default: what AdamW was before the key
    foreach, foreach_params, _ = trained(['train.optimizer_impl="foreach"'])
    assert auto == foreach and all(torch.equal(auto_params[n], foreach_params[n]) for n in auto_params)
    for impl in ("fused", "for_loop"):
        losses_, params, trainer = trained([f'train.optimizer_impl="{impl}"'])
        group = trainer.optimizer.optimizer.param_groups[0]
        assert group["fused"] == (impl == "fused") and not group["foreach"]
        assert close(foreach, losses_, 1e-5), (impl, foreach, losses_)
        for n, p in params.items():
            torch.testing.assert_close(p, foreach_params[n], rtol=1e-5, atol=1e-6, msg=f"{impl}: {n}")


def test_adamw_fused_under_fsdp_world_2():
    # ZeRO-3 steps the local shards with torch's functional AdamW: the fused kernels there too.
    fsdp = ["parallel.zero_stage=3"]
    out = run_ranks("tests.throughput_jobs:losses", 2, {
        "base": BASE, "steps": 3, "layouts": [("foreach", fsdp), ("fused", fsdp + ['train.optimizer_impl="fused"'])]})
    for rank in out:
        assert close(rank["foreach"], rank["fused"], 1e-5), rank


# --- activation_checkpoint = "selective" --------------------------------------------------------

AC_BASE = [o for o in BASE if not o.startswith(("data.seq_len", "train.micro_batch"))] + [
    "data.seq_len=128", "train.micro_batch=4"]


def ac_run(mode: str, base: list[str] = AC_BASE) -> dict:
    """3 steps' losses, then one micro-batch's forward (the bytes it leaves for backward) and backward
    (the gradients) under ``parallel.activation_checkpoint=mode``."""
    from tests.jobs import LiveBytes

    trainer = Trainer(load_config(None, base + [f'parallel.activation_checkpoint="{mode}"']), World(), device=CPU)
    losses_ = [trainer.train_step().loss for _ in range(3)]
    inputs, targets = trainer.batcher.tokens(trainer.batcher.local_positions(0))
    mb = trainer.cfg.train.micro_batch
    trainer.optimizer.zero_grad()
    with LiveBytes() as live:
        loss = trainer.parts.loss(trainer.parts.forward(inputs[:mb]), targets[:mb])
        held = live.live
        loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.parts.named_parameters()}
    return {"losses": losses_, "loss": loss.item(), "grads": grads, "held": held, "peak": live.peak}


def test_selective_ac_is_bitwise_none_and_holds_less():
    none, sel, full = ac_run("none"), ac_run("selective"), ac_run("full")
    assert sel["losses"] == none["losses"] and sel["loss"] == none["loss"], (none["losses"], sel["losses"])
    assert sel["grads"].keys() == none["grads"].keys()
    for n, g in none["grads"].items():
        assert torch.equal(sel["grads"][n], g), n
    # Norms, SwiGLU's activation and product, the rotary embeddings are recomputed; matmuls are kept.
    assert full["held"] < sel["held"] < 0.85 * none["held"], (none["held"], sel["held"], full["held"])
    assert sel["peak"] < none["peak"], (none["peak"], sel["peak"])


def test_selective_ac_under_tensor_parallelism_is_bitwise_none():
    # The matmuls run on DTensor shards and the all-reduces (reduce-scatters under sequence parallelism)
    # are saved: recomputation sees the same values.
    tp, sel = ["parallel.tp=2", "train.micro_batch=4"], ['parallel.activation_checkpoint="selective"']
    sp = [*tp, "parallel.sequence_parallel=true"]
    out = run_ranks("tests.throughput_jobs:losses", 2, {"base": BASE, "steps": 3, "layouts": [
        ("tp", tp), ("tp_sel", tp + sel), ("sp", sp), ("sp_sel", sp + sel)]})
    for rank in out:
        assert rank["tp_sel"] == rank["tp"] and rank["sp_sel"] == rank["sp"], rank


# --- mixed_precision = "float8" -----------------------------------------------------------------


def test_float8_refused_on_cpu_exits_2_naming_the_field(monkeypatch, capsys):
    from trainer.cli import main

    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    argv = [a for o in [*BASE, 'parallel.mixed_precision="float8"'] for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert 'parallel.mixed_precision="float8" cannot train here' in err and "CUDA GPU" in err, err
    assert "Traceback" not in err


def test_float8_refusals():
    from trainer.parallel.float8 import float8_refusal, probe_torchao

    assert "runs on cpu" in float8_refusal("cpu", None, None, 1)
    assert "compute capability 8.0" in float8_refusal("cuda", (8, 0), None, 1)
    assert "parallel.tp=2" in float8_refusal("cuda", (9, 0), None, 2)
    assert float8_refusal("cuda", (9, 0), "torchao 0.1 does not work", 1) == "torchao 0.1 does not work"
    assert float8_refusal("cuda", (8, 9), None, 1) is None
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        assert "torchao is not importable" in probe_torchao(0)


# --- collective timing: host time on gloo, CUDA events on NCCL ------------------------------------


def test_cpu_collectives_keep_host_timing():
    import torch.distributed as dist

    from tests.harness import free_port
    from trainer.observe.telemetry import CommMeter

    meter = CommMeter()
    meter.install()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1000)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
    finally:
        dist.destroy_process_group()
        meter.uninstall()
    (row,) = meter.snapshot()
    assert (row["kind"], row["calls"], row["bytes"]) == ("all_reduce", 2, 8000)
    assert row["seconds"] > 0 and not meter.events._pending  # timed by the host clock, no events made
    assert not meter.events.wants(t) and not meter.events.wants([t])


def test_sends_coalesced_in_a_batch_are_timed_to_the_batch_completion():
    """NCCL coalesces batch_isend_irecv's sends and receives: they return no work, so each is recorded when the
    batch's last work completes, not at issue (the collectives here are stand-ins: only the meter's logic)."""
    from trainer.observe.telemetry import CommMeter

    class Future:
        def __init__(self):
            self.callbacks = []

        def add_done_callback(self, fn):
            self.callbacks.append(fn)

    class Work:
        def __init__(self):
            self.future = Future()

        def get_future(self):
            return self.future

    meter = CommMeter()
    isend = meter._wrap_c10d(lambda tensor, dst, group=None: None, "send", 0, "tensor", 2, "group")
    irecv = meter._wrap_c10d(lambda tensor, src, group=None: None, "recv", 0, "tensor", 2, "group")
    work = Work()
    batch = meter._wrap_batch(lambda ops: [op(t, peer) for op, t, peer in ops] and [work])
    assert batch([(isend, torch.ones(256), 1), (irecv, torch.ones(128), 1)]) == [work]
    assert meter.snapshot() == [] and len(work.future.callbacks) == 1  # nothing recorded at issue
    time.sleep(0.01)
    work.future.callbacks[0](work.future)
    rows = {r["kind"]: r for r in meter.snapshot()}
    assert (rows["send"]["calls"], rows["send"]["bytes"], rows["recv"]["bytes"]) == (1, 1024, 512)
    assert rows["send"]["seconds"] >= 0.01  # issue to completion, not issue to return


class FakeEvent:
    """A CUDA event's behaviour for the timer: fired or not, a time in ms."""

    def __init__(self, ms: float, fired: bool = True):
        self.ms, self.fired = ms, fired

    def query(self) -> bool:
        return self.fired

    def elapsed_time(self, end) -> float:
        return end.ms - self.ms


def test_event_pairs_are_recorded_once_fired():
    from trainer.observe.gpu_timing import EventTimer

    timer, got = EventTimer(), []
    late = FakeEvent(9.0, fired=False)
    timer.add(FakeEvent(1.0), FakeEvent(3.5), ("all_reduce", "dp", 8, 2))
    timer.add(FakeEvent(2.0), late, ("all_gather", "tp", 4, 2))
    assert timer.drain(lambda *a: got.append(a)) == 1
    assert got == [("all_reduce", "dp", 8, 2, 0.0025)]
    late.fired = True
    assert timer.drain(lambda *a: got.append(a)) == 0
    assert got[-1] == ("all_gather", "tp", 4, 2, 0.007)


# --- checkpointing.host_copy: the CPU path as before; the CUDA path's bookkeeping -------------------


def test_host_copy_cpu_path_is_synchronous_and_reuses_buffers():
    from torch.distributed.tensor import DTensor  # noqa: F401 - the module imports it lazily

    from checkpointing.host_copy import HostCopy, fence_writes

    host = HostCopy()
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "step": 3}
    pending = host.copy_async(state)
    assert pending.done() and pending.event is None  # nothing queued: CPU copies happen in the call
    out = pending.wait()
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and out["step"] == 3
    buf = out["model"]["w"]
    state["model"]["w"].add_(1)
    again = host.copy(state)
    assert again["model"]["w"].data_ptr() == buf.data_ptr()  # one buffer set on the host, kept
    assert torch.equal(again["model"]["w"], state["model"]["w"])
    assert host.nbytes() == 24 and not host._more[0]  # no ping-pong set for host state
    fence_writes()  # no CUDA copy in flight: nothing to order


# --- a transformers model: its blocks found by the model spec -------------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


@pytest.fixture
def llama(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return ['model.source="hf"', f'model.hf_config="{tmp_path}"']


def test_hf_selective_ac_is_bitwise_none_and_holds_less(llama):
    base = [*AC_BASE[:-2], "data.seq_len=64", "train.micro_batch=4", *llama]
    none, sel = ac_run("none", base), ac_run("selective", base)
    assert sel["losses"] == none["losses"] and sel["loss"] == none["loss"]
    assert all(torch.equal(sel["grads"][n], g) for n, g in none["grads"].items())
    assert sel["held"] < 0.9 * none["held"], (none["held"], sel["held"])


@pytest.mark.slow
def test_hf_compiled_equals_eager(llama):
    eager = losses(llama)
    compiled = losses(llama + ["parallel.compile=true"])
    assert close(eager, compiled, 1e-5), (eager, compiled)
