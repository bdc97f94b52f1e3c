"""The calibration fit both halves use: the ceiling of the matmul-efficiency curve, and optionally the collective
latency and a fixed overhead, fitted to measured times that are linear in those constants (:func:`fit_parts`;
docs/tuner.md, "Calibrating").  Pure Python."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ds_megatron.tune.core.spec import Cluster

# The extra terms a fit may keep: the intra-node latency of a collective or send, and a fixed overhead per step.
FIT_TERMS = ("latency", "overhead")
FIT_MIN_GAIN = 1.25  # an extra term is kept only when it divides the relative RMS error by this much
EXACT_FIT = 1e-9  # a relative RMS error this small leaves nothing for another term to explain


@dataclass(frozen=True)
class Calibration:
    """What a fit found: the fitted constants and how well they explain the measured runs."""

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
    """Fit 1/efficiency and ``terms`` to points (C, N, B, model latency, measured step) minimising the relative squared
    error; (parameters, RMS) or None if singular or unphysical.  Without "latency" the model's own latency is kept."""
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


def fit_parts(
    points: list[tuple[float, float, float, float, float]], extra_terms: tuple[str, ...] = (), unit: str = "runs"
) -> Calibration:
    """The fit behind :func:`fit_time_model` for any time that is linear in the constants: each point is (C, N, B,
    the model's latency, measured seconds) with predicted = C / efficiency + N x latency + B (+ overhead); the
    inference tuner's TTFT and TPOT use it too.  ``unit`` names a point in the notes ("needs 5 runs")."""
    if unknown := set(extra_terms) - set(FIT_TERMS):
        raise ValueError(f"fit_time_model: unknown terms {sorted(unknown)}; choose from {FIT_TERMS}")
    if not points:
        raise ValueError("calibrate: no measurements given; pass at least one Measurement")
    # The efficiency-only fit solves x * sum(C^2 / M^2) = rhs; rhs <= 0 leaves no time for the matmuls.
    rhs = sum(c * (m - b - n * lat) / m**2 for c, n, b, lat, m in points)
    if rhs <= 0.0:
        raise ValueError("calibrate: the measured steps are faster than their communication alone; check the inputs")
    plain = _fit(points, ())
    if plain is None:
        x = rhs / sum(c * c / m**2 for c, *_, m in points)
        raise ValueError(
            f"calibrate: fitted efficiency {1 / x:.2f} > 1: the measured steps beat the peak; check peak_tflops"
        )
    chosen, (params, rms), notes = (), plain, []
    while rms > EXACT_FIT:
        options = []
        for term in (t for t in extra_terms if t not in chosen):
            trial = (*chosen, term)
            if len(points) < len(trial) + 3:  # two more runs than fitted constants, the efficiency included
                notes.append(f"{term}: needs {len(trial) + 3} {unit}")
            elif (fitted := _fit(points, tuple(t for t in FIT_TERMS if t in trial))) is None:
                notes.append(f"{term}: would be negative or beat the peak")
            else:
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
