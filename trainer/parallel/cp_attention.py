"""Causal attention over a sequence split across the cp ranks: ring, all-gather and Ulysses.

    out = ring_attention(q, k, v, cp)        # q, k, v: (batch, heads, seq / cp, head_dim), this rank's positions
                                             # (k, v may have fewer heads: grouped-query attention)
    out = allgather_attention(q, k, v, cp)
    out = ulysses_attention(q, k, v, cp)

``cp`` is a :class:`trainer.parallel.context.ContextParallel`: the group, this rank's place in it and the
global position of every local token (head-tail split). Every collective is one that gloo runs
(``isend``/``irecv``, ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``), and none of
them carries a gradient on gloo, so each style is a custom autograd function whose backward makes the
matching collectives itself. Ring and allgather move grouped-query K/V as they are (n_kv_heads heads, not
n_heads: fewer bytes), repeated to the query heads only inside a block:

* ring: the K/V blocks travel around the ring (cp - 1 exchanges with the neighbours, each started before
  the block in hand is attended, so they overlap) while each rank attends its own queries; partial results
  are combined by their log-sum-exp. Of another rank's block only what the causal mask lets through is
  attended (all queries x its head chunk, or the tail queries x all of it: half the block). Backward sends
  each block round again (cp - 1 exchanges of K, V) and, one step behind it, its gradient, which each rank
  adds its part to (cp exchanges of dK, dV, the last one home); both overlap the block gradients' work.
* allgather: K/V gathered whole (one all-gather), attended block by block as the ring does; backward
  reduce-scatters dK, dV (one). K/V memory is O(seq), not O(seq / cp).
* ulysses: one all-to-all from sequence- to head-sharded (q, k, v together), whole-sequence causal
  attention over heads / cp heads, one all-to-all back; backward the same two, reversed.

A block of the head-tail split is either causal on local indices (a rank's own) or, once cut to what the
mask lets through, whole (:func:`_attend_block`), so a kernel that returns the log-sum-exp takes it: on the
CPU ATen's flash kernel (and its backward, fed the merged output and log-sum-exp), which never holds the
seq x seq scores; on other devices, for now, :func:`block_attention` (fp32 scores masked by global
positions, the log-sum-exp computed here; its backward :func:`block_attention_grad` is the flash-attention
recurrence), where the GPU's flash or memory-efficient kernel plugs in. Ulysses calls
``scaled_dot_product_attention`` itself, so it takes the device's best kernel as it is.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import compat


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp), in fp32 or wider, of queries at global positions ``q_pos`` attending causally to keys at
    ``k_pos``; rows that see no key have a log-sum-exp of -inf and an output of 0."""
    s = _scores(q, k, q_pos, k_pos)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return p @ _expand(_up(v), q), lse


def block_attention_grad(q, k, v, q_pos, k_pos, lse, dout, delta) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv), in fp32 or wider, of one block, given the final log-sum-exp of the queries' rows and
    ``delta = rowsum(dout * out)`` of their final output."""
    s = _scores(q, k, q_pos, k_pos)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ _expand(_up(v), q).transpose(-1, -2) - delta.unsqueeze(-1))
    scale = q.shape[-1] ** -0.5
    dk = (ds.transpose(-1, -2) @ _up(q)) * scale
    return (ds @ _expand(_up(k), q)) * scale, _fold(dk, k), _fold(dv, k)


def _scores(q, k, q_pos, k_pos) -> torch.Tensor:
    q, k = _up(q), _expand(_up(k), q)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return s.masked_fill(q_pos[:, None] < k_pos[None, :], -math.inf)


def _expand(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query K or V (fewer heads than q) repeated to q's heads; they travel unrepeated."""
    rep = q.shape[1] // kv.shape[1]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _fold(g: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_expand`: the heads that share a K/V head summed back onto it."""
    rep = g.shape[1] // kv.shape[1]
    return g if rep == 1 else g.unflatten(1, (kv.shape[1], rep)).sum(2)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _up(t: torch.Tensor) -> torch.Tensor:
    """fp32 for the attention arithmetic (or the tensor's own dtype when wider)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries combined by their log-sum-exps."""
    new = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return out, new


_KV, _DKV = 0, 1  # message tags: K/V blocks, and their gradients (both travel to the next rank at once)


