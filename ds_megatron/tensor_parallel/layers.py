"""Megatron tensor-parallel layers.  Each is built from the full single-device module by slicing (its constructor
takes the module), so a sharded model starts from exactly the single-device weights.

Parameter marks (read by DeepSpeed and by ds_megatron):
- ``tensor_model_parallel`` / ``model_parallel`` = True on TP-sharded weights, so DeepSpeed's gradient norm counts
  them on every TP rank; replicated parameters are left unmarked and counted on TP rank 0 only.
- ``sequence_parallel_replicated`` = True on replicated parameters that see only a sequence shard under SP
  (norms, row-parallel biases, position embedding): their gradients are summed over the TP group (DeepSpeed knows
  nothing of it; without the sum the TP ranks' copies drift apart).  The layers holding them derive from
  :class:`SPReplicatedGrads`, which owns the mark and when the sum runs.

Every layer takes the TP group as one ``topology.Group`` (process group, this rank, size).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ds_megatron.model.layers import RMSNorm, rms_norm
from ds_megatron.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_loss
from ds_megatron.tensor_parallel.mappings import (
    _all_gather_dim0,
    all_gather_dim0_async,
    all_reduce_async,
    group_size,
    reduce_from_tp_,
    reduce_scatter_dim0_async,
    reduce_scatter_seq,
    sync_grads,
)
from ds_megatron.tensor_parallel.sharding import ShardRule, shard
from ds_megatron.tensor_parallel.weight_grad import DeferrableWeightGrads, WeightGradQueue
from ds_megatron.topology import Group


def mark_tp_sharded(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.model_parallel = True
    param.partition_dim = partition_dim


def mark_sp_replicated(param: nn.Parameter) -> None:
    param.sequence_parallel_replicated = True


class SPReplicatedGrads:
    """Mixin of the layers whose parameters (marked by :func:`mark_sp_replicated`) are replicated over TP but see only
    a sequence shard under SP, so their gradients are summed over the TP group.  ``sync_grads_in_backward`` True
    (the default): in autograd, per micro-batch, which is correct on its own; :func:`defer_sp_grad_sync` sets it
    False when the engine sums every SP-replicated gradient once per optimizer step (``sum_sp_replicated_grads``)."""

    sync_grads_in_backward = True
    tp: Group

    def sp_synced(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``params``, with their gradients summed over TP in backward unless the engine sums them per step."""
        return sync_grads(self.tp.group, *params) if self.sync_grads_in_backward else params


def defer_sp_grad_sync(module: nn.Module) -> None:
    """Switch off the per-micro-batch sum of every SP-replicated gradient in ``module``: the caller sums them once
    per optimizer step."""
    for m in module.modules():
        if isinstance(m, SPReplicatedGrads):
            m.sync_grads_in_backward = False


