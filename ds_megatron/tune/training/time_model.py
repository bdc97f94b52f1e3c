"""Predicted time of one optimizer step of a candidate:

    step = slots * t_mb + t_dp + t_tied + overhead

slots is the pipeline schedule's critical path in micro-batches (``schedule_slots``): m + p - 1 under 1F1B.

t_mb is one micro-batch's forward and backward on the slowest stage: its matmuls (``tune.core.matmuls``), the eager
kernel's memory-bound score passes, the elementwise passes selective recompute runs again, the TP collectives (ring
model: latency + volume / bandwidth), the pipeline sends, with cp > 1, the CP exchange not hidden behind the
attention (``cp_comm_s``) and, for a routed family at ep > 1, the dispatch and combine all-to-alls
(``ep_comm_s``).  t_dp is the data-parallel reduction the last backward does not hide (``dp_comm_s``).  Each term
is derived in docs/tuner.md, "Time model", "Long sequences" and "Expert parallelism".  Pure Python."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.config.rules import GRAD_REDUCE_BUCKET_ELEMENTS
from ds_megatron.config.schema import pipeline_schedule
from ds_megatron.flops import block_fields, executed_flops_per_step
from ds_megatron.memory import ring_dkv_hop_bytes
from ds_megatron.model import FAMILIES, family_of
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.tune.core.links import all_to_all_s, link, ring_s
from ds_megatron.tune.core.matmuls import block_matmuls, core_attention_matmuls, logits_matmul, matmul_s
from ds_megatron.tune.core.memory_model import (
    ACT_BYTES,
    WEIGHT_BYTES,
    block_expert_param_count,
    ep_tokens,
    expert_dp_size,
    expert_split,
    has_attention_dropout,
    layers_per_stage,
    padded_vocab_size,
    rank_dense_blocks,
    rank_param_counts,
    rank_routed_blocks,
    routed_shape,
)
from ds_megatron.tune.core.spec import Candidate, Cluster
from ds_megatron.tune.training import schedules

GRAD_REDUCE_BYTES = 4  # DeepSpeed's BF16 optimizer reduces the fp32 gradient copies (grad_accum_dtype fp32)

# The eager kernel's passes over the [b, a/t, s, s] scores, (op, bytes read, bytes written) per score: the model runs
# each as its own kernel over the whole tensor, so they are bound by HBM bandwidth; sdpa keeps the scores on chip.
EAGER_SCORE_OPS = {
    "forward": (
        ("scores to fp32", ACT_BYTES, 4),
        ("mask the future (in place)", 4, 4),
        ("softmax", 4, 4),
        ("probabilities to bf16", 4, ACT_BYTES),
        ("dropout (output and mask)", ACT_BYTES, ACT_BYTES + 1),
    ),
    "backward": (
        ("dropout backward (gradient and mask in)", ACT_BYTES + 1, ACT_BYTES),
        ("gradient to fp32", ACT_BYTES, 4),
        ("probabilities to fp32", ACT_BYTES, 4),
        ("softmax backward", 8, 4),
        ("gradient to bf16", 4, ACT_BYTES),
    ),
}


def pass_bytes(ops: tuple[tuple[str, int, int], ...]) -> int:
    """Bytes one element costs over a sequence of memory-bound passes given as (op, read, written) rows."""
    return sum(r + w for _, r, w in ops)


def memory_bound_s(num_bytes: float, cluster: Cluster) -> float:
    """Time of elementwise passes that move ``num_bytes`` through HBM (read + written), at its full bandwidth."""
    return num_bytes / (cluster.memory_gbps * 1e9)


EAGER_FORWARD_BYTES = pass_bytes(EAGER_SCORE_OPS["forward"])  # 33 per score element
EAGER_BACKWARD_BYTES = pass_bytes(EAGER_SCORE_OPS["backward"])  # 35 per score element


@functools.cache
def eager_score_bytes(attention_dropout: bool) -> tuple[int, int]:
    """(forward, backward) bytes per score element; without an attention dropout (a Llama trained as published)
    its two passes are not run (dropout with p = 0 returns its input): 28 and 30."""
    return tuple(
        pass_bytes(
            tuple(row for row in EAGER_SCORE_OPS[phase] if attention_dropout or not row[0].startswith("dropout"))
        )
        for phase in ("forward", "backward")
    )  # type: ignore[return-value]


# The forward passes selective recompute runs again for its elementwise modules (each family's), (op, bytes read,
# bytes written) per element of the output: [s b, F/t] for mlp_act, [s b (/t under SP), h] per norm for layernorm.
# Each is its own bf16 kernel doing a few FLOPs per byte, so bandwidth-bound.  core_attn re-runs matmuls.
RECOMPUTED_PASSES = {
    name: {
        module: tuple((op, read * ACT_BYTES, written * ACT_BYTES) for op, read, written in ops)
        for module, ops in family.tuner.recomputed_passes.items()
    }
    for name, family in FAMILIES.items()
}


# The routed MLP's memory-bound passes (``model.moe_layer``, ``expert_parallel``), (op, bytes read, bytes written)
# per element, in three groups by the tensor they run over: "pairs", the routed (token, expert) rows [pairs, h];
# "rows", the experts' SwiGLU [rows, F] (F / t at ep 1); "tokens", the combined output [tokens, h].  Each is its own
# kernel moving more bytes than it computes on, so bandwidth-bound.  At ep > 1 the dispatched rows are put into
# local-expert order and the outputs back into source order ("ep pairs").  ``moe`` recompute re-runs the forward of
# what its checkpoint holds: at ep 1 the whole experts' call (pairs, rows), at ep > 1 the local experts' (rows).
ROUTED_PASSES = {
    "pairs": {
        "forward": (
            ("routed rows gathered, x[token]", ACT_BYTES, ACT_BYTES),
            ("expert outputs to fp32", ACT_BYTES, 4),
            ("scaled by their routing weight", 4, 4),
            ("summed per token (index_add: source read, sum read and written)", 4 + 4, 4),
        ),
        "backward": (
            ("the sum's gradient gathered per pair", 4, 4),
            ("times the routing weights", 4, 4),
            ("the weights' gradient: gradient times the fp32 outputs", 4 + 4, 0),
            ("gradient to the activation dtype", 4, ACT_BYTES),
            ("the gather's gradient summed per token (accumulated in place)", 2 * ACT_BYTES, ACT_BYTES),
        ),
    },
    "ep pairs": {
        "forward": (
            ("dispatched rows to local-expert order", ACT_BYTES, ACT_BYTES),
            ("expert outputs back to source order", ACT_BYTES, ACT_BYTES),
        ),
        "backward": (
            ("the outputs' gradient to local-expert order", ACT_BYTES, ACT_BYTES),
            ("the rows' gradient back to source order", ACT_BYTES, ACT_BYTES),
        ),
    },
    "rows": {
        "forward": (("silu(gate)", ACT_BYTES, ACT_BYTES), ("silu(gate) x up", 2 * ACT_BYTES, ACT_BYTES)),
        "backward": (
            ("the product's gradient for both factors", 3 * ACT_BYTES, 2 * ACT_BYTES),
            ("silu backward", 2 * ACT_BYTES, ACT_BYTES),
            ("gate and up gradients into one [rows, 2F]", 2 * ACT_BYTES, 2 * ACT_BYTES),
        ),
    },
    "tokens": {
        "forward": (("the fp32 sum zeroed", 0, 4), ("the sum to the activation dtype", 4, ACT_BYTES)),
        "backward": (("gradient to fp32", ACT_BYTES, 4), ("the routed rows' gradient zeroed", 0, ACT_BYTES)),
    },
}


# bytes per element of each group's passes, by phase (a search asks for them hundreds of thousands of times)
ROUTED_PASS_BYTES = {
    group: {phase: pass_bytes(ops) for phase, ops in phases.items()} for group, phases in ROUTED_PASSES.items()
}


def routed_passes_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int, recomputed: int) -> float:
    """Memory-bound time of the routed MLP's passes (ROUTED_PASSES) in ``num_blocks`` routed blocks for one
    micro-batch, forward and backward, plus the forward again where it is recomputed (full: the ``recomputed``
    blocks; selective ``moe``: what its checkpoint holds); 0 for a dense model.  Sizes: at ep 1 every TP rank runs
    its F / t of every expert on all the tokens it routes or gathers (s b / cp: the whole sequence under SP), n k
    pairs; at ep > 1 the tokens a rank dispatches (``ep_tokens``: its own, its sequence shard under SP, with whole
    experts; the TP group's, gathered, with experts split over TP), n k pairs sent and as many received (uniform
    routing), F wide (F / t split over TP)."""
    routed = routed_shape(model)
    if routed is None:
        return 0.0
    ep = cand.ep_size
    tokens = ep_tokens(model, cand) if ep > 1 else model.seq_length // cand.cp * cand.micro_batch_size
    pairs = tokens * routed.top_k
    width = routed.width / (expert_split(cand) if ep > 1 else cand.tp)
    elements = {"pairs": pairs * model.hidden_size, "rows": pairs * width, "tokens": tokens * model.hidden_size}
    if ep > 1:
        elements["ep pairs"] = elements["pairs"]

    def moved(phase: str, groups) -> float:
        return sum(elements[g] * ROUTED_PASS_BYTES[g][phase] for g in groups)

    forward, backward = moved("forward", elements), moved("backward", elements)
    again = 0.0
    if cand.recompute == "selective" and "moe" in cand.recompute_modules:
        again = moved("forward", ("rows",) if ep > 1 else ("pairs", "rows"))
    return num_blocks * memory_bound_s(forward + backward + again, cluster) + recomputed * memory_bound_s(
        forward, cluster
    )


@dataclass(frozen=True)
class StageTime:
    """One micro-batch (forward + backward) on one stage, in seconds."""

    compute_s: float
    tp_comm_s: float
    p2p_s: float
    attention_s: float = 0.0  # the eager kernel's memory-bound passes over the s x s scores (0 with sdpa)
    flops: float = 0.0  # matmul FLOPs of the micro-batch on this GPU, recomputation included
    recompute_passes_s: float = 0.0  # elementwise passes selective recompute runs again (mlp_act, layernorm)
    cp_comm_s: float = 0.0  # the CP exchange (ring hops, a2a all-to-alls) not hidden behind compute
    weight_grad_s: float = 0.0  # the W share of compute_s: the weight-gradient GEMMs of the linears (ZB-H1 defers)
    ep_comm_s: float = 0.0  # the routed blocks' dispatch and combine all-to-alls over the EP group (0 at ep 1)
    forward_s: float = 0.0  # the forward's share of compute_s (its matmuls once; recomputed forwards run in backward)
    routed_passes_s: float = 0.0  # the routed MLP's memory-bound passes (ROUTED_PASSES; 0 for a dense model)

    @property
    def total_s(self) -> float:
        return (
            (self.compute_s + self.attention_s + self.recompute_passes_s + self.tp_comm_s + self.p2p_s + self.cp_comm_s)
            + self.ep_comm_s
            + self.routed_passes_s
        )


@dataclass(frozen=True)
class StepTime:
    """Predicted optimizer step and its parts (seconds), throughput and utilisation."""

    step_s: float
    compute_s: float  # compute on the critical path, bubble slots included
    tp_comm_s: float  # TP/SP collectives on the critical path, bubble slots included
    p2p_s: float  # pipeline sends on the critical path, bubble slots included
    bubble_s: float  # the share of the above spent filling and draining the pipeline (1F1B: (p - 1) * t_mb)
    dp_comm_s: float  # gradient reduction, weight all-gather and tied-embedding reduction not hidden
    tokens_per_s: float
    mfu: float  # model FLOPs / (step * peak * gpus)
    hfu: float  # executed FLOPs (recompute included) / (step * peak * gpus)
    overhead_s: float = 0.0  # the cluster's fixed per-step overhead (fitted from measurements; 0 by default)
    attention_s: float = 0.0  # the eager kernel's s x s passes on the critical path, bubble slots included
    matmul_efficiency: float = 0.0  # fraction of peak the slowest stage's matmuls run at (tune.core.matmuls)
    recompute_passes_s: float = 0.0  # selective recompute's elementwise passes on the critical path, bubble included
    # The CP exchange not hidden behind compute, on the critical path, bubble included.  Left out of the repr (and of
    # as_dict at cp 1) so that a cp 1 prediction prints exactly as before the tuner knew cp.
    cp_comm_s: float = dataclasses.field(default=0.0, repr=False)

    # The schedule's name, left out of the repr and of a 1f1b record (which stays what it was before schedules).
    schedule: str = dataclasses.field(default=DEFAULT_SCHEDULE.name, repr=False)
    # The EP all-to-alls on the critical path, bubble included; left out of the repr and of as_dict at ep 1 (a
    # dense model's record is what it was before the tuner knew ep).
    ep_comm_s: float = dataclasses.field(default=0.0, repr=False)
    # The routed MLP's memory-bound passes on the critical path, bubble included; left out of the repr and of as_dict
    # for a dense model.
    routed_passes_s: float = dataclasses.field(default=0.0, repr=False)

    def as_dict(self) -> dict:
        record = dataclasses.asdict(self)
        if self.schedule == DEFAULT_SCHEDULE.name:
            del record["schedule"]
        if not self.cp_comm_s:  # absent at cp 1, so that a cp 1 record is what it was before the tuner knew cp
            del record["cp_comm_s"]
        if not self.ep_comm_s:
            del record["ep_comm_s"]
        if not self.routed_passes_s:
            del record["routed_passes_s"]
        return record


def _recomputed_blocks(cand: Candidate, num_blocks: int) -> int:
    """Blocks of a stage whose forward runs twice under full recompute."""
    if cand.recompute != "full":
        return 0
    if cand.recompute_method == "uniform":
        return num_blocks
    per_rank = pipeline_schedule(cand.schedule).per_rank(cand)
    if per_rank > 1:  # k blocks of each of the rank's chunks
        return per_rank * min(cand.recompute_layers, num_blocks // per_rank)
    return min(cand.recompute_layers, num_blocks)


def recomputes_core(cand: Candidate) -> bool:
    """Whether the candidate re-runs the attention core's forward in every block (selective with core_attn)."""
    return cand.recompute == "selective" and "core_attn" in cand.recompute_modules


