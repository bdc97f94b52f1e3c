"""Predicted time of one optimizer step of a candidate.  Pure Python.

    step = (m + p - 1) * t_mb + t_dp * (1 - DP_OVERLAP) + t_tied

- t_mb, one micro-batch's forward and backward on the slowest stage: matmul FLOPs (``ds_megatron.flops``,
  recomputation included) / (t * peak * efficiency), plus the TP collectives, plus the pipeline point-to-point.
  The (p - 1) extra slots are the 1F1B bubble, (p - 1)/m of the ideal step (Narayanan et al. 2021, sec. 2.2.1).
- TP (Korthikanti et al. 2022, sec. 4.2): per block and micro-batch, two all-reduces of s b h bf16 values forward and
  two backward (with SP each becomes an all-gather plus a reduce-scatter of the same volume); full recompute repeats
  the forward two.  The embedding (first stage) and output layer (last stage) add one more each.
- Pipeline point-to-point: the s b h boundary tensor (s/t rows under SP) forward, its gradient backward.
- DP: DeepSpeed's BF16 optimizer all-reduces the fp32 gradients over dp after the last micro-batch and, as ZeRO-1,
  all-gathers the updated bf16 weights; the tied embedding gradient is all-reduced between first and last stage.

Collectives follow the alpha-beta ring model: a ring all-reduce of B bytes over n ranks moves 2 (n-1)/n B per GPU,
an all-gather or reduce-scatter (n-1)/n B, each at the link's per-GPU bandwidth, plus a fixed latency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ds_megatron.flops import (
    core_attention_forward_flops,
    executed_flops_per_step,
    layer_forward_flops,
    logits_forward_flops,
    model_flops_per_step,
)
from ds_megatron.tune.memory_model import (
    ACT_BYTES,
    WEIGHT_BYTES,
    layers_per_stage,
    padded_vocab_size,
    stage_param_counts,
)
from ds_megatron.tune.spec import DEFAULT_EFFICIENCY, Candidate, Cluster, ModelSpec

INTRA_NODE_LATENCY_S = 20e-6  # per collective or transfer inside a node (NCCL launch + ring set-up)
INTER_NODE_LATENCY_S = 50e-6  # per collective or transfer across nodes
GRAD_REDUCE_BYTES = 4  # DeepSpeed's BF16 optimizer reduces the fp32 gradient copies (grad_accum_dtype fp32)
# DeepSpeed's PipelineEngine reduces gradients in a ReduceGrads step after the last backward of the step, so none of
# it hides behind compute.  Raise it for an engine that overlaps the reduction with the backward pass.
DP_OVERLAP = 0.0

__all__ = ["DEFAULT_EFFICIENCY", "Measurement", "StepTime", "calibrate", "step_time"]


def allreduce_s(num_bytes: float, ranks: int, gbps: float, latency_s: float) -> float:
    """Ring all-reduce: 2 (n-1)/n * bytes / bandwidth."""
    if ranks <= 1:
        return 0.0
    return latency_s + 2.0 * (ranks - 1) / ranks * num_bytes / (gbps * 1e9)


def allgather_s(num_bytes: float, ranks: int, gbps: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a ``num_bytes`` result: (n-1)/n * bytes / bandwidth."""
    if ranks <= 1:
        return 0.0
    return latency_s + (ranks - 1) / ranks * num_bytes / (gbps * 1e9)


@dataclass(frozen=True)
class StageTime:
    """One micro-batch (forward + backward) on one stage, in seconds."""

    compute_s: float
    tp_comm_s: float
    p2p_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.p2p_s


@dataclass(frozen=True)
class StepTime:
    """Predicted optimizer step and its parts (seconds), throughput and utilisation."""

    step_s: float
    compute_s: float  # compute on the critical path, bubble slots included
    tp_comm_s: float  # TP/SP collectives on the critical path, bubble slots included
    p2p_s: float  # pipeline sends on the critical path, bubble slots included
    bubble_s: float  # (p - 1) * t_mb: the share of the above spent filling and draining the pipeline
    dp_comm_s: float  # gradient reduction, weight all-gather and tied-embedding reduction not hidden
    tokens_per_s: float
    mfu: float  # model FLOPs / (step * peak * gpus)
    hfu: float  # executed FLOPs (recompute included) / (step * peak * gpus)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _recomputed_blocks(cand: Candidate, num_blocks: int) -> int:
    """Blocks of a stage whose forward runs twice under full recompute."""
    if cand.recompute != "full":
        return 0
    return num_blocks if cand.recompute_method == "uniform" else min(cand.recompute_layers, num_blocks)


