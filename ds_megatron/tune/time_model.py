"""Predicted time of one optimizer step of a candidate.  Pure Python.

    step = (m + p - 1) * t_mb + t_dp * (1 - DP_OVERLAP) + t_tied + overhead

- t_mb, one micro-batch's forward and backward on the slowest stage: matmul FLOPs (``ds_megatron.flops``,
  recomputation included) / (t * peak * efficiency), plus the TP collectives, plus the pipeline point-to-point.
  The (p - 1) extra slots are the 1F1B bubble, (p - 1)/m of the ideal step (Narayanan et al. 2021, sec. 2.2.1).
- TP (Korthikanti et al. 2022, sec. 4.2): per block and micro-batch, two all-reduces of s b h bf16 values forward and
  two backward (with SP each becomes an all-gather plus a reduce-scatter of the same volume); full recompute repeats
  the forward two.  The embedding (first stage) and output layer (last stage) add one more each.
- Pipeline point-to-point: the s b h boundary tensor (s/t rows under SP) forward, its gradient backward.
- DP: DeepSpeed's BF16 optimizer all-reduces the fp32 gradients over dp after the last micro-batch and, as ZeRO-1,
  all-gathers the updated bf16 weights; the tied embedding gradient is all-reduced between first and last stage.
- overhead: a fixed time per step (``Cluster.step_overhead_s``, 0 by default), fitted only from measured runs.

Collectives follow the alpha-beta ring model: a ring all-reduce of B bytes over n ranks moves 2 (n-1)/n B per GPU,
an all-gather or reduce-scatter (n-1)/n B, each at the link's per-GPU bandwidth, plus a fixed latency.
"""

from __future__ import annotations

import dataclasses
import math
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
from ds_megatron.tune.spec import (
    DEFAULT_EFFICIENCY,
    INTER_NODE_LATENCY_S,
    INTRA_NODE_LATENCY_S,
    Candidate,
    Cluster,
    ModelSpec,
)

GRAD_REDUCE_BYTES = 4  # DeepSpeed's BF16 optimizer reduces the fp32 gradient copies (grad_accum_dtype fp32)
# DeepSpeed's PipelineEngine reduces gradients in a ReduceGrads step after the last backward of the step, so none of
# it hides behind compute.  Raise it for an engine that overlaps the reduction with the backward pass.
DP_OVERLAP = 0.0

__all__ = [
    "DEFAULT_EFFICIENCY",
    "INTER_NODE_LATENCY_S",
    "INTRA_NODE_LATENCY_S",
    "Calibration",
    "Measurement",
    "StepTime",
    "calibrate",
    "fit_time_model",
    "step_time",
]

# fit_time_model's extra terms (FIT_TERMS) are added one at a time, each only when it cuts the relative RMS error of
# the fit so far by FIT_MIN_GAIN or more, and only with at least two more measurements than fitted parameters.
FIT_TERMS = ("latency", "overhead")
FIT_MIN_GAIN = 1.25
EXACT_FIT = 1e-9  # a relative RMS error this small leaves nothing for another term to explain


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
    overhead_s: float = 0.0  # the cluster's fixed per-step overhead (fitted from measurements; 0 by default)

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
        unit = 2 * allgather_s(boundary, t, cluster.intra_node_gbps, cluster.intra_node_latency_s)
    else:
        unit = allreduce_s(boundary, t, cluster.intra_node_gbps, cluster.intra_node_latency_s)
    block_units = 4 * n + 2 * recomputed

    p2p = 0.0
    if cand.pp > 1:
        inter = cand.tp * cand.dp * cand.pp > cluster.gpus_per_node  # a pipeline spanning nodes crosses a NIC
        gbps = cluster.inter_node_gbps if inter else cluster.intra_node_gbps
        latency = cluster.inter_node_latency_s if inter else cluster.intra_node_latency_s
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
    latency = cluster.intra_node_latency_s if within_node else cluster.inter_node_latency_s
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
            cluster.inter_node_latency_s if inter else cluster.intra_node_latency_s,
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
    step = slots * slowest.total_s + dp + cluster.step_overhead_s
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
        overhead_s=cluster.step_overhead_s,
    )


