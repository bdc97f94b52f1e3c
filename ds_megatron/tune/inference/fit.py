"""The inference model fitted to published measurements (``tune.inference.anchors``), as the training model is
fitted to the paper's Table 5: every anchor's prediction is linear in the inverse compute efficiency, the inverse
bandwidth efficiency and its engine's overhead per forward, so one weighted least-squares solve (relative errors, the
training calibration's ``_solve``) finds them; :func:`leave_one_source_out` predicts each source's rows from a fit to
the others.  Deterministic.  Pure Python."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from ds_megatron.tune.core.calibration import _solve
from ds_megatron.tune.inference.anchors import ANCHORS, Anchor

POOLED = "pooled"  # the one overhead fitted to every engine's rows together


@dataclass(frozen=True)
class Parts:
    """predicted = compute x (1 / efficiency) + memory x (1 / bandwidth efficiency) + forwards x overhead + rest."""

    compute: float
    memory: float
    forwards: float
    rest: float


@dataclass(frozen=True)
class AnchorFit:
    efficiency: float
    bandwidth_efficiency: float
    overheads: dict[str, float]  # engine name (or POOLED) -> seconds per forward
    rms_error: float  # relative RMS error over the rows fitted

    def constants(self, engine: str) -> dict[str, float]:
        """The cluster constants an anchor of ``engine`` is predicted with (POOLED where the engine has none)."""
        overhead = self.overheads.get(engine, self.overheads.get(POOLED, 0.0))
        return dict(
            efficiency=self.efficiency, bandwidth_efficiency=self.bandwidth_efficiency, step_overhead_s=overhead
        )


def parts(anchor: Anchor) -> Parts:
    """The anchor's prediction separated into its linear terms by four evaluations of the model (the physical floors
    do not bind at efficiencies of at most 1)."""
    unit = dict(efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)
    p0 = anchor.predicted_s(anchor.cluster(**unit))
    compute = anchor.predicted_s(anchor.cluster(**(unit | {"efficiency": 0.5}))) - p0
    memory = anchor.predicted_s(anchor.cluster(**(unit | {"bandwidth_efficiency": 0.5}))) - p0
    forwards = anchor.predicted_s(anchor.cluster(**(unit | {"step_overhead_s": 1.0}))) - p0
    return Parts(compute, memory, forwards, p0 - compute - memory)


def fit_anchors(anchors: tuple[Anchor, ...] = ANCHORS, pooled: bool = False) -> AnchorFit:
    """Efficiencies (at most 1) and an overhead per engine (at least 0; one for all with ``pooled``) minimising the
    relative squared error of the anchors; a constant at its bound is held there and the rest refitted."""
    split = [(a, parts(a)) for a in anchors]
    engines = [POOLED] if pooled else sorted({a.engine for a in anchors})
    names = ["x_compute", "x_memory", *engines]
    fixed: dict[str, float] = {}
    while True:
        free = [n for n in names if n not in fixed]
        rows, rhs = [], []
        for a, p in split:
            m = a.measured_s
            column = {"x_compute": p.compute, "x_memory": p.memory, POOLED if pooled else a.engine: p.forwards}
            known = p.rest + sum(column.get(n, 0.0) * v for n, v in fixed.items())
            rows.append([column.get(n, 0.0) / m for n in free])
            rhs.append((m - known) / m)
        sol = dict(zip(free, _solve(rows, rhs) or [math.nan] * len(free)))
        bound = {n: 1.0 if n.startswith("x_") else 0.0 for n in free}
        worst = max(free, key=lambda n: bound[n] - sol[n] if not math.isnan(sol[n]) else math.inf)
        if not math.isnan(sol[worst]) and sol[worst] >= bound[worst]:
            break
        fixed[worst] = bound[worst]
    values = fixed | sol
    fit = AnchorFit(
        efficiency=1.0 / values["x_compute"],
        bandwidth_efficiency=1.0 / values["x_memory"],
        overheads={e: values[e] for e in engines},
        rms_error=0.0,
    )
    errors = [a.ratio(a.cluster(**fit.constants(a.engine))) ** -1 - 1 for a in anchors]  # predicted / measured - 1
    return dataclasses.replace(fit, rms_error=math.sqrt(sum(e * e for e in errors) / len(errors)))


@dataclass(frozen=True)
class HeldOut:
    anchor: Anchor
    predicted_s: float
    ratio: float  # measured / predicted
    pooled: bool  # predicted with the pooled fit: no other source of its engine

    @property
    def figure(self) -> str:
        """ "ttft" for a first-token latency, "tpot" for the decode figures (TPOT, batch times, throughputs)."""
        return "ttft" if self.anchor.metric == "ttft_s" else "tpot"


def leave_one_source_out(anchors: tuple[Anchor, ...] = ANCHORS) -> list[HeldOut]:
    """Each source's rows predicted by a fit to the other sources' rows; an engine no other source ran is predicted
    with the pooled fit (one overhead for every engine)."""
    out = []
    for source in dict.fromkeys(a.source for a in anchors):
        train = tuple(a for a in anchors if a.source != source)
        per_engine, pooled = fit_anchors(train), fit_anchors(train, pooled=True)
        for a in (a for a in anchors if a.source == source):
            fit = per_engine if a.engine in per_engine.overheads else pooled
            cluster = a.cluster(**fit.constants(a.engine))
            out.append(HeldOut(a, a.predicted_s(cluster), a.ratio(cluster), fit is pooled))
    return out


def error_summary(held: list[HeldOut], figure: str | None = None) -> tuple[float, float]:
    """(median, worst) |measured / predicted - 1| of the rows of ``figure`` ("ttft", "tpot"; None: all)."""
    errors = [abs(h.ratio - 1) for h in held if figure in (None, h.figure)]
    return statistics.median(errors), max(errors)
