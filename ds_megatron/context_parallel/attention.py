"""Causal attention across context-parallel ranks: ``ring`` (K/V chunks around the CP ring, point-to-point) and
``a2a`` (Ulysses: all-to-all from sequence-sharded to head-sharded and back).

Both take this rank's q [b, n, s/cp, d] and k, v [b, n_kv, s/cp, d] in the load-balanced layout of
``ds_megatron.parallel.cp`` (rank i holds chunks i and 2cp-1-i of 2cp) and return this rank's context
[b, n, s/cp, d], equal to the rows of whole-sequence causal attention at this rank's token indices.  ``group`` is
the CP group (None or one rank: plain causal attention).  Kernels are those of ``cp_kernels``.

Packed documents: ``doc_ids`` [b, s/cp] (this rank's tokens' document ids, ``data.document_mask``) keeps attention
inside each document as well.  The work is then cut into chunk pairs (query chunk, key chunk) of c = s/(2cp)
tokens; a pair whose keys share no document with its queries (:func:`shares_document`) is skipped, neither computed
nor masked; the others run the masked block kernel.  Without ``doc_ids`` nothing changes.  The pairs are planned
by :func:`plan_documents` (one all-gather of the ids over the CP group, one copy to the host); with ``plans`` (a
``TensorCache``, one per model) every layer that receives the same ids tensor reuses the plan, so a micro-batch
is planned once per pipeline stage, not once per layer (forward and recompute).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.context_parallel.kernels import Docs, block_backward, block_forward
from ds_megatron.context_parallel.layout import gather_for_ranks, slice_for_rank, unslice
from ds_megatron.model.layers import TensorCache

Pair = tuple[slice, slice, bool]  # (query rows, key rows, causal) of one block
Planned = tuple[slice, slice, bool, Docs | None]  # a block to compute and its (query, key) document ids, if masked


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


def _seq_major(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised [b, n, s, d] tensor laid out as [s, b, n, d] in memory: the layout of the model's [s, b, h]
    projections, whose q, k, v reach CP attention as [b, n, s, d] views of it.  A context in that layout makes the
    model's reshape back to [s, b, n * d] a view, and gradients of q, k, v in it flow into the projections' backward
    without a copy (a [b, n, s, d]-contiguous one costs a copy per tensor per layer there)."""
    b, n, s, d = shape
    return torch.empty(s, b, n, d, dtype=dtype, device=device).permute(1, 2, 0, 3)


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


def _ring_pairs(rank: int, src: int, c: int) -> list[Pair]:
    """``_ring_block`` cut into chunk pairs (c x c), the unit a document mask can skip: chunk ``rank`` is rows
    [0, c), chunk ``2cp-1-rank`` rows [c, 2c), the same for src's keys."""
    first, second = slice(0, c), slice(c, 2 * c)
    if src == rank:
        return [(first, first, True), (second, first, False), (second, second, True)]
    if src < rank:
        return [(first, first, False), (second, first, False)]
    return [(second, first, False), (second, second, False)]


def shares_document(q_doc: Tensor, k_doc: Tensor) -> bool:
    """Whether any query row of a pair (document ids [b, sq]) has a key (ids [b, sk]) of its own document in the
    same batch row: a pair that shares none has every score masked and is skipped.  A diagonal pair always shares."""
    return any(bool(torch.isin(kd, qd).any()) for qd, kd in zip(q_doc, k_doc, strict=True))


def _plan(pairs: list[Pair], docs: Docs | None, host: Docs | None = None) -> list[Planned]:
    """The blocks to compute: every pair without document ids; with them ((query ids, key ids) of the rows and
    keys the pairs index), the pairs that share a document, each with its slices of the ids for its mask.  The
    decisions read ``host``, a CPU copy of the ids (default ``docs``), so they never wait on the device per pair."""
    if docs is None:
        return [(rows, cols, causal, None) for rows, cols, causal in pairs]
    host = docs if host is None else host
    return [
        (rows, cols, causal, (docs[0][:, rows], docs[1][:, cols]))
        for rows, cols, causal in pairs
        if causal or shares_document(host[0][:, rows], host[1][:, cols])
    ]


