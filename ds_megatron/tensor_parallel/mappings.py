"""Autograd collectives of Megatron tensor and sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).

Each function names its forward / backward collective.  All return their input unchanged when the group has one
rank.  Sequence-parallel tensors are laid out ``[s, b, h]`` and split along dim 0 (the sequence).

gloo (CPU) has no reduce-scatter and no all-gather into one tensor; there the same results are computed with an
all-reduce plus a slice and with a list all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    x = x.contiguous()
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}")
    if _is_gloo(group):  # gloo has no reduce-scatter: all-reduce a copy (the caller's tensor stays as it was)
        rank = dist.get_rank(group)
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        # a copy, as NCCL's out-of-place result: a view of the sum would keep all t shards alive while it is used
        return x.chunk(n, dim=0)[rank].clone()
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class Pending:
    """A collective launched with ``async_op=True``: compute that does not need its result runs in between, then
    :meth:`wait` returns the result (the overlap of Megatron's linear layers, on NCCL and gloo alike)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def all_reduce_async(x: torch.Tensor, group: ProcessGroup | None) -> Pending:
    """Sum over ``group`` in place of ``x`` (a fresh buffer the caller owns), started now; ``x`` itself with one
    rank (a linear whose weight gradients are deferred runs through the same autograd function at tp 1)."""
    if group_size(group) == 1:
        return Pending(None, lambda: x)
    x = x.contiguous()
    return Pending(dist.all_reduce(x, group=group, async_op=True), lambda: x)


def all_gather_dim0_async(x: torch.Tensor, group: ProcessGroup) -> Pending:
    n, x = group_size(group), x.contiguous()
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(n)]
        return Pending(dist.all_gather(parts, x, group=group, async_op=True), lambda: torch.cat(parts, dim=0))
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return Pending(dist.all_gather_into_tensor(out, x, group=group, async_op=True), lambda: out)


def reduce_scatter_dim0_async(x: torch.Tensor, group: ProcessGroup) -> Pending:
    """Reduce-scatter along dim 0 of ``x`` (a fresh buffer the caller owns; gloo sums it in place)."""
    n, x = group_size(group), x.contiguous()
    if x.shape[0] % n != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}")
    if _is_gloo(group):  # no reduce-scatter in gloo: all-reduce, then keep this rank's chunk
        rank = dist.get_rank(group)
        return Pending(dist.all_reduce(x, group=group, async_op=True), lambda: x.chunk(n, dim=0)[rank].contiguous())
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return Pending(dist.reduce_scatter_tensor(out, x, group=group, async_op=True), lambda: out)


def _split_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient may be shared with another branch of the graph (``a + f(a)`` hands both addends
        # the same tensor): reduce a copy, never the caller's tensor.
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceFromTPInPlace(torch.autograd.Function):
    """g without a copy: forward all-reduce in place, backward identity.  For fresh intermediates only (a matmul's
    output); autograd's version counter turns any other use into an error, never a wrong gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """SP before a column-parallel linear: forward all-gather along the sequence, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP after a row-parallel linear: forward reduce-scatter along the sequence, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)  # out of place on every backend

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Enter the SP region from a replicated tensor: forward keep this rank's sequence chunk, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    """Leave a column-parallel region: forward all-gather along the last dim, backward keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, grad.dim() - 1, ctx.group), None


class _SyncGrads(torch.autograd.Function):
    """Parameters that see only a sequence shard under SP: forward identity, backward one all-reduce (sum) of all
    their gradients, coalesced into a single buffer.  The gradient that reaches ``.grad`` (and so any DeepSpeed
    optimizer, accumulation or bf16 path) is already the full-sequence gradient (DeepSpeed does not know these
    parameters need a TP sum)."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if present:
            flat = _all_reduce(torch.cat([g.reshape(-1) for g in present]), ctx.group)
            out, offset = [], 0
            for g in grads:
                if g is None:
                    out.append(None)
                    continue
                out.append(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            grads = tuple(out)
        return (None, *grads)


@torch.no_grad()
def sum_sp_replicated_grads(
    params: list[torch.Tensor], grads: list[torch.Tensor | None], group: ProcessGroup | None
) -> None:
    """Sum the accumulated gradients ``grads`` of ``params`` over ``group`` in place, in fp32, with one all-reduce:
    the once-per-step form of ``sync_grads``.  A missing gradient takes part as zeros of its parameter's size, so
    every rank of the group sends the same layout."""
    if group_size(group) == 1 or not params:
        return
    device = params[0].device
    flat = torch.cat(
        [
            g.reshape(-1).float() if g is not None else torch.zeros(p.numel(), device=device)
            for p, g in zip(params, grads)
        ]
    )
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        if g is not None:
            g.copy_(flat[offset : offset + p.numel()].view_as(g))
        offset += p.numel()


def sync_grads(group: ProcessGroup | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Identity on the values; sums the tensors' gradients over ``group`` in backward (one all-reduce)."""
    if group_size(group) == 1:
        return tensors
    return _SyncGrads.apply(group, *tensors)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f (identity / all-reduce)."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g (all-reduce / identity)."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def reduce_from_tp_(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g in place on a fresh, contiguous intermediate (saves one full copy per row-parallel layer)."""
    if group_size(group) == 1:
        return x
    if not x.is_contiguous():
        return _ReduceFromTP.apply(x, group)
    return _ReduceFromTPInPlace.apply(x, group)


def gather_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[s/t, b, h] -> [s, b, h] (all-gather / reduce-scatter)."""
    return x if group_size(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """partial [s, b, h] -> summed [s/t, b, h] (reduce-scatter / all-gather)."""
    return x if group_size(group) == 1 else _ReduceScatterSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """replicated [s, b, h] -> [s/t, b, h] (split / all-gather)."""
    return x if group_size(group) == 1 else _ScatterSeq.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[..., n/t] -> [..., n] (all-gather / split)."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)
