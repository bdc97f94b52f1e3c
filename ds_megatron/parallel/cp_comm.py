"""Causal attention across context-parallel ranks: ``ring`` (K/V chunks around the CP ring, point-to-point) and
``a2a`` (Ulysses: all-to-all from sequence-sharded to head-sharded and back).

Both take this rank's q [b, n, s/cp, d] and k, v [b, n_kv, s/cp, d] in the load-balanced layout of
``ds_megatron.parallel.cp`` (rank i holds chunks i and 2cp-1-i of 2cp) and return this rank's context
[b, n, s/cp, d], equal to the rows of whole-sequence causal attention at this rank's token indices.  ``group`` is
the CP group (None or one rank: plain causal attention).  Kernels are those of ``cp_kernels``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.parallel.cp import slice_for_rank, unslice
from ds_megatron.parallel.cp_kernels import block_backward, block_forward


def _size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _shift(send: Tensor, group: ProcessGroup) -> tuple[Tensor, list[Any]]:
    """Post ``send`` to the next CP rank and a receive from the previous one; returns the receive buffer and the
    requests.  Every rank posts its send before its receive and all ranks run the same sequence of shifts, so
    the point-to-point messages match in order (NCCL coalesces the pair; gloo runs both asynchronously).  The
    caller must leave ``send`` untouched until the requests complete: gloo reads it while sending."""
    size, rank = _size_rank(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _ring_block(rank: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows attend to which rows of the K/V held by CP rank ``src``, and whether the
    block is causal.  Local rows [0, c) are chunk ``rank``, [c, 2c) chunk ``2cp-1-rank``; the same for ``src``.
      src == rank: both chunks against both, causal over the 2c local tokens (chunk rank never sees the later one);
      src <  rank: all 2c rows against src's first chunk only (its second chunk lies in every row's future);
      src >  rank: only the second-chunk rows, against both of src's chunks (the first chunk precedes neither).
    The skipped pairs lie wholly above the diagonal and are never computed; each rank does the same work per step.
    """
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    """Forward: cp steps; at step t this rank holds the K/V of CP rank (rank - t) mod cp, sends it on to the next
    rank and receives the following one while it computes the attention of the block in hand (two buffers: the one
    in flight is never written).  Partial outputs are merged exactly with their log-sum-exp:
        lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
    Saved for backward: q, k, v (local), the merged output and its lse; no received K/V is kept.
    Backward: the K/V travel the ring again together with their gradient: dK/dV of the block in hand are added to
    the accumulator that arrives from the previous rank and sent on (fp32, so the sum over cp ranks rounds once);
    after cp steps each accumulator has visited every rank and takes one last hop home to its owner."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, kernel: str, scale: float) -> Tensor:
        cp, rank = _size_rank(group)
        c = q.shape[2] // 2
        kv = torch.stack([k, v])  # [2, b, n_kv, 2c, d]: one message per hop, at KV-head size
        out = torch.empty(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=out.dtype, device=q.device)
        for step in range(cp):
            requests: list[Any] = []
            if step + 1 < cp:
                recv, requests = _shift(kv, group)
            src = (rank - step) % cp
            rows, cols, causal = _ring_block(rank, src, c)
            block = block_forward(kernel, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
            if step == 0:
                out.copy_(block.out)
                lse.copy_(block.lse)
            else:
                o, l_run = out[:, :, rows], lse[:, :, rows]
                merged = torch.logaddexp(l_run, block.lse)
                o.mul_(torch.exp(l_run - merged).unsqueeze(-1)).add_(
                    torch.exp(block.lse - merged).unsqueeze(-1) * block.out
                )
                l_run.copy_(merged)
            if requests:
                _wait(requests)
                kv = recv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.scale = group, kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel, scale = ctx.group, ctx.kernel, ctx.scale
        cp, rank = _size_rank(group)
        c = q.shape[2] // 2
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv_in, dkv_requests = torch.zeros(kv.shape, dtype=acc, device=q.device), []
        for step in range(cp):
            kv_requests: list[Any] = []
            if step + 1 < cp:
                kv_next, kv_requests = _shift(kv, group)
            src = (rank - step) % cp
            rows, cols, causal = _ring_block(rank, src, c)
            dq_b, dk_b, dv_b = block_backward(
                kernel,
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                scale,
            )
            dq[:, :, rows] += dq_b
            # The accumulator of src's block as the previous rank sent it on (zeros at step 0: this rank's own
            # block starts here).  Waiting also completes this rank's previous send, so no buffer in flight is
            # ever written: the received one is complete and is the one updated and sent on.
            _wait(dkv_requests)
            dkv = dkv_in
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
            dkv_in, dkv_requests = _shift(dkv, group)
            if kv_requests:
                _wait(kv_requests)
                kv = kv_next
        _wait(dkv_requests)  # after cp steps the accumulator of this rank's own block has come home
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


class _LocalAttention(torch.autograd.Function):
    """Causal attention of a whole local sequence with the same kernels (cp 1, and a2a's head-sharded core)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, kernel: str, scale: float) -> Tensor:
        out, lse = block_forward(kernel, q, k, v, True, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(ctx.kernel, dout, q, k, v, out, lse, True, ctx.scale)
        return dq, dk, dv, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float) -> Tensor:
    """Causal ring attention over the CP group (see ``_RingAttention``)."""
    if _size_rank(group)[0] == 1:
        return _LocalAttention.apply(q, k, v, kernel, scale)
    return _RingAttention.apply(q, k, v, group, kernel, scale)


def _seq_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """[b, n, s/cp, d] (this rank's chunks, all local heads) -> [b, n/cp, s, d] (head group ``rank``, the whole
    sequence in order).  One all-to-all; the received shards are put back in sequence order by the layout's
    ``unslice`` (rank r's shard holds chunks r and 2cp-1-r)."""
    cp = dist.get_world_size(group)
    b, n, sl, d = x.shape
    send = x.reshape(b, cp, n // cp, sl, d).transpose(0, 1).contiguous()  # [cp (dest), b, n/cp, s/cp, d]
    recv = torch.empty_like(send)  # [cp (source rank), b, n/cp, s/cp, d]
    dist.all_to_all_single(recv, send, group=group)
    return unslice(list(recv.unbind(0)), dim=2)


def _heads_to_seq(y: Tensor, group: ProcessGroup) -> Tensor:
    """The inverse of ``_seq_to_heads``: [b, n/cp, s, d] -> [b, n, s/cp, d]."""
    cp = dist.get_world_size(group)
    send = torch.stack([slice_for_rank(y, 2, r, cp) for r in range(cp)])  # [cp (dest), b, n/cp, s/cp, d]
    recv = torch.empty_like(send)  # [cp (source head group), b, n/cp, s/cp, d]
    dist.all_to_all_single(recv, send, group=group)
    _, b, n_part, sl, d = recv.shape
    return recv.transpose(0, 1).reshape(b, cp * n_part, sl, d)


class _SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence-sharded -> head-sharded.  Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all head-sharded -> sequence-sharded.  Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def a2a_attention(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float) -> Tensor:
    """Ulysses attention: q, k, v all-to-all'd to n/cp (n_kv/cp) heads of the whole sequence, causal attention
    there, the context all-to-all'd back.  Query head group r meets KV head group r: head i uses KV head
    i // (n / n_kv), and both are split into cp contiguous groups.  Heads must divide by cp (``check_cp_heads``).

    Not DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: it takes [b, s, n, d] or [s, b, n, d] (a
    transpose copy each way around this [b, n, s, d] core), gathers shards in rank order only (the balanced layout
    would need one more reorder of q, k, v and the context) and runs on ``deepspeed.comm``; here the reorder is the
    copy the all-to-all needs anyway."""
    if _size_rank(group)[0] == 1:
        return _LocalAttention.apply(q, k, v, kernel, scale)
    q, k, v = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    return _HeadsToSeq.apply(_LocalAttention.apply(q, k, v, kernel, scale), group)


CP_ATTENTION = {"ring": ring_attention, "a2a": a2a_attention}


def cp_attention(
    cp_comm: str, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float
) -> Tensor:
    """Causal attention of this rank's chunks over the CP group with ``cp_comm`` in ("ring", "a2a")."""
    return CP_ATTENTION[cp_comm](q, k, v, group, kernel, scale)
