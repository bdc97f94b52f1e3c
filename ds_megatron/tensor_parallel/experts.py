"""The routed MLP under tensor, sequence and context parallelism (no expert parallelism: every TP rank holds every
expert, each expert split over TP as the dense MLP is, i.e. expert TP = tp).

- :class:`TensorParallelExperts`: each expert's gate|up rows column-parallel and its down columns row-parallel (the
  F/t slice of every expert on each rank).  Under SP a rank routes only its sequence shard: the shard's tokens, their
  routing weights and their experts are all-gathered over TP (backward: reduce-scatter of the first two), every rank
  runs its slice of every expert on all the tokens, and the partial outputs are reduce-scattered back to the shards
  (backward: all-gather).  Without SP every rank holds all tokens and routes them alike: the tokens and weights
  enter through f (identity / all-reduce), the partial outputs leave through g (all-reduce / identity).  This is
  Megatron's "all-gather" token dispatcher at EP 1.  Selective recompute of ``moe`` checkpoints the local expert
  computation only (the gathered inputs are kept; the collectives are not run again).
- :class:`SequenceParallelRouter`: the router replicated, routing the sequence shard under SP; its gradient summed
  over TP like a norm's.  :class:`SequenceParallelGate`: the same for the shared expert's gate (Qwen2-MoE), whose
  expert is split over TP as the dense MLP is (``model.moe_layer.with_shared_expert``).
- :func:`router_stats_over_tokens`: the routing statistics (counts and probabilities per expert, tokens, z) of the
  whole sequence from each rank's partial ones, so that the load-balancing and z-losses equal the single-device
  values.  Sums over TP under SP (forward all-reduce, backward identity: every TP rank then holds the same loss
  and its own shard's share of the gradient, which the router's TP sum adds up) and over CP (forward all-reduce,
  backward all-reduce: the CP ranks' gradients are averaged with the data-parallel ones, so each carries cp times
  its share).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ds_megatron.model.moe_layer import Experts, RouterStats, TopKRouter, expert_mlp
from ds_megatron.tensor_parallel.layers import SPReplicatedGrads, mark_sp_replicated, mark_tp_sharded
from ds_megatron.tensor_parallel.mappings import (
    _all_reduce,
    copy_to_tp,
    gather_seq,
    group_size,
    reduce_from_tp,
    reduce_scatter_seq,
)
from ds_megatron.tensor_parallel.sharding import ShardRule, shard
from ds_megatron.topology import Group

GATE_UP_RULE = ShardRule(dim=1, fused=2)  # [E, 2F, h]: each expert's gate rows and up rows split alike
DOWN_RULE = ShardRule(dim=2)  # [E, h, F]: each expert's input columns


class TensorParallelExperts(nn.Module):
    """The stacked experts, this rank's F/t slice of each: ``gate_up_proj`` [E, 2F/t, h], ``down_proj``
    [E, h, F/t].  ``recompute(fn, *inputs)``: runs the local expert computation keeping only its inputs and
    recomputes it in backward (selective ``moe``: ``recompute.checkpoint``); None stores its activations."""

    def __init__(
        self,
        experts: Experts,
        tp: Group,
        sequence_parallel: bool = False,
        recompute: Callable[..., torch.Tensor] | None = None,
    ):
        super().__init__()
        self.gate_up_proj = nn.Parameter(shard(experts.gate_up_proj.data, GATE_UP_RULE, tp.rank, tp.size))
        self.down_proj = nn.Parameter(shard(experts.down_proj.data, DOWN_RULE, tp.rank, tp.size))
        if tp.size > 1:
            mark_tp_sharded(self.gate_up_proj, GATE_UP_RULE.dim)
            mark_tp_sharded(self.down_proj, DOWN_RULE.dim)
        self.gemm, self.tp, self.sequence_parallel = experts.gemm, tp, sequence_parallel and tp.size > 1
        self.recompute = recompute

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, h] (this rank's shard of the tokens under SP), routing weights [n, k] fp32, experts [n, k] ->
        [n, h]."""
        x, weights, experts = enter_expert_tp(x, weights, experts, self.tp.group, self.sequence_parallel)
        run = functools.partial(self._local, experts=experts)
        out = self.recompute(run, x, weights) if self.recompute is not None else run(x, weights)
        return leave_expert_tp(out, self.tp.group, self.sequence_parallel)

    def _local(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return expert_mlp(x, weights, experts, self.gate_up_proj, self.down_proj, self.gemm)

    def extra_repr(self) -> str:
        e, f2, h = self.gate_up_proj.shape
        return (
            f"experts={e}, hidden={h}, width={f2 // 2 * self.tp.size} (per rank {f2 // 2}), "
            f"tp_rank={self.tp.rank}/{self.tp.size}, sp={self.sequence_parallel}, "
            f"recompute={self.recompute is not None}"
        )


def enter_expert_tp(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, group: ProcessGroup | None, sequence_parallel: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed tokens into experts split over the TP ``group`` (the dense MLP's entry): x [n, h], routing weights
    [n, k] fp32 and experts [n, k] of this rank's tokens (routed where they live: the router's statistics count each
    token once) -> the same for the tokens every TP rank then runs.  Under SP the sequence shards are all-gathered
    (backward: reduce-scatter, which sums the TP ranks' partial gradients of x and of the routing weights); without
    SP they enter through f (identity / all-reduce of those partial gradients)."""
    if sequence_parallel:
        return gather_seq(x, group), gather_seq(weights, group), gather_seq(experts, group)
    return copy_to_tp(x, group), copy_to_tp(weights, group), experts


def leave_expert_tp(out: torch.Tensor, group: ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """The weighted partial sums [n, h] (each TP rank's slice of F through the row-parallel down projection) back
    to this rank's tokens: reduce-scatter under SP (backward: all-gather), g (all-reduce / identity) without."""
    return reduce_scatter_seq(out, group) if sequence_parallel else reduce_from_tp(out, group)


class SequenceParallelRouter(SPReplicatedGrads, TopKRouter):
    """The router on a sequence shard [n/t, h]: replicated, its weight's gradient summed over the TP group."""

    def __init__(self, router: TopKRouter, tp: Group):
        num_experts, hidden = router.weight.shape
        super().__init__(hidden, num_experts, router.top_k, router.norm_topk_prob, router.capacity_factor)
        with torch.no_grad():
            self.weight.data = router.weight.data.clone()
        mark_sp_replicated(self.weight)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        return self.route(x, self.sp_synced(self.weight)[0])


class SequenceParallelGate(SPReplicatedGrads, nn.Linear):
    """A replicated linear on a sequence shard [s/t, b, in] (the shared expert's gate, h -> 1): its weight's
    gradient summed over the TP group, as the router's."""

    def __init__(self, linear: nn.Linear, tp: Group):
        out_features, in_features = linear.weight.shape
        super().__init__(in_features, out_features, bias=False, device=linear.weight.device, dtype=linear.weight.dtype)
        if linear.bias is not None:
            raise ValueError("SequenceParallelGate: a gate without a bias (transformers' shared_expert_gate)")
        with torch.no_grad():
            self.weight.data = linear.weight.data.clone()
        mark_sp_replicated(self.weight)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.sp_synced(self.weight)[0])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, replicated, tp_rank={self.tp.rank}/{self.tp.size}, sp=True"


class _AllReduceSum(torch.autograd.Function):
    """Forward all-reduce, backward all-reduce (the autograd of a sum over ranks whose losses are all counted)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def router_stats_over_tokens(
    packed: torch.Tensor, tp_group: ProcessGroup | None, cp_group: ProcessGroup | None
) -> torch.Tensor:
    """The packed statistics (``RouterStats.pack``) of all the tokens of the micro-batch from this rank's: summed
    over ``tp_group`` (pass it under SP only: without SP every TP rank routed all the tokens) with identity
    backward, and over ``cp_group`` with all-reduce backward (module docstring)."""
    if group_size(tp_group) > 1:
        packed = reduce_from_tp(packed, tp_group)
    if group_size(cp_group) > 1:
        packed = _AllReduceSum.apply(packed, cp_group)
    return packed


def load_extremes(stats: RouterStats, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and most loaded expert's assignments relative to a perfectly balanced router (1.0: every expert
    gets rows * k / E), over the routed layers' summed statistics."""
    balanced = stats.rows * top_k / stats.counts.numel()
    load = stats.counts / balanced
    return load.min(), load.max()


__all__ = [
    "DOWN_RULE",
    "GATE_UP_RULE",
    "SequenceParallelGate",
    "SequenceParallelRouter",
    "TensorParallelExperts",
    "enter_expert_tp",
    "leave_expert_tp",
    "load_extremes",
    "router_stats_over_tokens",
]
