"""Calibration of the training time model: the measured step times of known configurations, fitted by the core's
fit (:func:`fit_time_model`, ``core.calibration.fit_parts``).  Pure Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.tune.core.calibration import Calibration, fit_parts
from ds_megatron.tune.core.spec import Candidate, Cluster
from ds_megatron.tune.training.time_model import step_time


@dataclass(frozen=True)
class Measurement:
    """A measured step of a known configuration, for :func:`calibrate`."""

    model: ModelShape
    cluster: Cluster
    candidate: Candidate
    global_batch_size: int
    step_time_s: float


# Rounds of fit_time_model's fixed point at most; it stops once the fitted constants hold still.
FIT_ROUNDS = 50


def _parts(meas: Measurement, at: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """(C, N, B) with predicted step = C / efficiency + N x intra-node latency + B (+ overhead).  The step is linear
    in 1/efficiency and in the latency but for the overlapped data-parallel reduction (``time_model.dp_comm_s``: how
    much of it shows depends on how long the last backward runs and on each bucket's latency), so the parts are
    taken at a point ``at`` = (efficiency, latency): C at efficiency 1, N as the step's slope in the latency there
    and B the rest there.  Without ``at``, from the step at latency 0 and 1 s (exact where the step is linear)."""
    base = dataclasses.replace(meas.cluster, efficiency=1.0, step_overhead_s=0.0, intra_node_latency_s=0.0)
    pred = step_time(meas.model, base, meas.candidate, meas.global_batch_size)
    if at is None:
        unit = step_time(
            meas.model, dataclasses.replace(base, intra_node_latency_s=1.0), meas.candidate, meas.global_batch_size
        )
        return pred.compute_s, unit.step_s - pred.step_s, pred.step_s - pred.compute_s
    efficiency, latency = at
    step = [
        step_time(
            meas.model,
            dataclasses.replace(base, efficiency=efficiency, intra_node_latency_s=lat),
            meas.candidate,
            meas.global_batch_size,
        ).step_s
        for lat in (latency, latency + max(latency, 1e-6))
    ]
    slope = (step[1] - step[0]) / max(latency, 1e-6)
    return pred.compute_s, slope, step[0] - pred.compute_s / efficiency - slope * latency


def fit_time_model(measurements: Iterable[Measurement], extra_terms: tuple[str, ...] = ()) -> Calibration:
    """Fit the efficiency, and each of ``extra_terms`` (core.calibration.FIT_TERMS) that clearly helps, to measured
    step times; terms not fitted keep the cluster's values.  The selection rule is in docs/tuner.md, "Calibrating".
    A fixed point: the first fit uses the parts of the step that is linear in the constants (``_parts``), each next
    one the parts taken again at what the previous fit found, until it finds the same (the overlapped reduction's
    share bends the line)."""
    measurements = list(measurements)
    for meas in measurements:
        if not meas.step_time_s > 0:
            raise ValueError(f"calibrate: measured step time must be positive, got {meas.step_time_s}")
    ats: list = [None] * len(measurements)
    fit = None
    for _ in range(FIT_ROUNDS):
        points = [(*_parts(m, at), m.cluster.intra_node_latency_s, m.step_time_s) for m, at in zip(measurements, ats)]
        last, fit = fit, fit_parts(points, extra_terms)
        if last is not None and _same(last, fit):
            break
        latency = fit.intra_node_latency_s
        ats = [(fit.efficiency, m.cluster.intra_node_latency_s if latency is None else latency) for m in measurements]
    return fit


def _same(a, b, rel: float = 1e-12) -> bool:
    """Whether two fits found the same constants (to ``rel``)."""
    pairs = [(a.efficiency, b.efficiency), (a.step_overhead_s, b.step_overhead_s)]
    pairs.append((a.intra_node_latency_s or 0.0, b.intra_node_latency_s or 0.0))
    return a.terms == b.terms and all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in pairs)


def calibrate(measurements: Iterable[Measurement]) -> float:
    """The ceiling of the matmul-efficiency curve that best explains measured step times (``--efficiency``)."""
    return fit_time_model(measurements).efficiency