def _merge(out: Tensor, lse: Tensor, block: Any) -> None:
    """Merge a block's (out, lse) into the running ``out`` / ``lse`` rows in place (the running lse may be -inf:
    nothing merged yet)."""
    merged = torch.logaddexp(lse, block.lse)
    # A row that has seen no key yet and none in this block either (masked pairs) stays at -inf; the clamp keeps its
    # weights exp(-inf - min) = 0 instead of exp(-inf + inf) = nan.
    safe = merged.clamp_min(torch.finfo(merged.dtype).min)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(torch.exp(block.lse - safe).unsqueeze(-1) * block.out)
    lse.copy_(merged)


def _forward_pairs(
    kernel: str, q: Tensor, kv: Tensor, plan: list[Planned], out: Tensor, lse: Tensor, scale: float, first: bool
) -> None:
    """Compute and merge every planned block; ``first``: out/lse hold nothing yet (copy the first block)."""
    for rows, cols, causal, pair_docs in plan:
        block = block_forward(kernel, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale, pair_docs)
        if first:
            out[:, :, rows].copy_(block.out)
            lse[:, :, rows].copy_(block.lse)
        else:
            _merge(out[:, :, rows], lse[:, :, rows], block)


def _backward_pairs(
    kernel: str, dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, plan: list[Planned], scale: float,
    dq: Tensor, first: bool = False,
) -> list[tuple[slice, Tensor, Tensor]]:  # fmt: skip
    """Add every planned block's dq into ``dq``; return its (key rows, dk, dv) for the caller to add to the K/V's
    accumulator (the ring adds them once the accumulator has arrived).  The forward's plan.  ``first``: ``dq``
    holds nothing yet (uninitialised) and the plan's one block covers every row: copy instead of add."""
    dkv = []
    for rows, cols, causal, pair_docs in plan:
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
            pair_docs,
        )
        if first:
            dq[:, :, rows].copy_(dq_b)
        else:
            dq[:, :, rows] += dq_b
        del dq_b  # added: not kept while the next block runs
        dkv.append((cols, dk_b, dv_b))
    return dkv


def _add_dkv(dkv: Tensor, grads: list[tuple[slice, Tensor, Tensor]]) -> None:
    """Add each block's (dk, dv) into the accumulator ``dkv`` [2, b, n_kv, sk, d]."""
    for cols, dk_b, dv_b in grads:
        dkv[0][:, :, cols] += dk_b
        dkv[1][:, :, cols] += dv_b


def ring_scores_computed(doc_ids: Tensor, cp: int) -> list[int]:
    """Score elements each CP rank's ring computes per (batch, head) with document ids [b, s] of the whole
    sequence (a diagonal pair counts whole: its kernel computes the square, then masks the future): the load balance
    of packed documents, without a process group."""
    c = doc_ids.shape[1] // (2 * cp)
    local = [slice_for_rank(doc_ids, 1, r, cp) for r in range(cp)]
    work = []
    for rank in range(cp):
        blocks = sum(len(_plan(_ring_pairs(rank, src, c), (local[rank], local[src]))) for src in range(cp))
        work.append(blocks * c * c)
    return work