@dataclass(frozen=True)
class Measurement:
    """A measured step of a known configuration, for :func:`calibrate`."""

    model: ModelSpec
    cluster: Cluster
    candidate: Candidate
    global_batch_size: int
    step_time_s: float


@dataclass(frozen=True)
class Calibration:
    """What :func:`fit_time_model` found: the fitted constants and how well they explain the measured runs."""

    efficiency: float
    intra_node_latency_s: float | None  # fitted cost of each collective or send in a node (None: not fitted)
    step_overhead_s: float  # fitted fixed time per step (0 when not fitted)
    num_measurements: int
    rms_error: float  # relative RMS error of the chosen fit: sqrt(mean(((predicted - measured) / measured)^2))
    rms_error_efficiency_only: float  # the same for the efficiency-only fit
    terms: tuple[str, ...]  # "efficiency" plus the extra terms kept, in the order they were added
    note: str  # one line: why the extra terms were kept or left out

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the fitted constants."""
        latency = cluster.intra_node_latency_s if self.intra_node_latency_s is None else self.intra_node_latency_s
        return dataclasses.replace(
            cluster, efficiency=self.efficiency, intra_node_latency_s=latency, step_overhead_s=self.step_overhead_s
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parts(meas: Measurement) -> tuple[float, float, float]:
    """(C, N, B) with predicted step = C / efficiency + N x intra-node latency + B (+ overhead).

    C is the critical-path compute at peak, N the number of intra-node collectives and sends on the critical path,
    B the rest (bandwidth terms, inter-node latencies).  The step is linear in 1/efficiency and in the latency, so
    two evaluations of :func:`step_time` separate them.
    """
    base = dataclasses.replace(meas.cluster, efficiency=1.0, step_overhead_s=0.0, intra_node_latency_s=0.0)
    pred = step_time(meas.model, base, meas.candidate, meas.global_batch_size)
    unit = step_time(
        meas.model, dataclasses.replace(base, intra_node_latency_s=1.0), meas.candidate, meas.global_batch_size
    )
    return pred.compute_s, unit.step_s - pred.step_s, pred.step_s - pred.compute_s


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Weighted least squares (rows and rhs already weighted) by the normal equations; None when singular."""
    k = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, rhs))]
        for i in range(k)
    ]
    for col in range(k):  # Gauss-Jordan with partial pivoting on a k x k system (k <= 3)
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * max(abs(a[i][i]) for i in range(k)):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


def _fit(points: list[tuple[float, float, float, float, float]], terms: tuple[str, ...]) -> tuple[dict, float] | None:
    """Fit 1/efficiency and ``terms`` minimising the relative squared error; (parameters, RMS) or None if invalid.

    points: (C, N, B, latency in the model, measured step).  Without "latency" the model's own latency is kept.
    """
    rows, rhs = [], []
    for c, n, b, lat, m in points:
        row = [c / m]
        if "latency" in terms:
            row.append(n / m)
        else:
            b += n * lat
        if "overhead" in terms:
            row.append(1.0 / m)
        rows.append(row)
        rhs.append((m - b) / m)
    sol = _solve(rows, rhs)
    if sol is None:
        return None
    params = dict(zip(("x", *terms), sol))
    if params["x"] < 1.0 or any(params[t] < 0.0 for t in terms):  # efficiency > 1 or a negative cost
        return None
    pred = [sum(p * v for p, v in zip(sol, row)) for row in rows]  # predicted / measured
    return params, math.sqrt(sum((p - y) ** 2 for p, y in zip(pred, rhs)) / len(rows))


