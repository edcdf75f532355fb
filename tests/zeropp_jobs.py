"""ZeRO++ jobs run inside real gloo groups (tests/trainer/test_zeropp.py, bench/zeropp.py)."""

from __future__ import annotations

import functools
import hashlib
import time

import torch
import torch.distributed as dist

from tests.jobs import comm_per_step, metered_world, trainers


class GatherLog:
    """Every all-gather of this process while on: (ranks of its group, bytes of its output). It wraps
    ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13; looked up at each
    call by FSDP2 and trainer.compat) around the comm meter's own wrapper: the real collective runs either way."""

    def __init__(self):
        self.calls: list[tuple[tuple[int, ...], int]] = []
        self.name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self.orig = getattr(dist, self.name)

        @functools.wraps(self.orig)
        def logged(output_tensor, input_tensor, group=None, async_op=False):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            self.calls.append((ranks, output_tensor.numel() * output_tensor.element_size()))
            return self.orig(output_tensor, input_tensor, group=group, async_op=async_op)

        self.logged = logged

    def __enter__(self):
        setattr(dist, self.name, self.logged)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self.orig)


def param_digest(trainer) -> str:
    """A hash of every parameter this rank computes with (its local tensors, bit for bit)."""
    h = hashlib.sha256()
    for name, p in trainer.parts.named_parameters():
        t = p.detach()
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_zeropp(payload: dict) -> dict:
    """Each layout ``(name, overrides, steps)`` trained in this world: its losses, the meter's collectives
    of an average step after the first ("kind/axis": bytes, calls, seconds), one later step's all-gathers
    by group, the seconds of the steps after the first, and a digest of the parameters after the last."""
    with metered_world() as (world, meter):
        out = {}
        for name, rest, trainer in trainers(world, payload["base"], payload["layouts"]):
            steps = rest[0]
            meter.name_axes(trainer.mesh)
            losses = [trainer.train_step().loss]
            with GatherLog() as gathers:
                losses.append(trainer.train_step().loss)
            before = meter.snapshot()
            t0 = time.perf_counter()
            losses += [trainer.train_step().loss for _ in range(steps - 2)]
            seconds = time.perf_counter() - t0
            out[name] = {"losses": losses, "comm": comm_per_step(meter, before, steps - 2),
                         "gathers": gathers.calls, "seconds": seconds / max(1, steps - 2),
                         "digest": param_digest(trainer), "memory": trainer.memory_measured,
                         "predicted": trainer.memory_predicted()}
            del trainer
        return out


def logged_run(payload: dict) -> int:
    """``python -m trainer``'s run of ``payload["overrides"]`` in this world, its step log (rank 0) written to
    ``payload["log"]``: the exit code."""
    from trainer.cli import train_config
    from trainer.config.load import load_config

    return train_config(lambda: load_config(payload["config"], payload["overrides"]), log_file=payload["log"],
                        quiet=True).exit_code
