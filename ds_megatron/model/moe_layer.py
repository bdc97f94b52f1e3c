"""The routed mixture-of-experts MLP of the MoE families, single device (``expert_parallel.layer`` splits its experts
over ranks and reuses :meth:`Experts.grouped_mlp` and :func:`weighted_sum`).  Torch only, no torch.distributed.

Layout (transformers 5's ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock``, so the HF key map is the identity):
``gate.weight`` [E, h], the router; ``experts.gate_up_proj`` [E, 2F, h] (each expert's gate rows, then its up rows)
and ``experts.down_proj`` [E, h, F].  The published checkpoints store one linear per expert instead (Qwen3-MoE:
``mlp.experts.<e>.{gate,up,down}_proj.weight``; Mixtral: ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` with the
router at ``block_sparse_moe.gate.weight``): transformers stacks them on load (gate_up = cat(gate, up) per expert).

Routing (Shazeer et al. 2017; Mixtral; Qwen3): logits = x W_r^T in fp32 (the router always runs in fp32, whatever
the activations' dtype: a bf16 router flips top-k choices between near-tied experts), p = softmax(logits), the k
largest p_e per token, renormalised to sum 1 when ``norm_topk_prob``.  Dropless by default: every token reaches its
k experts.  With a capacity factor c (``moe_capacity_factor`` > 0, training mode only) each expert takes at most
C = ceil(c n k / E) of the n k pairs a layer routes in one call (a rank's tokens of a micro-batch: its sequence
shard under SP or CP), the pairs with the largest router probability kept (ties by token order); a dropped pair
contributes nothing (its token keeps the residual) and leaves the load statistics, which count the router's
choices, as they were.  Evaluation and generation stay dropless, as transformers' model is.
The n k (token, expert) pairs are sorted by expert (stable, so each expert sees its tokens in order), run through
each expert's SwiGLU MLP as one grouped GEMM per projection, scaled by their routing weight and summed back per token.
An expert that gets no token is an empty group: its slice of the gradient is zero, and present, because the experts
are two stacked tensors.

Grouped GEMM vs a loop of per-expert GEMMs (forward + backward of one layer, CPU time, one thread, median of 5;
``benchmarks/moe_gemm.py``, table in ``benchmarks/results/moe_gemm.md``): see :data:`GEMM_DEFAULT`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ds_megatron.model.family import check_experts_per_token
from ds_megatron.model.layers import SINGLE_DEVICE, BlockHooks

# "grouped" (torch._grouped_mm, one kernel per projection over all experts) or "loop" (one GEMM per expert with
# tokens; needs each expert's token count on the host).  The grouped GEMM is the default: it was the faster of the
# two at every shape and dtype of benchmarks/results/moe_gemm.md and needs no host sync of the per-expert counts; the
# loop stays for operands torch._grouped_mm refuses (rows not a multiple of 16 bytes).  On CUDA (read, not run here)
# torch._grouped_mm's CUTLASS kernel takes bf16 on compute capability 9.0 and later; other dtypes and GPUs take
# torch's fallback, itself a loop after copying the offsets to the host.
GEMM_DEFAULT = "grouped"
GEMM_KINDS = ("grouped", "loop")
GROUPED_ALIGN_BYTES = 16  # torch._grouped_mm's stride rule (CUDA's, enforced on CPU too): rows of 16-byte multiples


class RouterStats(NamedTuple):
    """One layer's (or several layers' summed) routing statistics, what the auxiliary losses need.  Additive: the
    statistics of all MoE layers are summed before the losses, as transformers' ``load_balancing_loss_func`` sums
    over layers before normalising (so the loss is not a mean of per-layer losses).

    counts     [E] fp32, no gradient: (token, expert) assignments per expert (k per token)
    probs      [E] fp32: the router probabilities summed over tokens (the loss's gradient flows through these)
    rows       [] fp32: tokens routed (summed over layers, as transformers' ``total_rows``)
    z          [] fp32: sum over tokens of logsumexp(logits)^2 (the router z-loss, Zoph et al. 2022, eq. 5)
    """

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor
    z: torch.Tensor

    def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
        return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))

    @staticmethod
    def packed_size(num_experts: int) -> int:
        """Elements of :meth:`pack`'s tensor: counts and probabilities per expert, rows, z."""
        return 2 * num_experts + 2

    def pack(self) -> torch.Tensor:
        """One fp32 tensor [2 E + 2] (counts | probs | rows | z), what crosses a pipeline stage boundary (the
        gradient flows back through the probabilities and z)."""
        return torch.cat([self.counts.float(), self.probs.float(), self.rows.reshape(1).float(), self.z.reshape(1)])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> RouterStats:
        """The inverse of :meth:`pack` (views of ``packed``)."""
        e = (packed.numel() - 2) // 2
        return cls(packed[:e].detach(), packed[e : 2 * e], packed[2 * e].detach(), packed[2 * e + 1])


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6) as transformers computes it over the layers:
    E * sum_e f_e P_e, f_e = counts_e / rows (fraction of assignments; sums to k), P_e = probs_e / rows."""
    num_experts = stats.counts.numel()
    return num_experts * torch.sum((stats.counts / stats.rows) * (stats.probs / stats.rows))


def router_z_loss(stats: RouterStats) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over routed tokens (and layers) of logsumexp(logits)^2."""
    return stats.z / stats.rows


class TopKRouter(nn.Module):
    """logits = x W^T in fp32 -> softmax -> top k, renormalised when ``norm_topk_prob``; in training mode with
    ``capacity_factor`` > 0, the pairs over an expert's capacity dropped (:func:`drop_over_capacity`)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool, capacity_factor: float = 0.0
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """x [n, h] -> routing weights [n, k] fp32, experts [n, k] int64 (E for a dropped pair), the statistics."""
        return self.route(x, self.weight)

    def route(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """:meth:`forward` with the router weight given (the sequence-parallel router's, its gradient synced)."""
        logits = F.linear(x.float(), weight.float())  # [n, E] fp32
        probs = torch.softmax(logits, dim=-1)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True) if self.norm_topk_prob else top
        num_experts = logits.shape[-1]
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
        rows = torch.tensor(float(x.shape[0]), device=x.device)
        z = torch.logsumexp(logits, dim=-1).square().sum()
        if self.capacity_factor and self.training:
            weights, experts = drop_over_capacity(top.detach(), weights, experts, num_experts, self.capacity_factor)
        return weights, experts, RouterStats(counts, probs.sum(0), rows, z)


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Pairs one expert takes from ``tokens`` routed tokens at capacity factor ``factor``: ceil(c n k / E)."""
    return math.ceil(factor * tokens * top_k / num_experts)


@torch.no_grad()
def _kept(probs: torch.Tensor, experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[n k] bool: each expert's ``capacity`` pairs of the largest router probability (ties: the earlier pair)."""
    flat = experts.reshape(-1)
    by_prob = torch.argsort(probs.reshape(-1), descending=True, stable=True)
    by_expert = by_prob[torch.argsort(flat[by_prob], stable=True)]  # by expert, each expert's by falling probability
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(flat)
    place[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
    return place < capacity


def drop_over_capacity(
    probs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with each expert's pairs beyond its capacity dropped: probs, weights [n, k] fp32 and experts
    [n, k] -> weights with the dropped pairs' set to 0, experts with theirs set to ``num_experts`` (no expert: the
    pair sorts after every expert's and is left out by :func:`pairs_by_expert`)."""
    n, k = experts.shape
    keep = _kept(probs, experts, num_experts, expert_capacity(n, k, num_experts, factor)).view(n, k)
    return weights * keep, torch.where(keep, experts, num_experts)


def pairs_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [n, k] -> (the kept pairs' indices sorted by expert (stable: each expert sees its tokens in order),
    rows per expert [E] int64).  Pairs dropped by the capacity (expert id E) are left out."""
    flat = experts.reshape(-1)  # [n k] pair i is token i // k's j = i % k choice
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=num_experts)
    if per_expert.numel() > num_experts:  # dropped pairs present: they sorted last
        order = order[: int(per_expert[:num_experts].sum())]
        per_expert = per_expert[:num_experts]
    return order, per_expert


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward refuses the expanded
    (stride 0) gradients that e.g. ``sum()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None):
    """x [m, in] (rows sorted by group), weight [G, out, in], ``offsets`` [G] int32 end row of each group ->
    [m, out], group g's rows times weight[g]^T.  ``counts`` (host ints) selects the loop of per-group GEMMs."""
    if counts is None:
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))
    parts = [F.linear(rows, weight[g]) for g, rows in enumerate(x.split(counts)) if counts[g]]
    # no row at all (an expert-parallel rank that received none): an empty output still in the graph, so that its
    # backward runs and the all-to-all of its gradients meets the other ranks' (a detached one left them waiting)
    return torch.cat(parts) if parts else F.linear(x, weight[0])


def grouped_mm_fits(*tensors: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: each row a multiple of 16 bytes."""
    return all(t.shape[-1] * t.element_size() % GROUPED_ALIGN_BYTES == 0 for t in tensors)


class Experts(nn.Module):
    """E SwiGLU MLPs stored as two stacked tensors (transformers' names and layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, gemm: str = GEMM_DEFAULT):
        super().__init__()
        if gemm not in GEMM_KINDS:
            raise ValueError(f"error: moe gemm={gemm!r} is not one of {GEMM_KINDS}; use one of them")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gemm = gemm

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, h], routing weights [n, k] fp32 and experts [n, k] -> [n, h]: sum_j weights[t, j] MLP_e(x_t)."""
        return expert_mlp(x, weights, experts, self.gate_up_proj, self.down_proj, self.gemm)

    def grouped_mlp(self, routed: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """routed [m, h], rows grouped by expert (``per_expert`` [E] int64 rows each) -> [m, h], each row through
        its expert's SwiGLU MLP."""
        return grouped_mlp(routed, per_expert, self.gate_up_proj, self.down_proj, self.gemm)


def grouped_mlp(
    routed: torch.Tensor,
    per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gemm: str,
    host_counts: list[int] | None = None,
) -> torch.Tensor:
    """Rows grouped by expert (``per_expert`` [E] int64 rows each) through their expert's SwiGLU MLP:
    ``gate_up_proj`` [E, 2F, h], ``down_proj`` [E, h, F] (F: all of each expert's width, or a TP rank's slice of it,
    whose output is then a partial sum).  ``host_counts``: ``per_expert`` as host ints when the caller has them (the
    loop of per-expert GEMMs then copies nothing to the host)."""
    grouped = gemm == "grouped" and grouped_mm_fits(routed, gate_up_proj, down_proj)
    counts = None if grouped else host_counts if host_counts is not None else per_expert.tolist()
    offsets = torch.cumsum(per_expert, 0).to(torch.int32)
    gate, up = grouped_linear(routed, gate_up_proj, offsets, counts).chunk(2, dim=-1)
    return grouped_linear((F.silu(gate) * up).contiguous(), down_proj, offsets, counts)


def expert_mlp(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gemm: str = GEMM_DEFAULT,
) -> torch.Tensor:
    """The experts' SwiGLU MLPs on the tokens routed to them, weighted and summed per token: x [n, h], routing
    weights [n, k] fp32, experts [n, k] -> [n, h] in x's dtype (``grouped_mlp``'s weights)."""
    n, k = experts.shape
    order, per_expert = pairs_by_expert(experts, gate_up_proj.shape[0])
    token = order // k
    out = grouped_mlp(x[token], per_expert, gate_up_proj, down_proj, gemm)  # [n k, h], grouped by expert
    return weighted_sum(out, weights.reshape(-1)[order], token, n)


def weighted_sum(out: torch.Tensor, weights: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
    """Expert outputs [m, h] (pair i belongs to token ``token[i]``; m = n k, less the dropped pairs), routing weights
    [m] fp32 -> [n, h]: each token's weighted sum over its (kept) experts, accumulated in fp32, in ``out``'s dtype
    (:class:`_WeightedSum`: what autograd keeps for it)."""
    return _WeightedSum.apply(out, weights, token, n)


class _WeightedSum(torch.autograd.Function):
    """The combine, ``zeros(n, h).index_add(0, token, out.float() * weights[:, None]).to(out.dtype)``, keeping for
    backward only ``out`` in its own dtype, the weights and the token index; autograd on those operations would
    keep two fp32 [m, h] tensors instead (``out.float()`` for the weights' gradient, the weighted product as
    ``index_add``'s source, whose backward needs only its shape).  Backward runs the operations autograd would (the
    fp32 output gradient gathered per pair, times the weights for ``out``'s, times ``out`` in fp32 and summed over h
    for the weights'), so results are the same bits: ``out``'s fp32 copy is exact whatever its dtype."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, weights: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
        scaled = out.float() * weights[:, None]
        combined = torch.zeros(n, out.shape[-1], dtype=torch.float32, device=out.device).index_add(0, token, scaled)
        ctx.dtype = out.dtype
        ctx.save_for_backward(out if ctx.needs_input_grad[1] else None, weights, token)
        return combined.to(out.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, weights, token = ctx.saved_tensors
        grad_pairs = grad.float().index_select(0, token)  # [m, h] fp32
        grad_out = (grad_pairs * weights[:, None]).to(ctx.dtype) if ctx.needs_input_grad[0] else None
        grad_weights = (grad_pairs * out.float()).sum(-1) if ctx.needs_input_grad[1] else None
        return grad_out, grad_weights, None, None


def shared_expert_gate(hidden_size: int) -> nn.Linear:
    """The shared expert's gate, transformers' ``shared_expert_gate``: h -> 1, no bias."""
    return nn.Linear(hidden_size, 1, bias=False)


class SparseMoeBlock(nn.Module):
    """The routed MLP: ``gate`` (the router) and ``experts``; with ``shared_expert`` (a dense MLP module, called as
    ``shared_expert(x, hooks)``) also Qwen2-MoE's shared expert and its sigmoid gate ``shared_expert_gate``, added
    to the routed output.  Returns its output and the layer's router stats."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        gemm: str = GEMM_DEFAULT,
        capacity_factor: float = 0.0,
        shared_expert: nn.Module | None = None,
    ):
        super().__init__()
        check_experts_per_token(top_k, num_experts)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, capacity_factor)
        self.experts = Experts(hidden_size, intermediate_size, num_experts, gemm)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = shared_expert_gate(hidden_size)

    def forward(self, x: torch.Tensor, hooks: BlockHooks = SINGLE_DEVICE) -> tuple[torch.Tensor, RouterStats]:
        """x [..., h] -> [..., h] and the layer's statistics (over all tokens of x); ``hooks``: the block's (what TP
        changes in the shared expert's projections)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts, stats = self.gate(flat)
        out = self.experts(flat, weights, experts).view_as(x)
        return with_shared_expert(self, out, x, hooks), stats


def with_shared_expert(moe: nn.Module, routed: torch.Tensor, x: torch.Tensor, hooks: BlockHooks) -> torch.Tensor:
    """``routed`` plus, when ``moe`` has a shared expert (Qwen2-MoE), ``sigmoid(x w_g) * shared_expert(x)``:
    x [s(/t), b, h], the same tokens the router saw.  Under TP the shared expert is split as the dense MLP is
    (column / row parallel, its input gathered and its output reduce-scattered under SP) and the gate is replicated
    on the sequence shard, so both act on this rank's tokens whatever the routed experts do (an expert-parallel
    layer dispatches only the routed pairs)."""
    shared = shared_expert_output(moe, x, hooks)
    return routed if shared is None else routed + shared


def shared_expert_output(moe: nn.Module, x: torch.Tensor, hooks: BlockHooks) -> torch.Tensor | None:
    """``sigmoid(x w_g) * shared_expert(x)`` when ``moe`` has a shared expert, else None (:func:`with_shared_expert`;
    the overlapped expert-parallel layer runs it while its dispatch is in flight)."""
    if not hasattr(moe, "shared_expert"):
        return None
    return torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x, hooks)