def fit_time_model(measurements: Iterable[Measurement], extra_terms: tuple[str, ...] = ()) -> Calibration:
    """Fit the efficiency, and any of ``extra_terms`` that clearly help, to measured step times.

    The predicted step of run i is C_i x + N_i L + B_i + o with x = 1/efficiency, L the intra-node latency of a
    collective or send ("latency"), o a fixed per-step overhead ("overhead") and C_i, N_i, B_i from the model
    (:func:`_parts`).  It is linear in (x, L, o), so each fit is a closed-form weighted least squares that minimises
    the relative error sum(((predicted_i - M_i) / M_i)^2).  Starting from the efficiency alone, the extra term that
    lowers the error most is added while it divides the RMS error by FIT_MIN_GAIN or more, there are at least two
    more measurements than parameters (n >= parameters + 2), and every constant stays physical (efficiency <= 1,
    L >= 0, o >= 0).  Terms not fitted keep the cluster's values.
    """
    unknown = set(extra_terms) - set(FIT_TERMS)
    if unknown:
        raise ValueError(f"fit_time_model: unknown terms {sorted(unknown)}; choose from {FIT_TERMS}")
    points = []
    for meas in measurements:
        if not meas.step_time_s > 0:
            raise ValueError(f"calibrate: measured step time must be positive, got {meas.step_time_s}")
        points.append((*_parts(meas), meas.cluster.intra_node_latency_s, meas.step_time_s))
    if not points:
        raise ValueError("calibrate: no measurements given; pass at least one Measurement")
    if sum(c * (m - b - n * lat) / m**2 for c, n, b, lat, m in points) <= 0.0:
        raise ValueError("calibrate: the measured steps are faster than their communication alone; check the inputs")
    plain = _fit(points, ())
    if plain is None:
        x = sum(c * (m - b - n * lat) / m**2 for c, n, b, lat, m in points) / sum(c * c / m**2 for c, *_, m in points)
        raise ValueError(
            f"calibrate: fitted efficiency {1 / x:.2f} > 1: the measured steps beat the peak; check peak_tflops"
        )
    chosen, (params, rms), notes = (), plain, []
    while rms > EXACT_FIT:
        options = []
        for term in extra_terms:
            if term in chosen:
                continue
            trial = (*chosen, term)
            if len(points) < len(trial) + 3:
                notes.append(f"{term}: needs {len(trial) + 3} runs")
                continue
            fitted = _fit(points, tuple(t for t in FIT_TERMS if t in trial))
            if fitted is None:
                notes.append(f"{term}: would be negative or beat the peak")
                continue
            options.append((fitted[1], term, fitted[0]))
        if not options:
            break
        best_rms, term, best = min(options)
        if best_rms * FIT_MIN_GAIN > rms:
            notes.append(f"{term}: cuts the error only to {best_rms:.1%} from {rms:.1%}")
            break
        chosen, params, rms = (*chosen, term), best, best_rms
        notes = []
    kept = ("efficiency", *chosen)
    note = "fitted: " + " + ".join(kept)
    if extra_terms and notes:
        note += " (left out: " + "; ".join(dict.fromkeys(notes)) + ")"
    return Calibration(
        efficiency=1.0 / params["x"],
        intra_node_latency_s=params.get("latency"),
        step_overhead_s=params.get("overhead", 0.0),
        num_measurements=len(points),
        rms_error=rms,
        rms_error_efficiency_only=plain[1],
        terms=kept,
        note=note,
    )


def calibrate(measurements: Iterable[Measurement]) -> float:
    """The achieved-efficiency factor that best explains measured step times.

    The predicted step is C / e + R, C the critical-path compute at peak and R everything else (communication), so
    e is fitted in closed form by least squares on x = 1/e, weighting each run by 1/M^2 (relative errors):
    x = sum(C_i (M_i - R_i) / M_i^2) / sum(C_i^2 / M_i^2).  Pass the result as ``--efficiency`` (or
    ``Cluster.efficiency``) to rank with your cluster's numbers; :func:`fit_time_model` can also fit the
    collective latency and a fixed per-step overhead.
    """
    return fit_time_model(measurements).efficiency