def stage_times(model: ModelSpec, cluster: Cluster, cand: Candidate) -> tuple[StageTime, StageTime]:
    """(first stage, last stage) time of one micro-batch.  With p = 1 both are the whole model."""
    s, b, h, t = model.seq_length, cand.micro_batch_size, model.hidden_size, cand.tp
    n = layers_per_stage(model.num_layers, cand.pp)
    recomputed = _recomputed_blocks(cand, n)
    block_flops = 3 * n * layer_forward_flops(b, s, h) + recomputed * layer_forward_flops(b, s, h)
    if cand.recompute == "selective":
        block_flops += n * core_attention_forward_flops(b, s, h)
    logits_flops = 3 * logits_forward_flops(b, s, h, padded_vocab_size(model.vocab_size, t))
    rate = t * cluster.peak_flops * cluster.efficiency  # FLOP/s of a TP group

    boundary = s * b * h * ACT_BYTES  # one [s, b, h] bf16 tensor
    if t == 1:
        unit = 0.0
    elif cand.sequence_parallel:  # all-gather + reduce-scatter in place of each all-reduce
        unit = 2 * allgather_s(boundary, t, cluster.intra_node_gbps, INTRA_NODE_LATENCY_S)
    else:
        unit = allreduce_s(boundary, t, cluster.intra_node_gbps, INTRA_NODE_LATENCY_S)
    block_units = 4 * n + 2 * recomputed

    p2p = 0.0
    if cand.pp > 1:
        inter = cand.tp * cand.dp * cand.pp > cluster.gpus_per_node  # a pipeline spanning nodes crosses a NIC
        gbps = cluster.inter_node_gbps if inter else cluster.intra_node_gbps
        latency = INTER_NODE_LATENCY_S if inter else INTRA_NODE_LATENCY_S
        sent = boundary / (t if cand.sequence_parallel else 1)
        p2p = 2 * (latency + sent / (gbps * 1e9))  # activation forward, its gradient backward

    first = StageTime(block_flops / rate, (block_units + 1) * unit, p2p)
    last = StageTime((block_flops + logits_flops) / rate, (block_units + 1) * unit, p2p)
    if cand.pp == 1:
        first = last = StageTime(last.compute_s, (block_units + 2) * unit, 0.0)
    return first, last


def dp_comm_s(model: ModelSpec, cluster: Cluster, cand: Candidate) -> float:
    """Gradient all-reduce (+ ZeRO-1 weight all-gather) over dp and the tied-embedding all-reduce, not overlapped."""
    params = max(stage_param_counts(model, cand.tp, cand.pp))
    within_node = cand.tp * cand.dp <= cluster.gpus_per_node
    gbps = cluster.intra_node_gbps if within_node else cluster.inter_node_gbps
    latency = INTRA_NODE_LATENCY_S if within_node else INTER_NODE_LATENCY_S
    total = allreduce_s(GRAD_REDUCE_BYTES * params, cand.dp, gbps, latency)
    if cand.zero == 1:
        total += allgather_s(WEIGHT_BYTES * params, cand.dp, gbps, latency)
    total *= 1.0 - DP_OVERLAP
    if cand.pp > 1:
        inter = cluster.num_gpus > cluster.gpus_per_node
        embedding = padded_vocab_size(model.vocab_size, cand.tp) * model.hidden_size / cand.tp
        total += allreduce_s(
            GRAD_REDUCE_BYTES * embedding,
            2,
            cluster.inter_node_gbps if inter else cluster.intra_node_gbps,
            INTER_NODE_LATENCY_S if inter else INTRA_NODE_LATENCY_S,
        )
    return total


def executed_flops(model: ModelSpec, cand: Candidate, global_batch_size: int) -> float:
    """FLOPs the whole job runs per step, recomputation included (for HFU)."""
    n = layers_per_stage(model.num_layers, cand.pp)
    recomputed = min(model.num_layers, _recomputed_blocks(cand, n) * cand.pp) if cand.recompute == "full" else None
    return executed_flops_per_step(
        global_batch_size,
        model.seq_length,
        model.num_layers,
        model.hidden_size,
        model.vocab_size,
        cand.recompute,
        recomputed,
    )


def step_time(model: ModelSpec, cluster: Cluster, cand: Candidate, global_batch_size: int) -> StepTime:
    """Predicted step time, tokens/s, MFU and HFU of ``cand``."""
    first, last = stage_times(model, cluster, cand)
    slowest = max(first, last, key=lambda st: st.total_s)
    slots = cand.num_micro_batches + cand.pp - 1
    dp = dp_comm_s(model, cluster, cand)
    step = slots * slowest.total_s + dp
    capacity = step * cluster.peak_flops * cluster.num_gpus
    model_flops = model_flops_per_step(
        global_batch_size, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    )
    return StepTime(
        step_s=step,
        compute_s=slots * slowest.compute_s,
        tp_comm_s=slots * slowest.tp_comm_s,
        p2p_s=slots * slowest.p2p_s,
        bubble_s=(cand.pp - 1) * slowest.total_s,
        dp_comm_s=dp,
        tokens_per_s=global_batch_size * model.seq_length / step,
        mfu=model_flops / capacity,
        hfu=executed_flops(model, cand, global_batch_size) / capacity,
    )


@dataclass(frozen=True)
class Measurement:
    """A measured step of a known configuration, for :func:`calibrate`."""

    model: ModelSpec
    cluster: Cluster
    candidate: Candidate
    global_batch_size: int
    step_time_s: float


def calibrate(measurements: Iterable[Measurement]) -> float:
    """The achieved-efficiency factor that best explains measured step times.

    The predicted step is C / e + R, C the critical-path compute at peak and R everything else (communication), so
    e is fitted in closed form by least squares on x = 1/e: x = sum C_i (M_i - R_i) / sum C_i^2.  Pass the result as
    ``--efficiency`` (or ``Cluster.efficiency``) to rank with your cluster's numbers.
    """
    num = den = 0.0
    count = 0
    for meas in measurements:
        at_peak = dataclasses.replace(meas.cluster, efficiency=1.0)
        pred = step_time(meas.model, at_peak, meas.candidate, meas.global_batch_size)
        rest = pred.step_s - pred.compute_s
        num += pred.compute_s * (meas.step_time_s - rest)
        den += pred.compute_s**2
        count += 1
    if count == 0:
        raise ValueError("calibrate: no measurements given; pass at least one Measurement")
    if num <= 0.0:
        raise ValueError("calibrate: the measured steps are faster than their communication alone; check the inputs")
    efficiency = den / num
    if efficiency > 1.0:
        raise ValueError(
            f"calibrate: fitted efficiency {efficiency:.2f} > 1: the measured steps beat the peak; check peak_tflops"
        )
    return efficiency
