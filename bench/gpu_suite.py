"""The GPU suite: etrain's throughput, memory and copy figures on one GPU, against the loops users compare it to.

    python bench/gpu_suite.py [--steps 20] [--preset 1b] [--seq-len 2048] [--micro-batch 4]
    python bench/gpu_suite.py --cpu-smoke        # a tiny model, a few steps, seconds on a CPU (tests run it)

One process, world 1, no Ray, no downloads (the data is this machine's Python standard library sources),
on whatever torch the image has (2.11 to 2.13). Rows, each in its own try (a failing row reports its
error and the others still run):

* ``mfu``: the 1b preset in bf16, one FLOP formula for every row (:func:`trainer.observe.telemetry.flops_per_token`,
  the model spec's count) over the measured tokens/s and the device's dense bf16 peak:
  ``etrain`` (the Trainer, ``parallel.compile`` off), ``etrain_compile`` (on), ``hand`` (a hand-written
  loop with etrain's math: bf16 weights, fp32 master weights in fused AdamW, fp32 loss, clipping) and
  ``torchtitan`` (torchtitan's recipe: fp32 weights under bf16 autocast, fused AdamW, ``torch.compile`` per
  block). ``mfu_vs_torchtitan``: etrain_compile over torchtitan (target >= 0.95).
* ``memory``: the Trainer's peak allocated bytes against ``etrain plan``'s prediction (trainer.plan; target
  within 10%).
* ``checkpoint``: a checkpoint of that Trainer saved to local disk, its bytes over the time until committed: the
  second save of the manager (``checkpoint_first_s``: the first, which pins its buffers and plans with DCP).
* ``tier``: step time with a memory-tier snapshot after every step over without (``tier_step_ratio``,
  target <= 1.02), and with only the side-stream host copy (``side_copy_step_ratio``: the copy queued
  after each step, waited for off the training thread).
* ``d2h``: device-to-host bandwidth into pinned and into pageable memory (GB/s).
* ``wheels``: which of etrain's dependencies the image lacks (``pip install`` line), and the optional ones.

Prints a line per row and, last, one JSON line with every figure. Under 8 minutes on one H100.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

SMOKE = ["model.dim=64", "model.ffn_hidden=192", "model.n_kv_heads=2", "model.n_layers=2", "data.seq_len=32",
         "data.max_bytes=200000", "train.global_batch=2", "train.micro_batch=2"]
OPTIONAL = {"torchao": 'parallel.mixed_precision="float8"', "triton": "parallel.compile=true on CUDA"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model, a few steps, on the CPU")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per row (default 20; smoke 3)")
    ap.add_argument("--preset", default="1b", help="model preset (default 1b)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    return ap.parse_args(argv)


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.smoke = args.cpu_smoke
        self.device = torch.device("cpu" if self.smoke or not torch.cuda.is_available() else "cuda", 0)
        if self.device.type == "cpu":
            self.device = torch.device("cpu")
        self.steps = args.steps or (3 if self.smoke else 20)
        self.warmup = 1 if self.smoke else 3
        base = [f'model.preset="{args.preset}"', f"data.seq_len={args.seq_len}", "data.max_bytes=30000000",
                f"train.global_batch={args.micro_batch}", f"train.micro_batch={args.micro_batch}"]
        self.overrides = (SMOKE if self.smoke else base) + [
            'parallel.mixed_precision="bf16"', "train.warmup_steps=0", f"train.steps={10**6}",
            "metrics.enabled=false", f'parallel.device="{self.device.type}"']
        self.out: dict = {"bench": "gpu_suite", "smoke": self.smoke, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu"}
        self.tmp = tempfile.mkdtemp(prefix="etrain-gpu-suite-")

    # --- helpers -----------------------------------------------------------------------------

    def cfg(self, *extra: str):
        from trainer.config.load import load_config

        return load_config(None, self.overrides + list(extra))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_steps(self, step, n: int | None = None) -> float:
        """Median seconds of ``step()`` after the warm-up steps."""
        for _ in range(self.warmup):
            step()
        self.sync()
        times = []
        for _ in range(n or self.steps):
            t0 = time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def row(self, name: str, fn) -> None:
        t0, before = time.monotonic(), set(self.out)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one row's failure is a figure too
            self.out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        new = ", ".join(f"{k}={v}" for k, v in self.out.items() if k not in before)
        print(f"[{time.monotonic() - t0:6.1f} s] {name}: {new}", flush=True)
        self.free()

    def mfu_of(self, cfg, step_s: float) -> tuple[float, float | None]:
        from trainer.observe.telemetry import flops_per_token, peak_flops

        tokens_s = cfg.train.global_batch * cfg.data.seq_len / step_s
        peak = peak_flops(self.device)
        return tokens_s, (tokens_s * flops_per_token(cfg) / peak if peak else None)

    def record_mfu(self, name: str, cfg, step_s: float) -> None:
        tokens_s, mfu = self.mfu_of(cfg, step_s)
        self.out[f"mfu_{name}"] = round(mfu, 4) if mfu is not None else None
        self.out[f"tokens_s_{name}"] = round(tokens_s, 1)

    def batch(self, cfg):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=g)
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    # --- rows ----------------------------------------------------------------------------------

    def etrain(self) -> None:
        """The Trainer without compile (peak memory, checkpoint, tier rows use it), then with."""
        from trainer.loop import Trainer
        from trainer.world import World

        cfg = self.cfg()
        self.free()
        trainer = Trainer(cfg, World(), device=self.device)
        self.record_mfu("etrain", cfg, self.time_steps(lambda: trainer.train_step()))
        self.row("memory", lambda: self.memory(cfg))
        self.row("checkpoint", lambda: self.checkpoint(trainer))
        self.row("tier", lambda: self.tier(trainer))
        self.row("health", lambda: self.health(trainer))
        del trainer
        self.free()
        if self.smoke:  # inductor's first build takes minutes on a CPU: the compiled rows are GPU rows
            self.out["mfu_etrain_compile"] = None
            return
        cfg = self.cfg("parallel.compile=true")
        trainer = Trainer(cfg, World(), device=self.device)
        self.record_mfu("etrain_compile", cfg, self.time_steps(lambda: trainer.train_step()))

    def memory(self, cfg) -> None:
        from trainer.parallel.dims import ParallelDims
        from trainer.plan.accounting import peak_memory
        from trainer.plan.shape import planning_config

        predicted = peak_memory(planning_config(cfg), ParallelDims.from_config(cfg, 1), True)["total"]
        self.out["memory_predicted_bytes"] = int(predicted)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
            self.out["memory_peak_bytes"] = int(peak)
            self.out["memory_ratio"] = round(peak / predicted, 3)

    def checkpoint(self, trainer) -> None:
        from trainer.checkpoints import checkpoint_manager

        manager = checkpoint_manager(self.cfg(f'checkpoint.url="file://{self.tmp}/ckpt"'), trainer.world)

        def written() -> int:
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f"{self.tmp}/ckpt") for f in fs)

        def save() -> tuple[float, int]:  # (seconds until committed, bytes written)
            before = written()
            self.sync()
            t0 = time.perf_counter()
            trainer.save_checkpoint(manager)
            manager.wait()
            seconds = time.perf_counter() - t0
            return seconds, written() - before

        # The first save of a manager pins its host buffers and plans with DCP; the second (the next step, as
        # training's next interval) is the steady state bench/checkpoint.py reports.
        first, _ = save()
        trainer.step += 1
        try:
            seconds, size = save()
        finally:
            trainer.step -= 1
            manager.close()
        self.out["checkpoint_bytes"] = size
        self.out["checkpoint_first_s"] = round(first, 3)
        self.out["checkpoint_s"] = round(seconds, 3)
        self.out["checkpoint_gb_s"] = round(size / seconds / 1e9, 3)

    def tier(self, trainer) -> None:
        from checkpointing.host_copy import HostCopy
        from checkpointing.recovery.tier import MemoryTier

        tiers = [MemoryTier(0, 1, replicas=0)]

        def with_tier():
            trainer.train_step()
            tiers[0].take_async(trainer.step, trainer.optimizer.checkpoint_state(), trainer.train_state())

        host, pending = HostCopy(), []
        waiter = threading.Thread  # the host side of the copy, off the training thread

        def with_copy():
            trainer.train_step()
            if len(pending) == HostCopy.SLOTS:  # copy N+2 reuses N's buffers: N must be in by then
                pending.pop(0).join()
            copy = host.copy_async(trainer.optimizer.checkpoint_state())
            t = waiter(target=copy.wait)
            t.start()
            pending.append(t)

        n = max(3, self.steps // 4)  # a snapshot of the 1b preset's state is ~17 GB of host memory per copy
        off = [self.time_steps(trainer.train_step, n)]
        on = [self.time_steps(with_tier, n)]
        tiers[0].wait()
        tiers.pop().close()
        gc.collect()  # its host copies, before the side-stream copy's two buffer sets
        side = [self.time_steps(with_copy, n)]
        for t in pending:
            t.join()
        off.append(self.time_steps(trainer.train_step, n))
        base = statistics.mean(off)
        self.out["tier_step_s_off"] = round(base, 5)
        self.out["tier_step_ratio"] = round(on[0] / base, 4)
        self.out["tier_side_copy_step_ratio"] = round(side[0] / base, 4)
        self.out["tier_bytes"] = host.nbytes() // HostCopy.SLOTS if self.device.type == "cuda" else host.nbytes()

    def health(self, trainer) -> None:
        """[health]'s cost on this device, side by side: steps with the seal (two digests of the state per
        step, on the device) and a check every 16 steps, and every step, over steps without."""
        g = trainer.health

        def checked(every: int):
            def step():
                trainer.train_step()
                if trainer.step % every == 0:
                    g.check()
            return step

        n = max(16, self.steps)
        off = [self.time_steps(trainer.train_step, n)]
        g.start()  # the seal on, the state verified once
        t0 = time.perf_counter()
        g.check()
        self.sync()
        self.out["health_check_s"] = round(time.perf_counter() - t0, 5)
        on16, on1 = self.time_steps(checked(16), n), self.time_steps(checked(1), n)
        g.active = False
        off.append(self.time_steps(trainer.train_step, n))
        base = statistics.mean(off)
        self.out["health_overhead_ratio"] = round(on16 / base, 4)
        self.out["health_overhead_ratio_every_step"] = round(on1 / base, 4)
        self.out["health_ring_bytes"] = g.ring.nbytes

    def loop(self, name: str, recipe: str) -> None:
        """A hand-written loop over the built-in decoder: "hand" (etrain's math) or "torchtitan"."""
        import torch.nn.functional as F

        from trainer.models.decoder.model import Transformer

        cfg = self.cfg()
        t = cfg.train
        fused = self.device.type == "cuda"
        model = Transformer(cfg.model).to(self.device)
        model.init_weights(t.seed)
        model.train()
        inputs, targets = self.batch(cfg)
        if recipe == "torchtitan":
            for block in model.layers.values():  # fp32 weights, bf16 autocast, compile per block
                block.compile(fullgraph=True, backend="eager" if self.smoke else "inductor")
            opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                    weight_decay=t.weight_decay, fused=fused, foreach=not fused)

            def step():
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            masters = [p.detach().clone() for p in model.parameters()]  # fp32 masters, bf16 compute weights
            model.to(torch.bfloat16)
            model.rope = model.rope.float()
            params = list(model.parameters())
            for m in masters:
                m.requires_grad_(True)
            opt = torch.optim.AdamW(masters, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                    weight_decay=t.weight_decay, fused=fused, foreach=not fused)

            def step():
                loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
                loss.backward()
                for m, p in zip(masters, params):
                    m.grad = p.grad.float()
                    p.grad = None
                torch.nn.utils.clip_grad_norm_(masters, t.grad_clip, foreach=True)
                opt.step()
                with torch.no_grad():
                    torch._foreach_copy_(params, masters)
                for m in masters:
                    m.grad = None

        self.record_mfu(name, cfg, self.time_steps(step))

    def d2h(self) -> None:
        if self.device.type != "cuda":
            self.out["d2h_pinned_gb_s"] = self.out["d2h_pageable_gb_s"] = None
            return
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        for kind, dst in (("pinned", torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                          ("pageable", torch.empty(n, dtype=torch.uint8))):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            self.out[f"d2h_{kind}_gb_s"] = round(5 * n / (time.perf_counter() - t0) / 1e9, 2)
            del dst

    def wheels(self) -> None:
        missing, optional = [], []
        for req in _pyproject_deps():
            name = re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0]
            if name != "torch" and not _installed(name):
                missing.append(req)
        for name, what in OPTIONAL.items():
            if not _installed(name):
                optional.append(f"{name} ({what})")
        self.out["wheels_missing"] = missing
        self.out["wheels_optional_missing"] = optional
        if missing:
            print("this image needs: pip install " + " ".join(f"'{m}'" for m in missing), flush=True)

    def run(self) -> dict:
        from trainer.world import World, init_distributed, shutdown_distributed

        self.row("wheels", self.wheels)
        init_distributed(World(), self.device)  # the memory tier agrees over a group, even of one
        try:
            self.row("mfu_etrain", self.etrain)
            self.row("mfu_hand", lambda: self.loop("hand", "hand"))
            self.row("mfu_torchtitan", lambda: self.loop("torchtitan", "torchtitan"))
            self.row("d2h", self.d2h)
        finally:
            shutdown_distributed()
            shutil.rmtree(self.tmp, ignore_errors=True)
        a, b = self.out.get("tokens_s_etrain_compile"), self.out.get("tokens_s_torchtitan")
        self.out["mfu_vs_torchtitan"] = round(a / b, 4) if a and b else None
        a = self.out.get("tokens_s_etrain")
        self.out["mfu_eager_vs_hand"] = round(a / self.out["tokens_s_hand"], 4) if a and self.out.get(
            "tokens_s_hand") else None
        return self.out


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _pyproject_deps() -> list[str]:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    out = Suite(args).run()
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
