"""The expert-parallel routed MLP, and the gradient rule of its expert parameters.

:class:`ExpertParallelMoE` is ``model.moe_layer.SparseMoeBlock`` with its experts split over an EP group: same
parameter names, same router, same per-expert SwiGLU and grouped GEMM, same fp32 weighting of the outputs, so it
computes what the single-device block computes on the union of the EP ranks' tokens.  Parameters on EP rank i:

    gate.weight             [E, h]        the whole router, on every EP rank (a non-expert parameter)
    experts.gate_up_proj    [E/ep, 2F, h] global experts i E/ep .. (i + 1) E/ep - 1: the single-device tensor's
    experts.down_proj       [E/ep, h, F]  slice along dim 0 (the shard rule: dim 0 split over ep)
    shared_expert.*, shared_expert_gate.weight   Qwen2-MoE's shared expert, when the block has one: not an expert
                            parameter (every rank runs it on its own tokens; TP splits it as the dense MLP)

Each rank routes its own tokens, dispatches the (token, expert) pairs to the experts' owners
(``expert_parallel.dispatch``), runs its local experts on what it received and combines the outputs back.  Selective
recompute of ``moe`` (``recompute``: ``recompute.checkpoint``) checkpoints the local experts' computation on the
dispatched rows: those rows [m, h] are kept, the gate/up outputs, SwiGLU's output and the expert outputs are not, and
backward recomputes them there; the all-to-alls sit outside the checkpoint and are never run again.  The
forward returns the output and this rank's ``RouterStats`` (its own tokens only, as the single-device block returns
them for the tokens it sees): the auxiliary losses equal the single-device ones once the statistics are summed over
the ranks whose tokens make the batch.

Expert parameters are marked the way DeepSpeed marks its own (``allreduce = False`` and ``group_name``), so that
``deepspeed.moe.utils.is_moe_param`` and everything DeepSpeed keys on it (its engine's gradient reduction over the
expert-DP group, ZeRO's and the bf16 optimizer's expert parameter groups, the gradient norm summed over the EP
group) treat them as experts.  :func:`reduce_expert_grads` is the rule itself: a sum over the expert-DP group divided
by dp x cp (``expert_parallel.layout``: why).

Expert tensor parallelism (a ``tp`` group given: ``expert_tp`` = tp): each expert's gate|up rows column-split and
its down columns row-split over tp (``experts.gate_up_proj`` [E/ep, 2F/t, h], ``experts.down_proj`` [E/ep, h, F/t],
the TP shard rule of ``tensor_parallel.experts``).  Each rank routes its own tokens (its sequence shard under SP, so
the statistics count each token once), then the tokens, routing weights and choices enter the TP group as the dense
MLP's do (``tensor_parallel.experts.enter_expert_tp``: all-gather under SP, f without), so every TP rank dispatches
the same pairs over its EP group (ranks of its tp index) and runs its slice of F; the routing weights multiply the
partial outputs, which leave through ``leave_expert_tp`` (reduce-scatter under SP, g without).  Backward, each TP
rank's gradient of the routing weights is its slice's share, summed by the entry's backward before the router.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from torch import nn
from torch.distributed import ProcessGroup

from ds_megatron.expert_parallel.dispatch import combine, dispatch, group_size, plan_dispatch
from ds_megatron.expert_parallel.layout import check_dispatch_chunks, check_num_experts, local_experts
from ds_megatron.expert_parallel.overlap import Exchange, overlapped_experts, plan_chunks
from ds_megatron.model.family import check_experts_per_token
from ds_megatron.model.layers import SINGLE_DEVICE, BlockHooks
from ds_megatron.model.moe_layer import (
    GEMM_DEFAULT,
    Experts,
    RouterStats,
    SparseMoeBlock,
    TopKRouter,
    pairs_by_expert,
    shared_expert_output,
    weighted_sum,
    with_shared_expert,
)
from ds_megatron.tensor_parallel.experts import DOWN_RULE, GATE_UP_RULE, enter_expert_tp, leave_expert_tp
from ds_megatron.tensor_parallel.layers import mark_tp_sharded
from ds_megatron.tensor_parallel.sharding import shard
from ds_megatron.topology import Group


def expert_group_name(ep: int) -> str:
    """The name DeepSpeed gives the expert group of size ``ep`` (``deepspeed.moe.layer.MoE``), kept so that its
    per-group tables (expert-DP groups, optimizer parameter groups) find ours under the same key."""
    return f"ep_size_{ep}"


def mark_expert_params(module: nn.Module, group_name: str) -> None:
    """Mark every parameter of ``module`` as an expert parameter of ``group_name`` (DeepSpeed's attributes)."""
    for param in module.parameters():
        param.allreduce = False
        param.group_name = group_name


@torch.no_grad()
def reduce_expert_grads(module: nn.Module, expert_dp_group: ProcessGroup | None, divisor: int) -> None:
    """The expert gradients of ``module`` summed over ``expert_dp_group`` and divided by ``divisor`` (dp x cp), in
    place; an expert parameter without a gradient gets zeros first (every rank of the group must send one)."""
    params = [p for p in module.parameters() if is_moe_param(p)]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    reduce_expert_grad_tensors([p.grad for p in params], expert_dp_group, divisor)


@torch.no_grad()
def reduce_expert_grad_tensors(grads: list[torch.Tensor], expert_dp_group: ProcessGroup | None, divisor: int) -> None:
    """``grads`` (expert gradients: the parameters' own, or DeepSpeed's BF16 optimizer's flat accumulation buffers of
    the expert parameter groups) summed over ``expert_dp_group`` and divided by ``divisor``, in place.  The sum runs
    in fp32 whatever the gradients' dtype: a bf16 buffer (bf16 accumulation) summed in bf16 would round at every
    hop of the all-reduce; one all-reduce for all of them."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if group_size(expert_dp_group) > 1:
        dist.all_reduce(flat, group=expert_dp_group)
    flat.div_(divisor)
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


class ExpertParallelMoE(nn.Module):
    """The routed MLP with E / ep experts on each rank of the EP group ``ep`` (no group: ep 1, all experts here).
    ``recompute(fn, *inputs)``: runs the local experts keeping only their dispatched rows and recomputes them in
    backward (selective ``moe``); None stores their activations.  ``dispatch_chunks`` C > 1: the exchange in C
    chunks of local experts, overlapped with their compute and with the shared expert (``expert_parallel.overlap``;
    the same results bit for bit); 1: one blocking all-to-all each way.  ``tp`` (a group of more than one: expert
    tensor parallelism) splits each expert's width F over it, with ``sequence_parallel`` the tokens' layout (module
    docstring); either exchange carries the tokens every TP rank runs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        ep: Group,
        gemm: str = GEMM_DEFAULT,
        capacity_factor: float = 0.0,
        recompute: Callable[..., torch.Tensor] | None = None,
        dispatch_chunks: int = 1,
        tp: Group | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        tp = tp if tp is not None else Group()
        check_num_experts(num_experts, ep.size)
        check_dispatch_chunks(dispatch_chunks, ep.size, num_experts)
        check_experts_per_token(top_k, num_experts)
        self.ep = ep
        self.num_experts = num_experts
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, capacity_factor)
        # expert TP: each rank holds F/t of every expert it owns
        self.tp, self.sequence_parallel = tp, sequence_parallel and tp.size > 1
        self.experts = Experts(hidden_size, intermediate_size // tp.size, num_experts // ep.size, gemm)
        if tp.size > 1:
            mark_tp_sharded(self.experts.gate_up_proj, GATE_UP_RULE.dim)
            mark_tp_sharded(self.experts.down_proj, DOWN_RULE.dim)
        mark_expert_params(self.experts, expert_group_name(ep.size))
        self.recompute = recompute
        self.dispatch_chunks = dispatch_chunks

    @classmethod
    def from_block(
        cls,
        block: SparseMoeBlock,
        ep: Group,
        recompute: Callable[..., torch.Tensor] | None = None,
        dispatch_chunks: int = 1,
        tp: Group | None = None,
        sequence_parallel: bool = False,
    ) -> ExpertParallelMoE:
        """This EP rank's layer holding ``block``'s router and its slice of ``block``'s experts (copies; with a
        ``tp`` group, this TP rank's slice of each of them)."""
        num_experts, two_f, hidden_size = block.experts.gate_up_proj.shape
        gate = block.gate
        layer = cls(
            hidden_size, two_f // 2, num_experts, gate.top_k, gate.norm_topk_prob, ep, block.experts.gemm,
            gate.capacity_factor, recompute, dispatch_chunks, tp, sequence_parallel,
        )  # fmt: skip
        layer.to(device=gate.weight.device, dtype=block.experts.gate_up_proj.dtype)
        local, tp = layer.local_experts(), layer.tp
        with torch.no_grad():
            layer.gate.weight.copy_(gate.weight)
            layer.experts.gate_up_proj.copy_(shard(block.experts.gate_up_proj[local], GATE_UP_RULE, tp.rank, tp.size))
            layer.experts.down_proj.copy_(shard(block.experts.down_proj[local], DOWN_RULE, tp.rank, tp.size))
        if hasattr(block, "shared_expert"):  # not an expert parameter: every rank runs it on its own tokens
            layer.shared_expert, layer.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        return layer

    def local_experts(self) -> slice:
        """The global experts this rank holds."""
        return local_experts(self.num_experts, self.ep)

    def forward(self, x: torch.Tensor, hooks: BlockHooks = SINGLE_DEVICE) -> tuple[torch.Tensor, RouterStats]:
        """x [..., h] (this rank's tokens) -> [..., h] and this rank's router statistics.  A shared expert (Qwen2-MoE)
        is not dispatched: it runs here on this rank's tokens (``moe_layer.with_shared_expert``, ``hooks`` the
        block's)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts, stats = self.gate(flat)  # [n, k] fp32, [n, k] global expert ids
        # expert TP: the tokens every TP rank runs (identity without a tp group)
        flat, weights, experts = enter_expert_tp(flat, weights, experts, self.tp.group, self.sequence_parallel)
        n, k = experts.shape
        order, per_expert = pairs_by_expert(experts, self.num_experts)  # by global expert, so by owner
        token = order // k
        if self.dispatch_chunks > 1:  # overlapped (expert_parallel.overlap), the shared expert run meanwhile
            out, shared = self._overlapped(flat[token], per_expert, x, hooks)
            routed = weighted_sum(out, weights.reshape(-1)[order], token, n)
            routed = leave_expert_tp(routed, self.tp.group, self.sequence_parallel).view_as(x)
            return (routed if shared is None else routed + shared), stats
        plan = plan_dispatch(per_expert, self.ep.group)
        received = dispatch(flat[token], plan, self.ep.group)  # [m, h], grouped by local expert
        run = functools.partial(self.experts.grouped_mlp, per_expert=plan.local_counts)
        local = self.recompute(run, received) if self.recompute is not None else run(received)
        out = combine(local, plan, self.ep.group)  # [n k (kept), h]
        routed = weighted_sum(out, weights.reshape(-1)[order], token, n)
        routed = leave_expert_tp(routed, self.tp.group, self.sequence_parallel).view_as(x)  # expert TP: the sum
        return with_shared_expert(self, routed, x, hooks), stats

    def _overlapped(self, rows, per_expert, x, hooks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The expert outputs of ``rows`` (sorted by global expert) through the chunked exchange, and the shared
        expert's output (None without one), run while the dispatch is in flight."""
        plan = plan_chunks(per_expert, self.ep.group, self.dispatch_chunks)
        exchange = Exchange(plan, self.ep.group, self.experts.gemm, self.recompute)
        shared = functools.partial(shared_expert_output, self, x, hooks)
        return overlapped_experts(rows, self.experts.gate_up_proj, self.experts.down_proj, exchange, shared)

    def extra_repr(self) -> str:
        local = self.local_experts()
        return (
            f"ep {self.ep.rank}/{self.ep.size}: experts {local.start}..{local.stop - 1} of {self.num_experts}, "
            + (f"expert_tp {self.tp.rank}/{self.tp.size} (sp={self.sequence_parallel}), " if self.tp.size > 1 else "")
            + f"recompute={self.recompute is not None}, dispatch_chunks={self.dispatch_chunks}"
        )