def is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _weight_and_bias_grads(grad_out: torch.Tensor, x: torch.Tensor, has_bias: bool):
    """dW = dY^T X and db = sum dY over the tokens, for Y = X W^T + b with any leading dims."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    grad_weight = g2.t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_weight, (g2.sum(0) if has_bias else None)


def _defer_linear(
    queue: WeightGradQueue, weight: torch.Tensor, bias: torch.Tensor | None, grad_out: torch.Tensor, x: torch.Tensor
) -> None:
    """Queue dW and db of one linear: keeps its (full, under SP) input ``x`` and output gradient until W runs."""
    queue.defer((weight, bias), lambda: _weight_and_bias_grads(grad_out, x, bias is not None))


class _ColumnLinear(torch.autograd.Function):
    """Y = X A^T + b with X replicated over the TP group (f: identity forward, all-reduce of dX backward).

    Backward starts the all-reduce of dX as soon as dX exists and computes dA and db while it runs.  With a
    ``queue`` (deferred weight gradients; also used with no group, as a plain linear), dA and db are queued instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, queue=None):
        ctx.group, ctx.has_bias, ctx.queue = group, bias is not None, queue
        ctx.bias = bias if queue is not None else None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in = all_reduce_async(grad_out.matmul(weight), ctx.group)
        if ctx.queue is not None:
            _defer_linear(ctx.queue, weight, ctx.bias, grad_out, x)
            return grad_in.wait(), None, None, None, None
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, x, ctx.has_bias)
        return grad_in.wait(), grad_weight, grad_bias, None, None


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """All-gather the sequence shard, then Y = X A^T + b.  Only the shard [s/t, b, in] is saved: backward gathers it
    again for the weight gradient and reduce-scatters the input gradient (Korthikanti et al. 2022, sec. 4.2.2), so
    under SP the inputs of QKV, fc1 and the output layer are stored once per TP group, not t times.

    Backward overlaps both collectives with compute: the all-gather of X runs while dX = dY A is computed, and the
    reduce-scatter of dX runs while dA = dY^T X is computed.  With a ``queue`` (deferred weight gradients), dA and db
    are queued with the gathered input, which stays alive until W runs (gathering it again there would put a TP
    collective into W)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, queue=None):
        ctx.group, ctx.has_bias, ctx.queue = group, bias is not None, queue
        ctx.bias = bias if queue is not None else None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather_dim0(x_shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        gathering = all_gather_dim0_async(x_shard, ctx.group)
        grad_full = grad_out.matmul(weight)  # [s, b, in]
        x_full = gathering.wait()  # [s, b, in]
        grad_in = reduce_scatter_dim0_async(grad_full, ctx.group)
        if ctx.queue is not None:
            _defer_linear(ctx.queue, weight, ctx.bias, grad_out, x_full)
            return grad_in.wait(), None, None, None, None
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, x_full, ctx.has_bias)
        return grad_in.wait(), grad_weight, grad_bias, None, None


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup | None,
    sequence_parallel: bool,
    queue: WeightGradQueue | None = None,
) -> torch.Tensor:
    """Column-parallel matmul: input replicated (f) or, under SP, a sequence shard gathered on the fly; with a
    ``queue``, its weight gradients are deferred (also with one rank)."""
    if queue is not None:
        if sequence_parallel and group_size(group) > 1:
            return _SequenceParallelColumnLinear.apply(x, weight, bias, group, queue)
        return _ColumnLinear.apply(x, weight, bias, group, queue)
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    if sequence_parallel:
        return _SequenceParallelColumnLinear.apply(x, weight, bias, group)
    return _ColumnLinear.apply(x, weight, bias, group)


class _GroupedColumnLinear(torch.autograd.Function):
    """Y_i = X A_i^T for several bias-free weights that share one input (q|k|v, gate|up): one f (identity /
    all-reduce) or, under SP, one all-gather / reduce-scatter for all of them instead of one per weight, and the
    input (its sequence shard under SP) saved once.  Backward overlaps the collectives with compute as the
    single-weight functions do.  With a ``queue`` (deferred weight gradients), the weight gradients are queued with
    the (gathered) input."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, queue, *weights):
        ctx.group, ctx.sp, ctx.queue = group, sequence_parallel, queue
        ctx.save_for_backward(x, *weights)
        full = _all_gather_dim0(x, group) if sequence_parallel else x
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        gathering = all_gather_dim0_async(x, ctx.group) if ctx.sp else None
        grad_full = grads[0].matmul(weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            grad_full.add_(g.matmul(w))
        x_full = gathering.wait() if gathering is not None else x
        if ctx.sp:
            grad_in = reduce_scatter_dim0_async(grad_full, ctx.group)
        else:
            grad_in = all_reduce_async(grad_full, ctx.group)
        if ctx.queue is not None:
            for g, w in zip(grads, weights):
                _defer_linear(ctx.queue, w, None, g, x_full)
            return grad_in.wait(), None, None, None, *(None for _ in weights)
        grad_weights = [_weight_and_bias_grads(g, x_full, False)[0] for g in grads]
        return grad_in.wait(), None, None, None, *grad_weights


def grouped_column_linear(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    group: ProcessGroup | None,
    sequence_parallel: bool,
    queue: WeightGradQueue | None = None,
) -> tuple[torch.Tensor, ...]:
    """Several column-parallel, bias-free matmuls of one input (replicated, or a sequence shard under SP); with a
    ``queue``, their weight gradients are deferred."""
    if group_size(group) == 1 and queue is None:
        return tuple(F.linear(x, w) for w in weights)
    return _GroupedColumnLinear.apply(x, group, sequence_parallel and group_size(group) > 1, queue, *weights)


class ColumnParallelLinear(DeferrableWeightGrads, nn.Module):
    """Y = X A^T with A split along its output dim: each rank computes Y[..., out/t].

    Input: [s, b, in] replicated (f: identity / all-reduce), or [s/t, b, in] under SP (all-gather / reduce-scatter).
    Output: [s, b, out/t].
    """

    def __init__(self, linear: nn.Linear, rule: ShardRule, tp: Group, sequence_parallel: bool = False):
        """This rank's part of the full ``linear``, cut by ``rule`` (output dim; fused blocks by heads)."""
        super().__init__()
        self.weight = nn.Parameter(shard(linear.weight.data, rule, tp.rank, tp.size))
        bias = linear.bias
        self.bias = nn.Parameter(shard(bias.data, rule, tp.rank, tp.size)) if bias is not None else None
        mark_tp_sharded(self.weight, 0)
        if self.bias is not None:
            mark_tp_sharded(self.bias, 0)
        self.full_shape = tuple(linear.weight.shape)
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, self.tp.group, self.sequence_parallel, self.weight_grad_queue)

    def extra_repr(self) -> str:
        return (
            f"full={self.full_shape[1]}->{self.full_shape[0]}, local_out={self.weight.shape[0]}, "
            f"tp_rank={self.tp.rank}/{self.tp.size}, sp={self.sequence_parallel}"
        )


