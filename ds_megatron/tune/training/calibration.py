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


def _parts(meas: Measurement) -> tuple[float, float, float]:
    """(C, N, B) with predicted step = C / efficiency + N x intra-node latency + B (+ overhead): the step is linear in
    1/efficiency and in the latency, so two evaluations of :func:`step_time` separate them."""
    base = dataclasses.replace(meas.cluster, efficiency=1.0, step_overhead_s=0.0, intra_node_latency_s=0.0)
    pred = step_time(meas.model, base, meas.candidate, meas.global_batch_size)
    unit = step_time(
        meas.model, dataclasses.replace(base, intra_node_latency_s=1.0), meas.candidate, meas.global_batch_size
    )
    return pred.compute_s, unit.step_s - pred.step_s, pred.step_s - pred.compute_s


def fit_time_model(measurements: Iterable[Measurement], extra_terms: tuple[str, ...] = ()) -> Calibration:
    """Fit the efficiency, and each of ``extra_terms`` (core.calibration.FIT_TERMS) that clearly helps, to measured
    step times; terms not fitted keep the cluster's values.  The selection rule is in docs/tuner.md, "Calibrating"."""
    points = []
    for meas in measurements:
        if not meas.step_time_s > 0:
            raise ValueError(f"calibrate: measured step time must be positive, got {meas.step_time_s}")
        points.append((*_parts(meas), meas.cluster.intra_node_latency_s, meas.step_time_s))
    return fit_parts(points, extra_terms)


def calibrate(measurements: Iterable[Measurement]) -> float:
    """The ceiling of the matmul-efficiency curve that best explains measured step times (``--efficiency``)."""
    return fit_time_model(measurements).efficiency
