"""Non-finite steps inside real multi-process groups (see tests.harness): rank 0 alone turns its logits
to nan at the second step; every rank must skip that step's update together, or stop together."""

from __future__ import annotations

import torch

from tests.ckpt_jobs import full_state
from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.loop import NonFiniteStep, Trainer
from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def _nan_on_rank0(trainer: Trainer, world: World):
    """A forward hook that makes rank 0's logits nan (the other ranks' stay finite); its handle."""
    if world.rank != 0:
        return None
    return trainer.parts.modules[0].register_forward_hook(lambda m, i, out: out * float("nan"))


def skip_or_stop(payload: dict) -> dict:
    """Per layout: three steps, the second one nan on rank 0. With ``train.skip_nonfinite_steps`` the
    stats, the state before and after the skipped step, and after the next; without it, the error."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        corpus = load_corpus(load_config(None, payload["base"]).data)
        out = {}
        for name, overrides in payload["layouts"]:
            forget_meshes()
            trainer = Trainer(load_config(None, payload["base"] + overrides), world, corpus=corpus, device=CPU)
            first = trainer.train_step()
            before = full_state(trainer)
            hook = _nan_on_rank0(trainer, world)
            try:
                second = trainer.train_step()
            except NonFiniteStep as e:
                out[name] = {"error": str(e), "step": trainer.step}
                continue
            finally:
                if hook is not None:
                    hook.remove()
            after_skip = full_state(trainer)
            third = trainer.train_step()
            after_next = full_state(trainer)
            out[name] = {
                "skipped": [s.skipped_nonfinite for s in (first, second, third)],
                "losses": [s.loss for s in (first, second, third)],
                "unchanged": all(torch.equal(before[k], after_skip[k]) for k in before),
                "changed_next": any(not torch.equal(after_skip[k], after_next[k]) for k in after_skip),
                "finite_next": all(bool(torch.isfinite(v).all()) for v in after_next.values()
                                   if v.is_floating_point()),
                "samples_consumed": trainer.samples_consumed,
                "step": trainer.step,
            }
        return out
    finally:
        shutdown_distributed()
