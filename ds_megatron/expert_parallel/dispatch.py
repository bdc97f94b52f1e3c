"""Token dispatch and combine over the expert-parallel (EP) group: every collective of expert parallelism.

Experts are owned in contiguous blocks: EP rank i holds global experts ``[i * E/ep, (i + 1) * E/ep)``.  A rank sorts
its (token, expert) pairs by global expert, so the rows bound for each owner are one contiguous run, then:

1. :func:`plan_dispatch` exchanges the counts: an all-to-all of equal splits sends each owner this rank's count for
   each of its E/ep experts; the received table ``[ep, E/ep]`` (source rank x local expert) gives the rows each
   source sends.  ``all_to_all_single`` takes split sizes as host integers, so the table and this rank's own counts
   are copied to the host once per layer call (one device-to-host copy; the counts tensors themselves stay on the
   device, as NCCL requires).
2. :func:`dispatch`: an all-to-all with variable splits (forward: rows to their owners; backward: their gradients
   home), then a permutation from (source, local expert) order to (local expert, source) order, so that each local
   expert's rows are consecutive for the grouped GEMM.
3. :func:`combine`: the inverse permutation and the reverse all-to-all (backward: the gradients of the expert outputs
   back to the owners).

:func:`start_all_to_all` is the same exchange started asynchronously, for the overlapped path
(``expert_parallel.overlap``: the rows in chunks of local experts, each chunk's exchange in flight while another
computes).

Every function returns early (no collective) when the group is ``None`` (ep 1).  Split sizes may be zero: an expert,
or a whole rank, may receive no token; the all-to-alls and the grouped GEMM take empty runs.

torch ships an autograd all-to-all (``torch.distributed.nn.functional.all_to_all_single``), deprecated in torch 2.13
in favour of the private ``torch.distributed._functional_collectives``; DeepSpeed's only variable-split one is a
private class of its AutoEP layer.  So the 20 lines of :class:`_AllToAllV` are ours.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.expert_parallel.layout import EPLayout, ep_layout
from ds_megatron.topology import ParallelTopology, _my_group


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def build_ep_groups(layout: EPLayout, rank: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """Create every EP group, then every expert-DP group of ``layout`` (collective: every rank of the world calls
    it, in the same order) and return this rank's (ep_group, expert_dp_group); a group of one is ``None``."""
    ep_group = _my_group([list(g) for g in layout.ep_groups], rank)
    expert_dp_group = _my_group([list(g) for g in layout.expert_dp_groups], rank)
    return ep_group, expert_dp_group


def attach_ep_groups(topology: ParallelTopology, ep: int, sequence_parallel: bool, expert_tp: int = 1) -> None:
    """Build the EP and expert-DP groups of ``topology``'s world at ``ep`` and ``expert_tp`` (collective, once per
    run, after the topology's own groups) and keep this rank's on ``topology``; ep 1 builds nothing."""
    if ep == 1:
        return
    layout = ep_layout(topology.tp, topology.cp, topology.dp, topology.pp, ep, sequence_parallel, None, expert_tp)
    topology.expert_tp = expert_tp
    topology.ep_group, topology.expert_dp_group = build_ep_groups(layout, topology.rank)
    if topology.expert_dp_group is None:
        # an expert-DP group of one (ep = every token rank of the stage) still becomes a real group: DeepSpeed's
        # engine broadcasts each expert parameter over the expert-DP group it finds registered under the
        # parameter's group name (``None`` there would mean the whole world)
        for line in layout.expert_dp_groups:
            group = dist.new_group(ranks=list(line))
            topology.expert_dp_group = group if topology.rank in line else topology.expert_dp_group
    topology.ep, topology.expert_grad_divisor = ep, layout.expert_grad_divisor


