"""Context parallelism: every sample's sequence split across the ``cp`` ranks, end to end.

    cp = apply_cp(spec, model, dims, mesh, rank, pcfg)   # None when parallel.cp is 1
    logits = model(cp.shard(tokens))                     # this rank's seq_len / cp positions of every sample
    loss = lm_loss(logits, cp.shard(targets))            # the mean over them; averaged over cp with the gradients

Each rank holds ``seq_len / cp`` positions of every sample through the embeddings, every block and the
loss: the sequence is cut into ``2 x cp`` chunks and rank r takes chunk r and chunk ``2cp - 1 - r``
(the head-tail, or zigzag, split), so under the causal mask every rank attends the same number of
query-key pairs. Rotary positions are the global ones (:meth:`ContextParallel.positions`), and only
attention needs the other ranks' tokens (:mod:`.cp_attention`: ring, allgather, ulysses). Every cp rank
reads the same samples (the data cursor ignores cp); the cp ranks hold the same parameters, so their
gradients are averaged over ``dp x cp`` and ZeRO-3 shards over ``dp_shard x cp`` (:mod:`.dims`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..config.parallel import cp_splits
from .cp_attention import STYLES
from .dims import Axis, ParallelDims


@functools.lru_cache(maxsize=64)
def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank ``rank`` of ``cp``: chunks ``rank`` and ``2cp - 1 - rank`` of
    ``2cp`` equal chunks of ``seq_len``, in increasing order."""
    if not cp_splits(seq_len, cp):  # refused earlier, by name, for a run (trainer.config.parallel.check_cp)
        raise ValueError(f"a sequence of {seq_len} positions does not split into 2 x cp = {2 * cp} chunks")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([head, tail])


class ContextParallel:
    """This rank's place in the cp group and the attention style; what a model routes its attention to."""

    def __init__(self, group, rank: int, size: int, style: str):
        self.group, self.rank, self.size, self.style = group, rank, size, style
        self._attend = STYLES[style]
        self._ranks = [dist.get_global_rank(group, i) for i in range(size)]
        self._device: torch.device | None = None

    def global_rank(self, cp_rank: int) -> int:
        """The global rank of cp rank ``cp_rank`` (modulo the cp size: the ring's neighbours)."""
        return self._ranks[cp_rank % self.size]

    def positions(self, local_len: int, rank: int | None = None) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens that cp rank ``rank`` (this one) holds."""
        pos = zigzag_positions(local_len * self.size, self.size, self.rank if rank is None else rank)
        return pos if self._device is None else pos.to(self._device)

    def live_block(self, local_len: int, src: int) -> tuple[int, int]:
        """(q0, k1): of this rank's queries, those from q0 on see any key of cp rank ``src``'s block, and
        they see its keys up to k1, all of them (head-tail split): its own block whole (causally), an
        earlier rank's head chunk by every query, a later rank's whole block by the tail queries."""
        if src == self.rank:
            return 0, local_len
        return (0, local_len // 2) if src < self.rank else (local_len // 2, local_len)

    def gather_order(self, local_len: int) -> torch.Tensor:
        """The permutation that puts the cp ranks' tokens, concatenated in rank order, in position order."""
        return torch.argsort(torch.cat([self.positions(local_len, j) for j in range(self.size)]))

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of (batch, seq, ...) ``t`` (token ids, targets)."""
        self._device = t.device if t.device.type != "cpu" else None
        return t.index_select(1, zigzag_positions(t.shape[1], self.size, self.rank).to(t.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence; (batch, heads, local seq, head_dim)."""
        return self._attend(q, k, v, self)


def apply_cp(spec, model, dims: ParallelDims, mesh, rank: int, pcfg) -> ContextParallel | None:
    """Route ``model``'s attention through context parallelism (its spec's :meth:`apply_cp`); None at cp 1."""
    if dims.cp == 1:
        return None
    cp = ContextParallel(dims.group(mesh, Axis.CP), dims.coords(rank)[Axis.CP], dims.cp, pcfg.cp_style)
    spec.apply_cp(model, cp)
    return cp