def eager_score_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int, recomputed: int) -> float:
    """Memory-bound time of the eager kernel's passes over the [b, a/t, s, s] scores of ``num_blocks`` blocks for one
    micro-batch, forward and backward, plus the forward again where it is recomputed (selective with core_attn: every
    block; full: the ``recomputed`` blocks); 0 with sdpa."""
    if cand.attention != "eager":
        return 0.0
    scores = cand.micro_batch_size * model.num_heads / cand.tp * model.seq_length**2
    forwards = num_blocks + recomputed + (num_blocks if recomputes_core(cand) else 0)
    if cand.cp > 1:  # a rank's share of the square; the cp kernels' backward recomputes the scores (a forward more)
        scores /= cand.cp
        forwards += num_blocks
    forward_bytes, backward_bytes = eager_score_bytes(has_attention_dropout(model))
    return memory_bound_s(scores * (forwards * forward_bytes + num_blocks * backward_bytes), cluster)


def recompute_passes_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int) -> float:
    """Memory-bound time of the elementwise passes selective recompute runs again in ``num_blocks`` blocks for one
    micro-batch (RECOMPUTED_PASSES); 0 for the other policies and for core_attn alone."""
    if cand.recompute != "selective":
        return 0.0
    tokens = model.seq_length // cand.cp * cand.micro_batch_size
    sp = cand.sequence_parallel and cand.tp > 1
    elements = {  # of each pass's output, per TP rank
        "mlp_act": tokens * model.intermediate_size / cand.tp,  # type: ignore[operator]
        "layernorm": tokens / (cand.tp if sp else 1) * model.hidden_size,
    }
    passes = RECOMPUTED_PASSES[model.family]
    moved = sum(elements[m] * pass_bytes(passes[m]) for m in cand.recompute_modules if m in passes)
    return num_blocks * memory_bound_s(moved, cluster)