class _AllToAllV(torch.autograd.Function):
    """forward: all-to-all of dim-0 rows, ``send_splits[d]`` rows to EP rank d, ``recv_splits[s]`` from rank s;
    backward: the reverse all-to-all of the gradients (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup) -> Tensor:
    out = torch.empty((sum(recv_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def start_all_to_all(
    x: Tensor, out: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup
) -> dist.Work:
    """Start the all-to-all of ``x``'s rows into ``out`` (both contiguous, on the same device), ``send_splits[d]``
    rows to EP rank d and ``recv_splits[s]`` from rank s, and return its handle.  The caller waits the handle before
    reading ``out`` and keeps ``x`` alive and unchanged until then (gloo reads it on its own thread, NCCL on its
    stream); every rank starts its exchanges in the same order."""
    return dist.all_to_all_single(out, x, recv_splits, send_splits, group=group, async_op=True)


def all_to_all_v(x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None) -> Tensor:
    """Autograd all-to-all with variable splits along dim 0 (``x`` itself when the group has one rank)."""
    if group_size(group) == 1:
        return x
    return _AllToAllV.apply(x, send_splits, recv_splits, group)


class DispatchPlan(NamedTuple):
    """What one layer call's dispatch and combine need, from the exchanged counts.

    send_splits     rows this rank sends to each EP rank (host ints)
    recv_splits     rows this rank receives from each EP rank (host ints)
    local_counts    [E/ep] int64 on the device: rows per local expert after dispatch
    to_experts      [m] int64: received row order (source, local expert) -> (local expert, source)
    from_experts    [m] int64: its inverse
    """

    send_splits: list[int]
    recv_splits: list[int]
    local_counts: Tensor
    to_experts: Tensor
    from_experts: Tensor


def exchange_counts(per_expert: Tensor, group: ProcessGroup | None) -> Tensor:
    """[E] pairs per global expert on this rank -> [ep, E/ep]: row s = what EP rank s sends to this rank's experts
    (an all-to-all of equal splits, E/ep counts to each owner)."""
    ep = group_size(group)
    if ep == 1:
        return per_expert.view(1, -1)
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert.contiguous(), group=group)
    return received.view(ep, -1)


def plan_dispatch(per_expert: Tensor, group: ProcessGroup | None) -> DispatchPlan:
    """The split sizes and permutations of one dispatch, from this rank's [E] int64 pairs per global expert."""
    ep = group_size(group)
    received = exchange_counts(per_expert, group)  # [ep, E/ep]
    local_experts = received.shape[1]
    sent = per_expert.view(ep, local_experts).sum(1)
    host = torch.cat([sent, received.sum(1)]).tolist()  # the one device-to-host copy of the layer call
    send_splits, recv_splits = host[:ep], host[ep:]
    # received rows arrive grouped by source, each source's rows sorted by local expert: label each row with its
    # local expert and sort stably, so that each expert's rows are consecutive, in source order
    labels = torch.arange(local_experts, device=per_expert.device).repeat(ep)
    received_labels = labels.repeat_interleave(received.reshape(-1), output_size=sum(recv_splits))  # no 2nd sync
    to_experts = torch.argsort(received_labels, stable=True)
    from_experts = torch.empty_like(to_experts)
    from_experts[to_experts] = torch.arange(to_experts.numel(), device=to_experts.device)
    return DispatchPlan(send_splits, recv_splits, received.sum(0), to_experts, from_experts)


def dispatch(rows: Tensor, plan: DispatchPlan, group: ProcessGroup | None) -> Tensor:
    """[n k, h] rows sorted by global expert -> [m, h] the rows of this rank's experts, grouped by local expert."""
    received = all_to_all_v(rows, plan.send_splits, plan.recv_splits, group)
    return received.index_select(0, plan.to_experts)


def combine(out: Tensor, plan: DispatchPlan, group: ProcessGroup | None) -> Tensor:
    """[m, h] expert outputs grouped by local expert -> [n k, h] in the order this rank sent its rows."""
    by_source = out.index_select(0, plan.from_experts)
    return all_to_all_v(by_source, plan.recv_splits, plan.send_splits, group)
