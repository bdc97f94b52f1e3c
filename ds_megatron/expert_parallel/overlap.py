"""The expert-parallel exchange overlapped with the local experts' compute: ``ds_megatron.parallel.ep_dispatch_chunks``
= C > 1 (the default, 1, is :class:`~ds_megatron.expert_parallel.layer.ExpertParallelMoE`'s blocking path).

**Chunks are ranges of local experts.**  EP rank i's E/ep local experts are cut into C contiguous ranges
(:func:`chunk_of`); chunk c carries, from every source rank, the rows routed to the experts of range c.  Because each
source sorts its rows by expert, a chunk is one contiguous run of each (source, owner) block, and every expert sees
all of its rows in one grouped GEMM, in the blocking path's order (by source, each source's in token order): its
output rows and its weight gradient (a sum over its rows) are computed by the same GEMM calls on the same operands,
so the results are bit for bit the blocking path's (tested, fp32 and bf16).  Cutting rows instead (by row ranges of
each block, or by source rank) would split each expert's weight-gradient sum into C partial sums (results then
differ at rounding) and run C GEMMs of 1/C the rows each (slower: benchmarks/results/moe.md, section 2).  The cost:
C <= E/ep, and chunk sizes follow the router's load (a chunk whose experts receive nothing is an empty exchange).

Forward of one layer call (every rank starts its exchanges in the same order, as NCCL requires):

1. :func:`plan_chunks`: the counts exchange of ``dispatch.exchange_counts`` and one device-to-host copy (this rank's
   [E] counts and the received [ep, E/ep] table: every chunk's split sizes as host ints); permutations on the device.
2. :class:`_Dispatch`: this rank's rows reordered chunk-major (chunk, owner, expert; one ``index_select``) and the C
   dispatch all-to-alls started at once (``dispatch.start_all_to_all``).
3. The shared expert (Qwen2-MoE), if any, runs on this rank's tokens while they are in flight (the layer's forward).
4. :class:`_ExpertsAndCombine`: for each chunk, wait its dispatch, regroup its rows by local expert, run its experts
   (``moe_layer.grouped_mlp`` on its slice of the expert weights), start its combine all-to-all; chunk c + 1's
   dispatch and chunk c - 1's combine are in flight meanwhile.  Then wait every combine and put the outputs back in
   the rows' order.

Backward, in :class:`_ExpertsAndCombine`'s: the C combine-gradient all-to-alls started at once; for each chunk, wait
its gradients, run its experts' backward (a graph built in forward on detached inputs, or, under ``moe`` selective
recompute, the layer's checkpoint recomputing them from the kept chunk rows: no all-to-all runs again), start its
rows' gradients home.  :class:`_Dispatch`'s backward waits them.  Autograd runs a ready node of higher sequence number
first (nodes made later in forward), so between the two the shared expert's backward runs, made between them in
forward: its gradients are computed while the rows' gradients travel (tested on the order of events).

GPU contract: each handle is waited before its output is read; each send buffer is kept (on the exchange) until its
handle is waited; every buffer is made from the rows' device and dtype; the split sizes are the plan's host ints,
and nothing else is copied to the host (the loop GEMM gets its counts from the plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.distributed import ProcessGroup

from ds_megatron.expert_parallel.dispatch import exchange_counts, group_size, start_all_to_all
from ds_megatron.model.moe_layer import grouped_mlp


def chunk_of(expert, local_experts: int, chunks: int):
    """The chunk of local expert ``expert`` (an int or an int64 tensor): local experts cut into ``chunks`` contiguous
    ranges of floor or ceil(E/ep / C) experts, chunk c starting at floor(c L / C)."""
    return ((expert + 1) * chunks - 1) // local_experts


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """Each chunk's [first, last + 1) local experts (:func:`chunk_of`'s ranges)."""
    of = [chunk_of(e, local_experts, chunks) for e in range(local_experts)]
    return [(of.index(c), len(of) - of[::-1].index(c)) for c in range(chunks)]


class ChunkPlan(NamedTuple):
    """One layer call's chunked exchange, from the exchanged counts.

    bounds          [C] (first, last + 1) local experts of each chunk
    send, recv      [C][ep] host ints: rows this rank sends to / receives from each EP rank in chunk c
    host_counts     [C][experts of c] host ints: rows per local expert (the loop GEMM's counts)
    local_counts    [E/ep] int64 on the device: rows per local expert
    send_order      [n k] int64: the rows (sorted by global expert) in chunk-major order (chunk, owner, expert)
    send_back       [n k] int64: its inverse
    to_experts      [m] int64: received rows, chunk-major (chunk, source, expert) -> by local expert, each
                    expert's by source; chunk c's rows keep their range [recv_start[c], + sum(recv[c]))
    from_experts    [m] int64: its inverse
    """

    bounds: list[tuple[int, int]]
    send: list[list[int]]
    recv: list[list[int]]
    host_counts: list[list[int]]
    local_counts: Tensor
    send_order: Tensor
    send_back: Tensor
    to_experts: Tensor
    from_experts: Tensor

    @property
    def send_start(self) -> list[int]:
        return _starts(self.send)

    @property
    def recv_start(self) -> list[int]:
        return _starts(self.recv)


def _starts(splits: list[list[int]]) -> list[int]:
    starts = [0]
    for split in splits:
        starts.append(starts[-1] + sum(split))
    return starts


def _inverse(order: Tensor) -> Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def plan_chunks(per_expert: Tensor, group: ProcessGroup, chunks: int) -> ChunkPlan:
    """The split sizes and permutations of a dispatch in ``chunks`` chunks, from this rank's [E] int64 pairs per
    global expert (the counts exchange, then the layer call's one device-to-host copy)."""
    ep = group_size(group)
    received = exchange_counts(per_expert, group)  # [ep, L]: source x local expert
    local = received.shape[1]
    host = torch.cat([per_expert, received.reshape(-1)]).tolist()  # the one device-to-host copy of the layer call
    mine = [host[d * local : (d + 1) * local] for d in range(ep)]  # to owner d, per its local expert
    theirs = [host[(ep + s) * local : (ep + s + 1) * local] for s in range(ep)]  # from source s, per local expert
    bounds = chunk_bounds(local, chunks)
    send = [[sum(row[lo:hi]) for row in mine] for lo, hi in bounds]
    recv = [[sum(row[lo:hi]) for row in theirs] for lo, hi in bounds]
    host_counts = [[sum(row[e] for row in theirs) for e in range(lo, hi)] for lo, hi in bounds]
    device = per_expert.device
    # send side: each row's global expert -> (chunk, owner) key; a stable sort keeps each block's expert order
    experts = torch.arange(per_expert.numel(), device=device)
    row_expert = experts.repeat_interleave(per_expert, output_size=sum(host[: ep * local]))
    send_order = torch.argsort(chunk_of(row_expert % local, local, chunks) * ep + row_expert // local, stable=True)
    # receive side: the (source, local expert) runs arrive chunk-major; label each row with its local expert and sort
    # stably (each chunk's rows stay in its range, each expert's in source order)
    runs = torch.arange(ep * local, device=device)  # run r = (source r // L, local expert r % L)
    run_order = torch.argsort(chunk_of(runs % local, local, chunks) * ep * local + runs, stable=True)
    labels = (run_order % local).repeat_interleave(received.reshape(-1)[run_order], output_size=sum(host[ep * local :]))
    to_experts = torch.argsort(labels, stable=True)
    return ChunkPlan(
        bounds, send, recv, host_counts, received.sum(0), send_order, _inverse(send_order), to_experts,
        _inverse(to_experts),
    )  # fmt: skip


class Exchange:
    """One layer call's chunked dispatch, experts and combine: the plan, the group, how the experts run, and what is
    in flight between the two autograd functions (:class:`_Dispatch` starts the dispatch and, in backward, waits the
    rows' gradients; :class:`_ExpertsAndCombine` waits the dispatch and, in backward, starts the gradients home).

    ``recompute(fn, *inputs)``: the layer's selective ``moe`` checkpoint (None: the experts' activations kept)."""

    def __init__(self, plan: ChunkPlan, group: ProcessGroup, gemm: str, recompute=None):
        self.plan, self.group, self.gemm, self.recompute = plan, group, gemm, recompute
        self.graph = torch.is_grad_enabled()  # build the experts' graphs for backward
        self.rows_grad = False  # whether the rows' gradients are sent home (set by _Dispatch)
        self.in_flight: list = []  # (handle, buffers kept until it completes)
        self.received: Tensor | None = None  # [m, h] chunk-major, filled chunk by chunk as handles complete
        # per chunk: (the output's gradient edge, input leaf, gate_up leaf, down leaf): the edge, not the output
        # itself, so that the experts' outputs are freed once sent, as on the blocking path
        self.graphs: list = []
        self.grad_sent: Tensor | None = None  # [n k, h] chunk-major: the rows' gradients, filled as handles complete

    def start(self, x: Tensor, out: Tensor, send: list[int], recv: list[int]) -> None:
        self.in_flight.append((start_all_to_all(x, out, send, recv, self.group), x))

    def wait(self, count: int | None = None) -> None:
        """Wait the first ``count`` handles in flight (all: None), oldest first, and let their send buffers go."""
        count = len(self.in_flight) if count is None else count
        for handle, _ in self.in_flight[:count]:
            handle.wait()
        del self.in_flight[:count]


def _chunk(plan: ChunkPlan, c: int, starts: list[int]) -> slice:
    return slice(starts[c], starts[c + 1])


class _Dispatch(torch.autograd.Function):
    """forward: the rows [n k, h] (sorted by global expert) sent to their experts' owners, chunk by chunk, the
    all-to-alls left in flight (their outputs on ``ex.received``); returns an empty tensor that links the experts'
    function after this one.  backward: waits the rows' gradients (started by that function's backward) and puts
    them back in the rows' order."""

    @staticmethod
    def forward(ctx, rows: Tensor, ex: Exchange) -> Tensor:
        plan = ex.plan
        ctx.ex = ex
        ctx.save_for_backward(plan.send_back)
        ex.rows_grad = ex.graph and rows.requires_grad
        sent = rows.index_select(0, plan.send_order)  # chunk-major
        ex.received = rows.new_empty((plan.recv_start[-1], rows.shape[1]))
        for c, (send, recv) in enumerate(zip(plan.send, plan.recv, strict=True)):
            ex.start(sent[_chunk(plan, c, plan.send_start)], ex.received[_chunk(plan, c, plan.recv_start)], send, recv)
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx, _link: Tensor) -> tuple[Tensor | None, None]:
        ex = ctx.ex
        (send_back,) = ctx.saved_tensors
        ex.wait()  # the rows' gradients, every chunk's
        grad = ex.grad_sent.index_select(0, send_back)
        ex.grad_sent = None
        return grad, None


class _ExpertsAndCombine(torch.autograd.Function):
    """forward: for each chunk, wait its dispatch, run its local experts on its rows (by local expert), start its
    combine; then wait the combines and return the expert outputs [n k, h] in the rows' order.  backward: the
    outputs' gradients to the experts' owners (all chunks started at once), then for each chunk its experts' backward
    and its rows' gradients started home (``_Dispatch.backward`` waits them); the expert weights' gradients."""

    @staticmethod
    def forward(ctx, link: Tensor, gate_up_proj: Tensor, down_proj: Tensor, ex: Exchange) -> Tensor:
        plan = ex.plan
        ctx.ex = ex
        ctx.save_for_backward(plan.send_order, plan.to_experts, plan.from_experts)
        rows, hidden = plan.send_start[-1], ex.received.shape[1]
        back = ex.received.new_empty((rows, hidden))  # chunk-major, as sent
        for c, (lo, hi) in enumerate(plan.bounds):
            ex.wait(1)  # chunk c's dispatch (the oldest in flight)
            span = _chunk(plan, c, plan.recv_start)
            inp = ex.received.index_select(0, plan.to_experts[span])  # by local expert
            out = _run_experts(ex, c, inp, gate_up_proj[lo:hi], down_proj[lo:hi])
            by_source = out.detach().index_select(0, plan.from_experts[span] - span.start)
            # the combine: the reverse exchange (what came from each source goes back to it)
            ex.start(by_source, back[_chunk(plan, c, plan.send_start)], plan.recv[c], plan.send[c])
        ex.wait()  # every combine
        ex.received = None
        return back.index_select(0, plan.send_back)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, None]:
        ex, plan = ctx.ex, ctx.ex.plan
        send_order, to_experts, from_experts = ctx.saved_tensors
        grad_sent = grad.index_select(0, send_order)  # chunk-major, as sent
        grad_out = grad.new_empty((plan.recv_start[-1], grad.shape[1]))  # by source, as received
        for c in range(len(plan.bounds)):
            span, sent = _chunk(plan, c, plan.recv_start), _chunk(plan, c, plan.send_start)
            ex.start(grad_sent[sent], grad_out[span], plan.send[c], plan.recv[c])
        ex.grad_sent = grad.new_empty(grad_sent.shape) if ex.rows_grad else None
        weights: list[list[Tensor]] = [[], []]
        for c, (edge, leaf, gate_up, down) in enumerate(ex.graphs):
            ex.wait(1)  # chunk c's output gradients
            span = _chunk(plan, c, plan.recv_start)
            if edge is not None:
                torch.autograd.backward(edge, grad_out.index_select(0, to_experts[span]))
            for kept, param in zip(weights, (gate_up, down), strict=True):
                kept.append(param.grad if param.grad is not None else torch.zeros_like(param))
            if ex.rows_grad:  # the rows' gradients home, by source as they came
                grad_in = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                by_source = grad_in.index_select(0, from_experts[span] - span.start)
                ex.start(by_source, ex.grad_sent[_chunk(plan, c, plan.send_start)], plan.recv[c], plan.send[c])
        ex.graphs = []
        grads = [torch.cat(kept) if need else None for kept, need in zip(weights, ctx.needs_input_grad[1:3])]
        return grad.new_empty(0), *grads, None


def _run_experts(ex: Exchange, c: int, inp: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """Chunk c's experts on its rows [m_c, h] (grouped by local expert); in training a graph on detached leaves is
    kept for backward (its activations, or under selective ``moe`` only ``inp``: the checkpoint recomputes them)."""
    plan = ex.plan
    lo, hi = plan.bounds[c]

    def run(rows: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        return grouped_mlp(rows, plan.local_counts[lo:hi], gate_up, down, ex.gemm, plan.host_counts[c])

    if not ex.graph:
        return run(inp, gate_up_proj, down_proj)
    leaf = inp.requires_grad_()  # a new tensor (index_select's), no graph
    gate_up, down = (w.detach().requires_grad_(w.requires_grad) for w in (gate_up_proj, down_proj))
    with torch.enable_grad():
        if ex.recompute is not None:  # the experts closed over: the checkpoint's backward accumulates their grads
            out = ex.recompute(lambda rows: run(rows, gate_up, down), leaf)
        else:
            out = run(leaf, gate_up, down)
    # an output outside the graph (a kernel that returns a detached empty tensor) still takes part in backward's
    # exchange, with zero gradients
    ex.graphs.append((get_gradient_edge(out) if out.requires_grad else None, leaf, gate_up, down))
    return out


def overlapped_experts(
    rows: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    ex: Exchange,
    while_in_flight: Callable[[], Tensor | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The expert outputs [n k, h] of ``rows`` [n k, h] (sorted by global expert), in their order: dispatched,
    computed and combined chunk by chunk (module docstring).  ``while_in_flight()`` runs between the start of the
    dispatch and its first wait (the shared expert); its result is returned beside the outputs."""
    link = _Dispatch.apply(rows, ex)
    beside = while_in_flight() if while_in_flight is not None else None
    return _ExpertsAndCombine.apply(link, gate_up_proj, down_proj, ex), beside