ROUTED_PAIR_BYTES = 4 + 8  # per (token, expert) pair: its fp32 routing weight and int64 expert choice


def routed_comm_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int, recomputed: int) -> float:
    """The collectives a routed block adds to the dense block's (``tensor_parallel.experts``), for one micro-batch
    of ``num_blocks`` blocks (0 for a dense model).  The tokens' all-gather and the outputs' reduce-scatter under SP
    (all-reduce without) are the dense MLP's and counted with them.  Under SP the routing weights and expert
    choices of every token are all-gathered too (k fp32 + k int64 per token) and the weights' gradient
    reduce-scattered in backward (k fp32); without SP the weights enter through f, whose backward all-reduces their
    gradient.  The routing statistics (2 E + 2 fp32) are all-reduced over TP under SP (forward only) and over CP
    (forward and backward).  A re-run forward (full recompute) gathers again.  At ep > 1 with whole experts each
    rank routes and keeps its own tokens (the all-to-alls are ``ep_comm_s``): the statistics' all-reduces only; with
    experts split over TP the tokens enter them as at ep 1 (``tensor_parallel.experts.enter_expert_tp``): as ep 1."""
    routed = routed_shape(model)
    if routed is None:
        return 0.0
    tokens = model.seq_length // cand.cp * cand.micro_batch_size
    k, t, cp = routed.top_k, cand.tp, cand.cp
    gbps, latency = cluster.intra_node_gbps, cluster.intra_node_latency_s
    stats = (2 * routed.num_experts + 2) * 4
    if cand.ep_size > 1 and not cand.experts_split_at_ep:
        forward, backward = (ring_s(stats, t, gbps, latency) if cand.sequence_parallel else 0.0), 0.0
    elif t > 1 and cand.sequence_parallel:
        forward = ring_s(tokens * k * ROUTED_PAIR_BYTES, t, gbps, latency, passes=1) + ring_s(stats, t, gbps, latency)
        backward = ring_s(tokens * k * 4, t, gbps, latency, passes=1)
    else:
        forward, backward = 0.0, ring_s(tokens * k * 4, t, gbps, latency)
    if cp > 1:
        cp_gbps, cp_latency = link(cluster, t * cp > cluster.gpus_per_node)
        forward += ring_s(stats, cp, cp_gbps, cp_latency)
        backward += ring_s(stats, cp, cp_gbps, cp_latency)
    return (num_blocks + recomputed) * forward + num_blocks * backward