def _start_exchange(send: torch.Tensor, cp, tag: int = _KV) -> tuple:
    """Start sending ``send`` to the next cp rank and receiving the previous one's; :func:`_finish` waits."""
    recv = torch.empty_like(send)
    reqs = [dist.isend(send, cp.global_rank(cp.rank + 1), group=cp.group, tag=tag),
            dist.irecv(recv, cp.global_rank(cp.rank - 1), group=cp.group, tag=tag)]
    return reqs, send, recv


def _finish(exchange: tuple) -> torch.Tensor:
    """What the previous cp rank sent, once the exchange is done (``send`` is kept alive until then)."""
    reqs, _, recv = exchange
    for req in reqs:
        req.wait()
    return recv


def _flash_cpu():
    """The CPU flash-attention kernel (and its backward) that returns the log-sum-exp; None where absent."""
    ops = torch.ops.aten
    if hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        return (ops._scaled_dot_product_flash_attention_for_cpu,
                ops._scaled_dot_product_flash_attention_for_cpu_backward)
    return None


FLASH_CPU = _flash_cpu()


def _attend_block(q, k, v, cp, src: int, pos):
    """This rank's queries against cp rank ``src``'s block: (q0, output and log-sum-exp of rows q0..).

    Only what the causal mask lets through is attended (:meth:`ContextParallel.live_block`): the own block
    causally, another whole. On the CPU that is the flash kernel (no seq x seq scores held); elsewhere the
    fp32 arithmetic of :func:`block_attention` (a GPU kernel that returns the log-sum-exp goes here)."""
    q0, c1 = cp.live_block(q.shape[2], src)
    qs, ks, vs = q[:, :, q0:], k[:, :, :c1], v[:, :, :c1]
    if FLASH_CPU is not None and q.device.type == "cpu":
        o, lse = FLASH_CPU[0](qs, _expand(ks, qs).to(q.dtype), _expand(vs, qs).to(q.dtype), 0.0, src == cp.rank)
        return q0, _up(o), lse
    return q0, *block_attention(qs, ks, vs, pos[q0:], cp.positions(q.shape[2], src)[:c1])


def _attend_block_grad(q, k, v, cp, src: int, pos, out, lse, dout, delta):
    """(q0, c1, dq of rows q0.., dk and dv of keys ..c1) of :func:`_attend_block`, given the final output and
    log-sum-exp of the queries' rows."""
    q0, c1 = cp.live_block(q.shape[2], src)
    qs, ks, vs = q[:, :, q0:], k[:, :, :c1], v[:, :, :c1]
    if FLASH_CPU is not None and q.device.type == "cpu":
        gq, gk, gv = FLASH_CPU[1](dout[:, :, q0:].to(q.dtype).contiguous(), qs, _expand(ks, qs).to(q.dtype),
                                  _expand(vs, qs).to(q.dtype), out[:, :, q0:].to(q.dtype), lse[:, :, q0:].contiguous(),
                                  0.0, src == cp.rank)
        return q0, c1, _up(gq), _fold(_up(gk), ks), _fold(_up(gv), vs)
    return q0, c1, *block_attention_grad(qs, ks, vs, pos[q0:], cp.positions(q.shape[2], src)[:c1],
                                         lse[:, :, q0:], dout[:, :, q0:], delta[:, :, q0:])