class RowParallelLinear(DeferrableWeightGrads, SPReplicatedGrads, nn.Module):
    """Y = X A^T with A split along its input dim; partial sums are reduced across the TP group.

    Input: [s, b, in/t].  Output: [s, b, out] (g: all-reduce / identity), or [s/t, b, out] under SP
    (reduce-scatter / all-gather).  The bias is replicated and added after the reduction (SP-replicated under SP).
    """

    def __init__(self, linear: nn.Linear, tp: Group, sequence_parallel: bool = False):
        """This rank's part of the full ``linear`` (input dim), with the whole bias."""
        super().__init__()
        self.weight = nn.Parameter(shard(linear.weight.data, ShardRule(dim=1), tp.rank, tp.size))
        self.bias = nn.Parameter(linear.bias.data.clone()) if linear.bias is not None else None
        mark_tp_sharded(self.weight, 1)
        if self.bias is not None and sequence_parallel:
            mark_sp_replicated(self.bias)
        self.full_shape = tuple(linear.weight.shape)
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queue = self.weight_grad_queue
        y = F.linear(x, self.weight) if queue is None else _ColumnLinear.apply(x, self.weight, None, None, queue)
        if not self.sequence_parallel:
            y = reduce_from_tp_(y, self.tp.group)  # y is F.linear's fresh output
            return y + self.bias if self.bias is not None else y
        y = reduce_scatter_seq(y, self.tp.group)
        return y if self.bias is None else y + self.sp_synced(self.bias)[0]

    def extra_repr(self) -> str:
        return (
            f"full={self.full_shape[1]}->{self.full_shape[0]}, local_in={self.weight.shape[1]}, "
            f"tp_rank={self.tp.rank}/{self.tp.size}, sp={self.sequence_parallel}"
        )


class _DeferredEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient (the whole of its backward: ids need none) is queued;
    W computes it with the kernel autograd's embedding backward uses (dense, no padding index, no scaling)."""

    @staticmethod
    def forward(ctx, ids, weight, queue):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.queue = weight, queue
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        rows = ctx.weight.shape[0]
        ctx.queue.defer(
            (ctx.weight,), lambda: (torch.ops.aten.embedding_dense_backward(grad_out, ids, rows, -1, False),)
        )
        return None, None, None


class VocabParallelEmbedding(DeferrableWeightGrads, nn.Module):
    """Embedding table [V_pad, h] split into contiguous vocabulary blocks of V_pad/t rows.

    Input ids [s, b] (any shape; under SP dim 0 must be the sequence).  Each rank looks up the ids in its block
    and zeroes the others; the partial results are summed: all-reduce -> [s, b, h], or reduce-scatter under SP ->
    [s/t, b, h].  Padding rows (ids >= vocab_size) are zero and never looked up.
    """

    def __init__(self, emb: nn.Module, padded_size: int, tp: Group, sequence_parallel: bool = False):
        """This rank's vocabulary block of the full table ``emb.weight`` [V, h], padded to ``padded_size`` rows."""
        super().__init__()
        self.weight = nn.Parameter(shard(emb.weight.data, ShardRule(dim=0, padded_size=padded_size), tp.rank, tp.size))
        mark_tp_sharded(self.weight, 0)
        self.vocab_size, self.padded_size = emb.weight.shape[0], padded_size
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.vocab_start = tp.rank * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        queue = self.weight_grad_queue
        out = F.embedding(local, self.weight) if queue is None else _DeferredEmbedding.apply(local, self.weight, queue)
        out = out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp.group) if self.sequence_parallel else reduce_from_tp_(out, self.tp.group)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Tied output layer: [s(/t), b, h] -> this rank's vocabulary block of logits [s, b, V_pad/t].

        Under SP the input is all-gathered along the sequence first (column-parallel in the vocabulary).
        Padding columns are set to -inf, so they can never be predicted and get zero gradient.
        """
        return vocab_parallel_logits(
            x,
            self.weight,
            self.vocab_start,
            self.vocab_size,
            self.tp.group,
            self.sequence_parallel,
            self.weight_grad_queue,
        )

    def fused_loss(
        self, x: torch.Tensor, target: torch.Tensor, chunk: int | None = None, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tied output layer and the mean cross entropy together, in chunks of tokens: [s(/t), b, h] and target
        [s, b] -> fp32 scalar, equal to the mean of the vocab-parallel cross entropy of :meth:`logits` without ever
        holding the logits [s, b, V_pad/t] (``tensor_parallel.fused_cross_entropy``).  ``weight``: a view of this
        layer's weight to compute with (default the weight itself); its gradient reaches the weight through it."""
        return fused_vocab_parallel_loss(
            x,
            self.weight if weight is None else weight,
            target,
            self.tp.group,
            self.vocab_start,
            self.vocab_size,
            self.sequence_parallel,
            self.weight_grad_queue,
            chunk,
            self.weight,
        )

    def extra_repr(self) -> str:
        return (
            f"vocab={self.vocab_size} (padded {self.padded_size}), rows=[{self.vocab_start}, {self.vocab_end}), "
            f"tp_rank={self.tp.rank}/{self.tp.size}, sp={self.sequence_parallel}"
        )