def shared_expert_collectives(model: ModelShape) -> int:
    """TP collectives of [s, b, h] a routed block's shared expert adds per pass (1; 0 without one): the dense MLP's
    all-gather / reduce-scatter (all-reduce without SP) once more, beside the routed experts'."""
    routed = routed_shape(model)
    return 1 if routed is not None and routed.shared_width else 0


def ep_comm_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int, recomputed: int) -> float:
    """The all-to-alls of ``num_blocks`` routed blocks over the EP group for one micro-batch at ep > 1 (0 at ep 1
    and for a dense model; ``expert_parallel.dispatch``): forward, the counts' exchange (E int64), the dispatch of
    this rank's routed rows (the tokens it dispatches times k, h wide: ``ep_tokens``) and the combine of their
    outputs; backward, the two again in reverse (the gradients).  None overlapped with compute; a re-run forward
    (full recompute) exchanges again.  Uniform routing: each rank sends (ep - 1) / ep of its rows away
    (``links.all_to_all_s``: NVLink inside a node, the network across).  The group's ranks are consecutive with
    whole experts (``expert_parallel.layout``: the innermost ranks of the stage) and tp apart with experts split
    over TP (one tp index's ranks), so at tp > 1 a split group spans tp times as many GPUs and leaves the node
    sooner."""
    routed = routed_shape(model)
    ep = cand.ep_size
    if ep == 1 or routed is None:
        return 0.0
    tokens, stride = ep_tokens(model, cand), expert_split(cand)
    rows = all_to_all_s(tokens * routed.top_k * model.hidden_size * ACT_BYTES, ep, cluster, stride)
    counts = all_to_all_s(routed.num_experts * 8, ep, cluster, stride)
    return (num_blocks + recomputed) * (counts + 2 * rows) + num_blocks * 2 * rows


def expert_matmuls(model: ModelShape, cand: Candidate):
    """One block's matmuls as training runs them (``matmuls.block_matmuls`` with a routed family's experts one
    GEMM per expert on the rank at the candidate's ep, F / t wide where split over TP)."""
    return block_matmuls(model, cand, ep=cand.ep_size, expert_tp=expert_split(cand))


def dense_matmuls(model: ModelShape, cand: Candidate):
    """One dense block of a routed family's linears (``matmuls.block_matmuls`` with ``dense``)."""
    return block_matmuls(model, cand, dense=True)


def recomputed_experts_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int) -> float:
    """Selective ``moe`` re-runs each routed block's expert GEMMs (``block_gemms``' rows named "experts ...")
    in backward; 0 otherwise."""
    if cand.recompute != "selective" or "moe" not in cand.recompute_modules:
        return 0.0
    experts = tuple(op for op in expert_matmuls(model, cand) if op.name.startswith("experts"))
    return num_blocks * matmul_s(experts, cluster)


