"""The held-out loss of a trainer's model (``[eval]``): :meth:`trainer.loop.Trainer.evaluate` calls this."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel.dims import Axis


@torch.no_grad()
def evaluate(self) -> float:
    """Mean loss over ``eval.batches`` global batches of the validation split (collective); ``self``: the
    :class:`trainer.loop.Trainer`.

    The same batches at every evaluation and every world size: positions ``[0, batches x global_batch)``
    of the split's own sample order, each data-parallel rank taking its share as in training."""
    self.initial_weights()
    cfg, vb = self.cfg, self.val_batcher
    n_batches = cfg.eval.batches
    loss_sum, aux_sum = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
    self.parts.train(False)
    try:
        for b in range(n_batches):
            inputs, targets = vb.tokens(vb.local_positions(b * cfg.train.global_batch))
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            if self.parts.pipeline is not None:
                stage_loss = self.parts.pipeline_step(inputs, targets, backward=False)
                if stage_loss is not None:
                    loss_sum += stage_loss
                aux = self.parts.pipeline_aux()  # every stage's MoE layers' aux loss, as world 1's loss has it
                if aux is not None:
                    aux_sum += aux.to(self.device)
                continue
            mb = cfg.train.micro_batch
            n_micro = len(inputs) // mb
            for i in range(n_micro):
                logits = self.parts.forward(inputs[i * mb : (i + 1) * mb])
                loss_sum += self.parts.loss(logits, targets[i * mb : (i + 1) * mb]).float() / n_micro
    finally:
        self.parts.train(True)
    total = loss_sum if self._counts_loss else torch.zeros((), device=self.device)
    total = total + (aux_sum if self.coords[Axis.TP] == 0 else 0)
    if self.world.size > 1:
        dist.all_reduce(total)
    value = total.item() / self.dims.grad_ranks / n_batches
    self.last_eval = (self.step, value)
    return value