def _combine(out, lse, q0: int, o, s):
    """The running (output, log-sum-exp) with a block's partial result for rows q0.. merged in."""
    if out is None:  # this rank's own block, first: every row sees a key
        return o, s
    o, s = _merge(out[:, :, q0:], lse[:, :, q0:], o, s)
    return torch.cat([out[:, :, :q0], o], 2), torch.cat([lse[:, :, :q0], s], 2)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp):
        n, r = cp.size, cp.rank
        pos = cp.positions(q.shape[2])
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for i in range(n):
            ahead = _start_exchange(kv, cp) if i < n - 1 else None  # the next block travels while this one is attended
            out, lse = _combine(out, lse, *_attend_block(q, kv[0], kv[1], cp, (r - i) % n, pos))
            if ahead is not None:
                kv = _finish(ahead)
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        cp = ctx.cp
        q, k, v, out, lse = ctx.saved_tensors
        n, r = cp.size, cp.rank
        pos = cp.positions(q.shape[2])
        dout = _up(dout)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v]).contiguous()
        incoming = None  # the gradient of the block in hand, summed by the ranks it visited before, in flight
        for i in range(n):
            src = (r - i) % n
            ahead = _start_exchange(kv, cp, _KV) if i < n - 1 else None  # the next block, while this one's runs
            q0, c1, gq, gk, gv = _attend_block_grad(q, kv[0], kv[1], cp, src, pos, out, lse, dout, delta)
            dq[:, :, q0:] += gq
            dkv = torch.zeros((2, *kv.shape[1:]), dtype=out.dtype, device=out.device)
            dkv[0, :, :, :c1] = gk
            dkv[1, :, :, :c1] = gv
            if incoming is not None:
                dkv += _finish(incoming)
            incoming = _start_exchange(dkv, cp, _DKV)  # on to the next rank, whose block it is one step later
            if ahead is not None:
                kv = _finish(ahead)
        dkv = _finish(incoming)  # this rank's own block's gradient, complete
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp):
        n = cp.size
        kv = torch.stack([k, v]).contiguous()
        full = torch.empty((n * 2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        compat.all_gather_single(full, kv, group=cp.group)  # concatenated along dim 0, as gloo wants
        full = full.unflatten(0, (n, 2))  # (n, 2, b, h, s, d): rank j's K, V in row j
        pos, out, lse = cp.positions(q.shape[2]), None, None
        for src in range(n):  # the own block first
            src = (cp.rank + src) % n
            out, lse = _combine(out, lse, *_attend_block(q, full[src, 0], full[src, 1], cp, src, pos))
        ctx.cp = cp
        ctx.save_for_backward(q, full, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        cp = ctx.cp
        q, full, out, lse = ctx.saved_tensors
        pos, dout = cp.positions(q.shape[2]), _up(dout)
        delta = (dout * out).sum(-1)
        dq, dkv = torch.zeros_like(out), torch.zeros(full.shape, dtype=out.dtype, device=out.device)
        for src in range(cp.size):
            q0, c1, gq, gk, gv = _attend_block_grad(q, full[src, 0], full[src, 1], cp, src, pos, out, lse, dout, delta)
            dq[:, :, q0:] += gq
            dkv[src, 0, :, :, :c1] += gk
            dkv[src, 1, :, :, :c1] += gv
        mine = torch.empty(full.shape[1:], dtype=dkv.dtype, device=dkv.device)
        compat.reduce_scatter_single(mine, dkv.flatten(0, 1), group=cp.group)
        return dq.to(q.dtype), mine[0].to(full.dtype), mine[1].to(full.dtype), None


class _AllToAll(torch.autograd.Function):
    """(B, h, s, d) sequence-sharded <-> (B, h / n, n * s, d) head-sharded (``to_heads``), the sequence in
    rank order; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, cp, to_heads: bool):
        ctx.cp, ctx.to_heads = cp, to_heads
        return _all_to_all(x, cp, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.cp, not ctx.to_heads), None, None


def _all_to_all(x: torch.Tensor, cp, to_heads: bool) -> torch.Tensor:
    n = cp.size
    b, h, s, d = x.shape
    if to_heads:  # row j: the heads rank j attends, of this rank's positions
        send = x.unflatten(1, (n, h // n)).transpose(0, 1).contiguous()
    else:  # row j: rank j's positions of this rank's heads
        send = x.unflatten(2, (n, s // n)).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cp.group)
    if to_heads:  # (n, B, h/n, s, d) -> (B, h/n, n*s, d)
        return recv.permute(1, 2, 0, 3, 4).flatten(2, 3)
    return recv.transpose(0, 1).flatten(1, 2)  # (n, B, h/n, s/n, d) -> (B, h, s/n, d)


def ring_attention(q, k, v, cp) -> torch.Tensor:
    return _Ring.apply(q, k, v, cp)


def allgather_attention(q, k, v, cp) -> torch.Tensor:
    return _AllGather.apply(q, k, v, cp)


def ulysses_attention(q, k, v, cp) -> torch.Tensor:
    b, h, s, _ = q.shape
    k, v = _expand(k, q), _expand(v, q)  # every rank attends whole heads of q: K/V repeated to match
    qkv = _AllToAll.apply(torch.cat([q, k, v]).contiguous(), cp, True)  # (3b, h/n, n*s, d), rank order
    order = cp.gather_order(s)  # rank order -> position order, and back
    qkv = qkv.index_select(2, order)
    out = F.scaled_dot_product_attention(qkv[:b], qkv[b : 2 * b], qkv[2 * b :], is_causal=True)
    out = out.index_select(2, torch.argsort(order))
    return _AllToAll.apply(out.contiguous(), cp, False)


STYLES = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