def ring_pass_s(step_s: float, hop_s: float | list[float], cp: int) -> float:
    """One pass of the ring over cp steps: each of the first cp - 1 steps computes the block in hand while the next
    message travels (posted before the compute), so it lasts the longer of the two; the last step computes only.
    ``hop_s``: one time for every hop, or the cp - 1 hops' own times (messages of different sizes)."""
    hops = [hop_s] * (cp - 1) if isinstance(hop_s, float | int) else hop_s
    return sum(max(step_s, hop) for hop in hops) + step_s


def cp_comm_s(model: ModelShape, cluster: Cluster, cand: Candidate, num_blocks: int, recomputed: int) -> float:
    """The CP exchange of ``num_blocks`` blocks for one micro-batch that compute does not hide (0 at cp 1).

    ring: a forward hop carries this rank's K and V, 2 b (a_kv / t) (s / cp) d bf16 elements, and overlaps one
    step's attention (the core's forward / cp: every step is one 2c x c chunk pair's worth); a backward step's hops
    carry the K/V again and the dK/dV accumulator (two messages) against twice a step's compute, the accumulator in
    the dtype the ring sends it in at that hop (``memory.ring_dkv_hop_bytes``: bf16 on the first, fp32 on the
    middle ones, so 3x the K/V's bytes there), and its last hop home (bf16) waits after the last step.  What
    exceeds the compute is exposed:
    ``ring_pass_s - cp x step``.  a2a: two all-to-alls per block forward (q, k and v in one, the context) and two
    in backward, (cp - 1) / cp of each tensor leaving the rank, not overlapped.  The link is NVLink while tp x cp
    ranks fit in a node, else the network; a re-run forward (full recompute, or selective core_attn, which
    checkpoints the whole cp_comm call) exchanges again."""
    cp = cand.cp
    if cp == 1:
        return 0.0
    b, t, d = cand.micro_batch_size, cand.tp, model.head_dim
    rows = model.seq_length // cp
    gbps, latency = link(cluster, cand.tp * cp > cluster.gpus_per_node)
    bandwidth = gbps * 1e9
    kv_bytes = 2 * b * model.num_kv_heads / t * rows * d * ACT_BYTES
    forwards = num_blocks + recomputed + (num_blocks if recomputes_core(cand) else 0)
    if cand.cp_comm == "a2a":
        q_bytes = b * model.num_heads / t * rows * d * ACT_BYTES
        one_way = 2 * latency + (cp - 1) / cp * (2 * q_bytes + kv_bytes) / bandwidth  # q, k, v at once; context
        return (forwards + num_blocks) * one_way
    step = matmul_s(core_attention_matmuls(model, cand), cluster) / cp
    forward = ring_pass_s(step, latency + kv_bytes / bandwidth, cp) - cp * step
    dkv_bytes = [kv_bytes * hop / ACT_BYTES for hop in ring_dkv_hop_bytes(cp, ACT_BYTES)]  # per hop, home last
    hops = [2 * latency + (kv_bytes + dkv) / bandwidth for dkv in dkv_bytes[:-1]]
    backward = ring_pass_s(2 * step, hops, cp) - cp * 2 * step + latency + dkv_bytes[-1] / bandwidth
    return forwards * forward + num_blocks * backward


def stage_times(model: ModelShape, cluster: Cluster, cand: Candidate) -> tuple[StageTime, StageTime]:
    """(first stage, last stage) time of one micro-batch.  With p = 1 both are the whole model.  Under an uneven
    layout (``Candidate.pipeline_layout``) each at its own block count."""
    n = stage_blocks(model, cand)
    dense_first, dense_last = rank_dense_blocks(model, cand)  # a routed family's dense blocks on each (0: none)
    if cand.pp == 1:
        last = stage_time(model, cluster, cand, n, "last", dense_last)
        return last, last
    n_first, n_last = (n, n) if cand.pipeline_layout is None else (cand.pipeline_layout[0], cand.pipeline_layout[-1])
    first = stage_time(model, cluster, cand, n_first, "first", dense_first)
    return first, stage_time(model, cluster, cand, n_last, "last", dense_last)


def slowest_stage(
    model: ModelShape, cluster: Cluster, cand: Candidate, ends: tuple[StageTime, StageTime] | None = None
) -> StageTime:
    """The stage whose micro-batch takes longest: the first or the last, or under an uneven layout a middle one.
    ``ends``: ``stage_times``' result, when already computed."""
    first, last = ends or stage_times(model, cluster, cand)
    stages = [first, last]
    if cand.pipeline_layout is not None and cand.pp > 2:
        stages.append(stage_time(model, cluster, cand, max(cand.pipeline_layout[1:-1]), "middle"))
    return max(stages, key=lambda st: st.total_s)