def vocab_parallel_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: ProcessGroup | None,
    sequence_parallel: bool,
    queue: WeightGradQueue | None = None,
) -> torch.Tensor:
    """[s(/t), b, h] x this rank's rows [V_pad/t, h] of the output table -> its block of logits [s, b, V_pad/t];
    columns past the real vocabulary (padding) are -inf, so they are never predicted and get zero gradient."""
    logits = column_linear(x, weight, None, group, sequence_parallel, queue)
    vocab_end = vocab_start + weight.shape[0]
    if vocab_end > vocab_size:
        cols = torch.arange(vocab_start, vocab_end, device=logits.device)
        logits.masked_fill_(cols >= vocab_size, float("-inf"))  # in place: the matmul's fresh output
    return logits


class VocabParallelOutput(VocabParallelEmbedding):
    """An untied output layer [V, h] (``nn.Linear``'s weight), split and padded exactly like the embedding table:
    column-parallel in the vocabulary, input replicated or (SP) a sequence shard gathered on the fly.
    Output: this rank's block of logits [s, b, V_pad/t] for the vocab-parallel cross entropy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)


class SequenceShardedPositionEmbedding(SPReplicatedGrads, nn.Module):
    """Learned position table, replicated; under SP each rank returns the rows of its own sequence chunk only
    (positions [r s/t, (r+1) s/t)), so the full sequence is embedded exactly once (not split twice)."""

    def __init__(self, weight: torch.Tensor, tp: Group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        mark_sp_replicated(self.weight)
        self.tp = tp

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids [s] -> [s/t, h]; the table's gradient is summed over the TP group."""
        chunk = position_ids.chunk(self.tp.size, dim=0)[self.tp.rank]
        return F.embedding(chunk, self.sp_synced(self.weight)[0])


class SequenceParallelLayerNorm(SPReplicatedGrads, nn.LayerNorm):
    """LayerNorm on a sequence shard [s/t, b, h]; weight and bias gradients are summed over the TP group."""

    def __init__(self, ln: nn.LayerNorm, tp: Group):
        super().__init__(ln.normalized_shape, eps=ln.eps, device=ln.weight.device, dtype=ln.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(ln.weight)
            self.bias.copy_(ln.bias)
        mark_sp_replicated(self.weight)
        mark_sp_replicated(self.bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.sp_synced(self.weight, self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(SPReplicatedGrads, RMSNorm):
    """RMSNorm on a sequence shard [s/t, b, h]; its weight gradient is summed over the TP group."""

    def __init__(self, norm: RMSNorm, tp: Group):
        super().__init__(norm.weight.shape[0], norm.eps)
        with torch.no_grad():
            self.weight.data = norm.weight.data.clone()
        mark_sp_replicated(self.weight)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.sp_synced(self.weight)[0], self.eps, self.kernels)


class ForkedDropout(nn.Dropout):
    """Dropout run inside an RNG state chosen by the plan (the tensor-parallel state where masks must differ
    across TP ranks: sequence-sharded regions under SP)."""

    def __init__(self, p: float, rng_fork: Callable[[], ContextManager]):
        super().__init__(p)
        self.rng_fork = rng_fork

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng_fork():
            return super().forward(x)