class _RingAttention(torch.autograd.Function):
    """Forward: cp steps; at step t this rank holds the K/V of CP rank (rank - t) mod cp, sends it on to the next
    rank and receives the following one while it computes the attention of the block in hand (two buffers: the one
    in flight is never written).  Partial outputs are merged exactly with their log-sum-exp:
        lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
    Saved for backward: q, the local K/V stack (its first hop in backward), the merged output and its lse; no received
    K/V is kept.  The merged output is written in ``_seq_major`` layout and returned: the model's output projection
    saves the same storage, so the context is stored once.  In backward dq, dk, dv are rounded from their fp32
    accumulators straight into ``_seq_major`` layout.
    Backward: the K/V travel the ring again together with their gradient: dK/dV of the block in hand are added to
    the accumulator that arrives from the previous rank and sent on (fp32, so the sum over cp ranks rounds once;
    the first hop and the last one home in the K/V's dtype, ``_dkv_message``); after cp steps each accumulator has
    visited every rank and takes one last hop home to its owner.

    With document ids the blocks of every step come planned (``plan_documents``: every rank's ids all-gathered
    once, before any K/V arrive), and the plan is kept for backward, which sends no ids.  K/V still travel every
    hop (the next rank may need them)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, kernel: str, scale: float,
        doc_plan: list[list[Planned]] | None,
    ) -> Tensor:  # fmt: skip
        cp, rank = _size_rank(group)
        c = q.shape[2] // 2
        # per step; backward computes the same blocks
        plans = _ring_plans(rank, cp, c, None) if doc_plan is None else doc_plan
        kv = torch.stack([k, v])  # [2, b, n_kv, 2c, d]: one message per hop, at KV-head size
        acc = torch.float32 if q.dtype != torch.float64 else q.dtype
        # Without document ids step 0 is one block over every row (the diagonal), which is copied into out/lse:
        # nothing to initialise.  With them, rows may see nothing until a later step (zeros, -inf).
        first = doc_plan is None
        out = _seq_major(q.shape, acc, q.device)  # merged in the model's layout (see the return below)
        if not first:
            out.zero_()
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        own_kv = kv  # saved for backward, whose first hop sends it again (k and v are not saved apart)
        for step in range(cp):
            requests: list[Any] = []
            if step + 1 < cp:
                recv, requests = _shift(kv, group)
            _forward_pairs(kernel, q, kv, plans[step], out, lse, scale, first=step == 0 and first)
            if requests:
                _wait(requests)
                kv = recv
        # One storage of the context: the merge ran in ``_seq_major`` layout and the cast keeps its strides, so the
        # model's reshape to [s, b, n * d] is a view and the output projection saves this same storage as its
        # input (``ds_megatron.memory`` counts it once).  A consumer cannot write into it in place unnoticed: in fp32
        # it is a view returned by a custom Function, which autograd refuses to modify; in bf16 it is saved, so the
        # backward's version check raises.
        out = out.to(q.dtype)  # fp32: the accumulator itself; bf16: a cast that preserves the layout
        ctx.save_for_backward(q, own_kv, out, lse)
        ctx.first_covers_all = first
        ctx.group, ctx.kernel, ctx.scale, ctx.plans = group, kernel, scale, plans
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, out, lse = ctx.saved_tensors
        group, kernel, scale, plans = ctx.group, ctx.kernel, ctx.scale, ctx.plans
        cp = _size_rank(group)[0]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Step 0 without document ids: one block over every row and every key (the diagonal), copied into dq,
        # which therefore starts uninitialised.
        first = ctx.first_covers_all
        alloc = torch.empty if first else torch.zeros
        dq = alloc(q.shape, dtype=acc, device=q.device)
        dtype = kv.dtype
        # Each buffer is dropped as soon as it is done with, so the backward holds no more than the bytes
        # ``memory.cp_transient_bytes`` counts: the received accumulator lives only in ``received`` (handed to
        # ``_dkv_message``, which takes it out and updates it in place), a finished send's message and requests are
        # dropped before the next message is built, the block grads once added, the last K/V once its blocks ran.
        received: list[Tensor] = []  # the accumulator of the block in hand as the previous rank sent it on
        dkv: Tensor | None = None  # the message in flight
        dkv_requests: list[Any] = []
        for step in range(cp):
            last = step == cp - 1
            kv_requests: list[Any] = []
            if not last:
                kv_next, kv_requests = _shift(kv, group)
            grads = _backward_pairs(kernel, dout, q, kv, out, lse, plans[step], scale, dq, step == 0 and first)
            if last:
                del kv
            # The accumulator of the block in hand (the K/V of rank (rank - step) mod cp) as the previous rank
            # sent it on (nothing at step 0: this rank's own block starts here).  Waiting also completes this
            # rank's previous send, so no buffer in flight is ever written: the received one is complete and is
            # the one updated and sent on.
            _wait(dkv_requests)
            dkv, dkv_requests = None, []  # the finished send
            if step == 0 and not first:  # packed documents: this rank's own block's accumulator starts from zero
                received.append(torch.zeros(kv.shape, dtype=acc, device=q.device))
            dkv = _dkv_message(received, grads, acc, dtype, first=step == 0 and first, last=last)
            recv, dkv_requests = _shift(dkv, group)
            received.append(recv)
            del recv
            if kv_requests:
                _wait(kv_requests)
                kv = kv_next
                del kv_next
        _wait(dkv_requests)  # after cp steps the accumulator of this rank's own block has come home
        dkv, dkv_requests = None, []
        home = received.pop()
        dk, dv = (_seq_major(t.shape, dtype, t.device).copy_(t) for t in home)
        del home
        dq = _seq_major(dq.shape, q.dtype, dq.device).copy_(dq)
        return dq, dk, dv, None, None, None, None


def _dkv_message(
    received: list[Tensor], grads: list[tuple[slice, Tensor, Tensor]], acc: torch.dtype, dtype: torch.dtype,
    first: bool, last: bool,
) -> Tensor:  # fmt: skip
    """The dK/dV accumulator [2, b, n_kv, sk, d] a ring step sends on: what the previous rank sent (taken out of
    ``received``, one tensor; empty when ``first``) plus this step's block grads (``grads``, emptied once added),
    summed in ``acc`` (fp32 for bf16 K/V, so the sum over cp ranks rounds once).  Two hops travel in the K/V's own
    ``dtype`` instead, bit for bit the same: the ``first`` (step 0 without document ids: one block over every key
    row, its grads already in that dtype, nothing summed yet), and the ``last`` (the hop home, whose owner would
    only round it to that dtype): at cp 2 both hops, half the bytes of fp32 ones (``memory.ring_dkv_hop_bytes``).
    The sum is formed in the received buffer itself where it already has the dtype the sum needs, so no copy of it
    exists beside it: in ``acc`` on the middle hops; in ``dtype`` when the last hop receives the first one (cp 2)
    and each key row gets one block's grads (one rounding of the exact sum, as in ``acc``).  Otherwise the one
    conversion is made and the original dropped before the grads are added."""
    if first:
        ((_, dk, dv),) = grads  # the diagonal block: every key row
        grads.clear()
        return torch.stack([dk, dv])
    message = received.pop()
    if message.dtype != acc and not (last and message.dtype == dtype and len(grads) == 1):
        message = message.to(acc)  # the one conversion; the received original is dropped here
    _add_dkv(message, grads)
    grads.clear()
    return message.to(dtype) if last else message  # the last hop: a copy in ``dtype`` unless it already is


def _all_docs(doc_ids: Tensor, group: ProcessGroup) -> Tensor:
    """Every CP rank's document ids [cp, b, s/cp], in rank order (one all-gather of integers)."""
    pieces = [torch.empty_like(doc_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, doc_ids.contiguous(), group=group)
    return torch.stack(pieces)


def _ring_plans(rank: int, cp: int, c: int, all_docs: Tensor | None) -> list[list[Planned]]:
    """The blocks of every ring step (step t: the K/V of rank (rank - t) mod cp): one block per step without
    document ids, the chunk pairs that share a document with them (decided from one CPU copy of the ids)."""
    srcs = [(rank - step) % cp for step in range(cp)]
    if all_docs is None:
        return [_plan([_ring_block(rank, src, c)], None) for src in srcs]
    host = all_docs.cpu()
    return [_plan(_ring_pairs(rank, src, c), (all_docs[rank], all_docs[src]), (host[rank], host[src])) for src in srcs]


class _LocalAttention(torch.autograd.Function):
    """Causal attention of a whole local sequence with the same kernels (cp 1, and a2a's head-sharded core).  With
    packed documents, ``plan`` (``plan_documents``): the pairs (query chunk, earlier or same key chunk) of the
    sequence cut into chunks that share a document, the only ones computed."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, kernel: str, scale: float, plan: list[Planned] | None
    ) -> Tensor:
        if plan is None:
            out, lse = block_forward(kernel, q, k, v, True, scale)
        else:
            acc = torch.float32 if q.dtype != torch.float64 else q.dtype
            out = torch.zeros(q.shape, dtype=acc, device=q.device)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
            _forward_pairs(kernel, q, torch.stack([k, v]), plan, out, lse, scale, first=False)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale, ctx.plan = kernel, scale, plan
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.plan is None:
            dq, dk, dv = block_backward(ctx.kernel, dout, q, k, v, out, lse, True, ctx.scale)
            return dq, dk, dv, None, None, None
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        grads = _backward_pairs(ctx.kernel, dout.contiguous(), q, kv, out, lse, ctx.plan, ctx.scale, dq)
        _add_dkv(dkv, grads)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _local_pairs(s: int, num_chunks: int) -> list[Pair]:
    """Every (query chunk i, key chunk j <= i) of a sequence of ``s`` tokens cut into ``num_chunks`` chunks (as
    equal as ``s`` allows; the diagonal pairs are square)."""
    bounds = [i * s // num_chunks for i in range(num_chunks + 1)]
    chunks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    return [(chunks[i], chunks[j], i == j) for i in range(num_chunks) for j in range(i + 1)]


def plan_documents(cp_comm: str, doc_ids: Tensor, group: ProcessGroup | None) -> list[list[Planned]]:
    """The blocks one attention layer computes with this rank's document ids [b, s/cp], the same for every layer
    of a micro-batch: one all-gather of the ids over the CP group (cp > 1) and one copy to the host (a device sync)
    decide them all.  The ring (cp > 1): the chunk pairs of each ring step.  Otherwise one list, the local
    attention's pairs: cp 1 over the rank's 2 chunks, a2a's head-sharded core over the whole sequence's 2cp.
    Each block's mask is still built from the plan's ids where the block runs (b c^2 comparisons beside the masked
    block's own n b c^2 fp32 scores): kept for the micro-batch, the masks would hold b (2cp + 1) c^2 bytes on the
    ring and b cp (2cp + 1) c^2 on a2a (at s 128k, cp 8: 1.1 and 9.1 GB per micro-batch in flight)."""
    cp, rank = _size_rank(group)
    if cp > 1 and cp_comm == "ring":
        return _ring_plans(rank, cp, doc_ids.shape[1] // 2, _all_docs(doc_ids, group))
    full = doc_ids if cp == 1 else gather_for_ranks(doc_ids, 1, group)  # [b, s]
    host = full.cpu()
    return [_plan(_local_pairs(full.shape[1], 2 * cp), (full, full), (host, host))]


def _document_plan(
    cp_comm: str, doc_ids: Tensor | None, group: ProcessGroup | None, plans: TensorCache | None
) -> list[list[Planned]] | None:
    """``plan_documents`` of ``doc_ids``, from ``plans`` when these ids were planned already (a cache serves one
    CP group and ``cp_comm``: the model's)."""
    if doc_ids is None:
        return None
    if plans is None:
        return plan_documents(cp_comm, doc_ids, group)
    return plans.get(doc_ids, lambda: plan_documents(cp_comm, doc_ids, group))


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float,
    doc_ids: Tensor | None = None, plans: TensorCache | None = None,
) -> Tensor:  # fmt: skip
    """Causal ring attention over the CP group (see ``_RingAttention``); ``doc_ids`` [b, s/cp] this rank's tokens'
    document ids (None: no document masking), planned once per ids tensor with ``plans``."""
    plan = _document_plan("ring", doc_ids, group, plans)
    if _size_rank(group)[0] == 1:
        return _LocalAttention.apply(q, k, v, kernel, scale, None if plan is None else plan[0])
    return _RingAttention.apply(q, k, v, group, kernel, scale, plan)


def _seq_to_heads(xs: tuple[Tensor, ...], group: ProcessGroup) -> tuple[Tensor, ...]:
    """Each x [b, n_x, s/cp, d] (this rank's chunks, all local heads; any strides) -> [b, n_x/cp, s, d] (head group
    ``rank``, the whole sequence in order), all of them in one all-to-all: q, k and v travel as one message per
    peer instead of three.  The send buffer is written straight from the inputs (one pass each), the received
    shards put back in sequence order by the layout's ``unslice`` (rank r's shard holds chunks r and 2cp-1-r: one
    more pass); the outputs are head slices of that one [b, sum n_x/cp, s, d] tensor."""
    cp = dist.get_world_size(group)
    b, _, sl, d = xs[0].shape
    parts = [x.shape[1] // cp for x in xs]
    send = xs[0].new_empty(cp, b, sum(parts), sl, d)  # [cp (dest), b, heads of every x for dest, s/cp, d]
    start = 0
    for x, part in zip(xs, parts, strict=True):
        send[:, :, start : start + part].copy_(x.reshape(b, cp, part, sl, d).transpose(0, 1))
        start += part
    recv = torch.empty_like(send)  # [cp (source rank), b, heads, s/cp, d]
    dist.all_to_all_single(recv, send, group=group)
    return unslice(list(recv.unbind(0)), dim=2).split(parts, dim=1)


def _heads_to_seq(ys: tuple[Tensor, ...], group: ProcessGroup) -> tuple[Tensor, ...]:
    """The inverse of ``_seq_to_heads``: each y [b, n_y/cp, s, d] -> [b, n_y, s/cp, d] in ``_seq_major`` layout,
    all of them in one all-to-all."""
    cp = dist.get_world_size(group)
    b, _, s, d = ys[0].shape
    c = s // (2 * cp)
    parts = [y.shape[1] for y in ys]
    # Rank r's shard is its chunks (r, 2cp-1-r) of the sequence, written straight into the send buffer (one pass
    # over each y; slicing each rank's chunks out and stacking them would be two).
    send = ys[0].new_empty(cp, b, sum(parts), 2, c, d)  # [cp (dest), b, heads, (first, second chunk), c, d]
    start = 0
    for y, part in zip(ys, parts, strict=True):
        chunks, dest = y.reshape(b, part, 2 * cp, c, d), send[:, :, start : start + part]
        dest[:, :, :, 0].copy_(chunks[:, :, :cp].permute(2, 0, 1, 3, 4))  # first chunks: chunk r to rank r
        for r in range(cp):
            dest[r, :, :, 1].copy_(chunks[:, :, 2 * cp - 1 - r])  # second chunks, in reverse order
        start += part
    send = send.view(cp, b, sum(parts), 2 * c, d)  # [cp (dest), b, heads, s/cp, d]
    recv = torch.empty_like(send)  # [cp (source head group), b, heads, s/cp, d]
    dist.all_to_all_single(recv, send, group=group)
    outs, start = [], 0
    for part in parts:  # head group g of the source rank g: heads [g * part, (g + 1) * part) of the output
        out = _seq_major(torch.Size((b, cp * part, 2 * c, d)), recv.dtype, recv.device)
        out.view(b, cp, part, 2 * c, d).copy_(recv[:, :, start : start + part].transpose(0, 1))
        outs.append(out)
        start += part
    return tuple(outs)


class _SeqToHeads(torch.autograd.Function):
    """Forward: one all-to-all of every input, sequence-sharded -> head-sharded.  Backward: the inverse one."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return _seq_to_heads(xs, group)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return None, *_heads_to_seq(grads, ctx.group)


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all head-sharded -> sequence-sharded.  Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq((y,), group)[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # The gradient arrives in the model's layout ([b, n, s/cp, d] over [s/cp, b, n * d]); the send buffer is
        # written from it directly, never from a contiguous copy first.
        return _seq_to_heads((grad,), ctx.group)[0], None


def a2a_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float,
    doc_ids: Tensor | None = None, plans: TensorCache | None = None,
) -> Tensor:  # fmt: skip
    """Ulysses attention: q, k, v all-to-all'd to n/cp (n_kv/cp) heads of the whole sequence, causal attention
    there, the context all-to-all'd back.  Query head group r meets KV head group r: head i uses KV head
    i // (n / n_kv), and both are split into cp contiguous groups.  Heads must divide by cp (``check_cp_heads``).
    Two all-to-alls per call each way (q, k, v together; the context), where one per tensor would be four; the
    context and the gradients of q, k, v come back in ``_seq_major`` layout.

    Not DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: it takes [b, s, n, d] or [s, b, n, d] (a
    transpose copy each way around this [b, n, s, d] core), gathers shards in rank order only (the balanced layout
    would need one more reorder of q, k, v and the context) and runs on ``deepspeed.comm``; here the reorder is the
    copy the all-to-all needs anyway.

    ``doc_ids`` [b, s/cp]: every rank's ids are all-gathered into the whole sequence's [b, s] (integers, no
    autograd; once per ids tensor with ``plans``) and the head-sharded core skips the pairs of its 2cp chunks that
    share no document."""
    plan = _document_plan("a2a", doc_ids, group, plans)
    local = None if plan is None else plan[0]
    if _size_rank(group)[0] == 1:
        return _LocalAttention.apply(q, k, v, kernel, scale, local)
    q, k, v = _SeqToHeads.apply(group, q, k, v)
    return _HeadsToSeq.apply(_LocalAttention.apply(q, k, v, kernel, scale, local), group)


CP_ATTENTION = {"ring": ring_attention, "a2a": a2a_attention}


def cp_attention(
    cp_comm: str, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None, kernel: str, scale: float,
    doc_ids: Tensor | None = None, plans: TensorCache | None = None,
) -> Tensor:  # fmt: skip
    """Causal attention of this rank's chunks over the CP group with ``cp_comm`` in ("ring", "a2a"); with
    ``doc_ids`` [b, s/cp] (this rank's tokens' document ids) also only within each document, the blocks planned
    once per ids tensor with ``plans`` (the model's cache for this group and ``cp_comm``)."""
    return CP_ATTENTION[cp_comm](q, k, v, group, kernel, scale, doc_ids, plans)