def stage_time(
    model: ModelShape, cluster: Cluster, cand: Candidate, n: int, where: str, dense: int = 0
) -> StageTime:  # fmt: skip
    """One micro-batch on a pipeline rank running ``n`` blocks; ``where``: "first" (the embedding's stage),
    "middle" or "last" (the output layer's; at p = 1 the whole model).  ``dense`` of the ``n`` blocks are a routed
    family's dense ones (a SwiGLU of the dense width: its GEMMs, the dense MLP's two TP collectives per pass at any
    ep, no routed collective, all-to-all or routed pass); a re-run forward (full recompute) is priced as a routed
    block's (an upper bound)."""
    s, b, h, t = model.seq_length // cand.cp, cand.micro_batch_size, model.hidden_size, cand.tp  # this CP rank's
    recomputed = _recomputed_blocks(cand, n)
    # Forward and backward (twice the forward: input and weight gradients, GEMMs of the same shapes) of every block,
    # plus the recomputed forwards: full recompute re-runs whole blocks, selective with core_attn the core attention
    # of each block (its other modules are elementwise: recompute_passes_s).
    linears, core = expert_matmuls(model, cand), core_attention_matmuls(model, cand)
    block = linears + core
    block_runs, core_reruns = 3 * n + recomputed, n if recomputes_core(cand) else 0
    block_once = matmul_s(block, cluster)
    block_s = block_runs * block_once + core_reruns * matmul_s(core, cluster)
    block_s += recomputed_experts_s(model, cluster, cand, n - dense)
    block_flops = block_runs * sum(op.flops for op in block) + core_reruns * sum(op.flops for op in core)
    block_w = n * matmul_s(linears, cluster)  # W: one GEMM of each forward GEMM's shape per linear (dA = dY^T X)
    forward = n * block_once
    if dense:  # the dense blocks' GEMMs in place of routed ones, forward and backward
        dense_linears = dense_matmuls(model, cand)
        dense_once = matmul_s(dense_linears + core, cluster)
        block_s += 3 * dense * (dense_once - block_once)
        block_flops += 3 * dense * sum(op.flops for op in dense_linears) - 3 * dense * sum(op.flops for op in linears)
        block_w += dense * (matmul_s(dense_linears, cluster) - matmul_s(linears, cluster))
        forward += dense * (dense_once - block_once)
    logits = logits_matmul(model, cand)
    logits_s, logits_flops = 3 * matmul_s((logits,), cluster), 3 * logits.flops

    boundary = s * b * h * ACT_BYTES  # one [s, b, h] bf16 tensor
    if t == 1:
        unit = 0.0
    elif cand.sequence_parallel:  # all-gather + reduce-scatter in place of each all-reduce
        unit = 2 * ring_s(boundary, t, cluster.intra_node_gbps, cluster.intra_node_latency_s, passes=1)
    else:
        unit = ring_s(boundary, t, cluster.intra_node_gbps, cluster.intra_node_latency_s)
    # per block two collectives forward (attention, MLP) and two backward; at ep > 1 with whole experts the routed
    # MLP exchanges its rows over the EP group instead of the tokens over TP, so the attention's alone (with experts
    # split over TP the tokens enter and leave them as the dense MLP's: both); a shared expert beside the routed
    # ones (split over TP as the dense MLP, at any ep) adds one each way, its input gathered, its output reduced
    per_pass = (2 if cand.ep_size == 1 or cand.experts_split_at_ep else 1) + shared_expert_collectives(model)
    block_units = 2 * per_pass * n + per_pass * recomputed + (2 * (2 - per_pass) * dense if dense else 0)
    routed = routed_comm_s(model, cluster, cand, n - dense, recomputed)
    ep = ep_comm_s(model, cluster, cand, n - dense, recomputed)

    p2p = 0.0
    if cand.pp > 1:
        # a pipeline spanning nodes crosses a NIC
        gbps, latency = link(cluster, cand.tp * cand.cp * cand.dp * cand.pp > cluster.gpus_per_node)
        sent = boundary / (t if cand.sequence_parallel else 1)
        p2p = 2 * (latency + sent / (gbps * 1e9))  # activation forward, its gradient backward
        # each of a rank's chunks receives and sends its own: v p - 1 boundaries crossed per micro-batch and
        # direction, p - 1 of them more per rank than 1F1B's
        p2p *= pipeline_schedule(cand.schedule).per_rank(cand)

    scores = eager_score_s(model, cluster, cand, n, recomputed)
    passes = recompute_passes_s(model, cluster, cand, n)
    cp = cp_comm_s(model, cluster, cand, n, recomputed)
    routed_passes = routed_passes_s(model, cluster, cand, n - dense, recomputed)
    logits_w = matmul_s((logits,), cluster)  # the output layer's W on the last stage
    if where == "middle":  # no vocabulary-parallel layer: only the blocks' collectives
        return StageTime(
            block_s, block_units * unit + routed, p2p, scores, block_flops, passes, cp, block_w, ep, forward,
            routed_passes,
        )  # fmt: skip
    tp_comm = (block_units + 1) * unit + routed
    if where == "first":
        return StageTime(block_s, tp_comm, p2p, scores, block_flops, passes, cp, block_w, ep, forward, routed_passes)
    if cand.pp == 1:  # the whole model: the embedding's and the output layer's collectives, no pipeline sends
        tp_comm, p2p = (block_units + 2) * unit + routed, 0.0
    compute, flops, forward = block_s + logits_s, block_flops + logits_flops, forward + logits_s / 3
    return StageTime(compute, tp_comm, p2p, scores, flops, passes, cp, block_w + logits_w, ep, forward, routed_passes)


def stage_blocks(model: ModelShape, cand: Candidate) -> int:
    """Blocks one pipeline rank runs per micro-batch: ceil(L/p), under v stages per rank (DualPipeV: 2) v chunks of
    ceil(L/(v p))."""
    per_rank = pipeline_schedule(cand.schedule).per_rank(cand)
    return per_rank * layers_per_stage(model.num_layers, per_rank * cand.pp)


def schedule_slots(cand: Candidate, slowest: StageTime) -> tuple[float, float]:
    """(slots, bubble in s): the step's critical path in micro-batches of ``slowest.total_s`` and the part of it
    spent filling and draining the pipeline, from the schedule's record (``Schedule.slots``, with T_W the W share,
    ``StageTime.weight_grad_s``): 1F1B m + p - 1 slots, bubble (p - 1) t_mb; the others simulated
    (``pipeline_parallel/schedules/``)."""
    return schedules.critical_path(cand, slowest.total_s, slowest.weight_grad_s)


def grad_reduce_overlapped(cand: Candidate) -> bool:
    """Whether the candidate's run reduces its data-parallel gradients during the last backward work
    (``parallel.overlap_grad_reduce``): the setting on and a data axis (dp x cp) of more than one rank.  What makes
    a run fall back to DeepSpeed's reduction (``pipeline_parallel.grad_reduce.overlap_refusal``: ZeRO's own
    optimizer, the fp16 optimizer, a reduction in another dtype than fp32) is never in the tuner's configs: bf16 on
    DeepSpeed's BF16 optimizer at ZeRO 0 or 1, reduced in fp32 (``written.ds_config``)."""
    return cand.overlap_grad_reduce and cand.dp * cand.cp > 1


def overlapped_reduce_s(
    params: int,
    trailing: int,
    window_s: float,
    bucket_s: Callable[[int], float],
    bucket: int = GRAD_REDUCE_BUCKET_ELEMENTS,
) -> float:
    """Seconds one rank's overlapped data-parallel reduction lasts past the end of its last backward work.

    The rank's ``params`` gradients, in the order the overlap buckets them (the parameters' reverse order: roughly
    the order backward finishes them), are cut into buckets of ``bucket`` elements.  The first ``params - trailing``
    become final at an even rate over ``window_s`` (the last micro-batch's backward compute on the rank: a bucket's
    share of the parameters is its share of the backward); the last ``trailing`` at its end (the embedding, whose
    gradient is the backward's last op, and a tied weight, reduced after its tied sum).  A bucket starts once its
    gradients are final and the bucket before it is done (one link, one reduction at a time) and takes
    ``bucket_s(elements)``.  With a = bucket / (params - trailing) x window, the backward per bucket, and
    d = bucket_s(bucket), the B whole buckets before the trailing part are done at a + (B - 1) max(a, d) + d; the
    rest start at the window's end at the earliest, one after another.  So

        exposed = max(a + (B - 1) max(a, d) + d, window) - window + (the rest's bucket times).

    With nothing trailing and d <= a, that is d: all but the last bucket's share hides under the backward; with
    d > a, the whole reduction less the backward it ran under, T - (B - 1) a.  docs/tuner.md, "Time model", DP."""
    early = params - trailing
    whole = early // bucket if window_s > 0 else 0  # whole buckets of gradients final before the window's end
    rest = params - whole * bucket
    done = window_s
    if whole:
        a, d = bucket / early * window_s, bucket_s(bucket)
        done = max(a + (whole - 1) * max(a, d) + d, window_s)
    full, part = divmod(rest, bucket)
    return done - window_s + full * bucket_s(bucket) + (bucket_s(part) if part else 0.0)


def last_backward_s(cand: Candidate, stage: StageTime) -> float:
    """The compute of a rank's last gradient pass of the step, over which its gradients become final: the stage's
    backward (its micro-batch compute less the forward; recomputed forwards run inside the backward), or under a
    schedule that defers the weight gradients the W pass."""
    if pipeline_schedule(cand.schedule).deferred_weight_grads:
        return stage.weight_grad_s
    return stage.compute_s - stage.forward_s


def reduced_ranks(
    model: ModelShape, cluster: Cluster, cand: Candidate, ends: tuple[StageTime, StageTime] | None = None
) -> list[tuple[int, int, float]]:
    """(parameters, of them trailing, last backward in s) of the first and the last pipeline rank (one at p = 1), for
    ``overlapped_reduce_s``.  Trailing: the embedding (and a GPT's position table) on the rank holding it, and a tied
    output layer's copy on the last stage.  ``ends``: ``stage_times``' result, when already computed."""
    first_params, last_params = rank_param_counts(model, cand)
    first, last = ends or stage_times(model, cluster, cand)
    h = model.hidden_size
    embedding = padded_vocab_size(model.vocab_size, cand.tp) * h // cand.tp
    head = embedding + (model.seq_length * h if family_of(model).layout.positions else 0)
    if cand.pp == 1:
        return [(first_params, head, last_backward_s(cand, last))]
    if pipeline_schedule(cand.schedule).loss_on_first_rank:  # rank 0 holds both ends (one tied module)
        return [
            (first_params, head, last_backward_s(cand, last)),
            (last_params, 0, last_backward_s(cand, first)),
        ]
    tied = embedding if model.tie_word_embeddings else 0
    return [
        (first_params, head, last_backward_s(cand, first)),
        (last_params, tied, last_backward_s(cand, last)),
    ]


def dp_comm_s(
    model: ModelShape, cluster: Cluster, cand: Candidate, ends: tuple[StageTime, StageTime] | None = None
) -> float:
    """Gradient all-reduce (+ ZeRO-1 weight all-gather) over DeepSpeed's data axis, dp x cp (the CP ranks hold the
    same weights, so their gradients are averaged with the data-parallel ones) and, for tied embeddings split over
    first and last stage, their all-reduce: what the step waits for after its last backward.  With the overlap
    (``grad_reduce_overlapped``) the reduction of each end rank is ``overlapped_reduce_s`` and the slower rank's
    counts (the later stages' earlier finish in the pipeline's drain is not counted: an upper bound); without it,
    DeepSpeed's one reduction after the step, whole.  At ep > 1 the experts' gradients are reduced over their
    expert-DP group (which spans the stage's tp x cp x dp ranks, ``expert_dp_size`` of them) after the rest (the
    overlap buckets them last), not hidden.  The weight all-gather follows the optimizer step, never hidden.
    ``ends``: ``stage_times``' result, when already computed."""
    ranks = cand.dp * cand.cp
    gbps, latency = link(cluster, cand.tp * ranks > cluster.gpus_per_node)

    def bucket_s(elements: int) -> float:
        return ring_s(GRAD_REDUCE_BYTES * elements, ranks, gbps, latency)

    overlapped = grad_reduce_overlapped(cand)
    if cand.ep_size == 1:
        params = max(rank_param_counts(model, cand))
        if overlapped:
            total = max(overlapped_reduce_s(p, t, w, bucket_s) for p, t, w in reduced_ranks(model, cluster, cand, ends))
        else:
            total = bucket_s(params)
        if cand.zero == 1:
            total += ring_s(WEIGHT_BYTES * params, ranks, gbps, latency, passes=1)
    else:
        experts_dp, per_block = expert_dp_size(cand), block_expert_param_count(model, cand)
        windows = reduced_ranks(model, cluster, cand, ends) if overlapped else []
        total = 0.0
        for i, (params, blocks) in enumerate(zip(rank_param_counts(model, cand), rank_routed_blocks(model, cand))):
            experts = blocks * per_block
            dense = params - experts
            if overlapped and i >= len(windows):  # one rank at pp 1
                break
            rank = overlapped_reduce_s(dense, windows[i][1], windows[i][2], bucket_s) if overlapped else bucket_s(dense)
            rank += ring_s(GRAD_REDUCE_BYTES * experts, experts_dp, gbps, latency) if experts else 0.0
            if cand.zero == 1:
                rank += ring_s(WEIGHT_BYTES * dense, ranks, gbps, latency, passes=1)
                rank += ring_s(WEIGHT_BYTES * experts, experts_dp, gbps, latency, passes=1) if experts else 0.0
            total = max(total, rank)
    # DualPipeV's rank 0 holds both ends: a tied embedding is one module there, with nothing to all-reduce.
    if cand.pp > 1 and model.tie_word_embeddings and not pipeline_schedule(cand.schedule).loss_on_first_rank:
        embedding = padded_vocab_size(model.vocab_size, cand.tp) * model.hidden_size / cand.tp
        total += ring_s(GRAD_REDUCE_BYTES * embedding, 2, *link(cluster, cluster.num_gpus > cluster.gpus_per_node))
    return total


def job_flops(model: ModelShape, global_batch_size: int, cand: Candidate | None = None) -> float:
    """FLOPs the whole job runs per step: the model's (for MFU), or with ``cand`` its recomputation included (HFU)."""
    policy, recomputed, modules = "none", None, ()
    if cand is not None and cand.recompute == "full":
        n = stage_blocks(model, cand)
        policy, recomputed = "full", min(model.num_layers, _recomputed_blocks(cand, n) * cand.pp)
    elif cand is not None and cand.recompute == "selective":  # each module at its own FLOPs (flops.py)
        policy, modules = "selective", cand.recompute_modules
    return _executed_flops(model, global_batch_size, policy, recomputed, modules)


@functools.lru_cache(maxsize=1024)
def _executed_flops(
    m: ModelShape, global_batch_size: int, policy: str, recomputed: int | None, modules: tuple[str, ...]
) -> float:
    """``job_flops``' count, once per model, batch and recompute (a search asks for the same few thousands of times;
    a routed family's terms read its config)."""
    args = (global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size, policy, recomputed)
    return executed_flops_per_step(*args, recompute_modules=modules, **block_fields(m))


def ranked_step(step_s: float) -> float:
    """A predicted step time as the ranking compares it: to the nanosecond.  Two layouts whose time terms are the
    same numbers summed in another order differ in the last bits of a float; they are the same prediction."""
    return round(step_s, 9)


def step_time(model: ModelShape, cluster: Cluster, cand: Candidate, global_batch_size: int) -> StepTime:
    """Predicted step time, tokens/s, MFU and HFU of ``cand``."""
    ends = stage_times(model, cluster, cand)
    slowest = slowest_stage(model, cluster, cand, ends)
    slots, bubble = schedule_slots(cand, slowest)
    dp = dp_comm_s(model, cluster, cand, ends)
    step = slots * slowest.total_s + dp + cluster.step_overhead_s
    capacity = step * cluster.peak_flops * cluster.num_gpus
    return StepTime(
        step_s=step,
        compute_s=slots * slowest.compute_s,
        tp_comm_s=slots * slowest.tp_comm_s,
        p2p_s=slots * slowest.p2p_s,
        bubble_s=bubble,
        dp_comm_s=dp,
        tokens_per_s=global_batch_size * model.seq_length / step,
        mfu=job_flops(model, global_batch_size) / capacity,
        hfu=job_flops(model, global_batch_size, cand) / capacity,
        overhead_s=cluster.step_overhead_s,
        attention_s=slots * slowest.attention_s,
        matmul_efficiency=slowest.flops / (slowest.compute_s * cluster.peak_flops),
        recompute_passes_s=slots * slowest.recompute_passes_s,
        cp_comm_s=slots * slowest.cp_comm_s,
        schedule=cand.schedule,
        ep_comm_s=slots * slowest.ep_comm_s,
        routed_passes_s=slots * slowest.routed_passes_s,
    )
