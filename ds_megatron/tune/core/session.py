"""The empirical session both halves run (docs/tuner.md, "Empirical mode"): the device, the options' checks, the
time budget of each launch, the recalibration's fallback, the rank correlation, the final ranking's rule (measured
where measured, predicted otherwise, failed runs left out) and what a session records.  Standard library only:
``--device auto`` asks torch about GPUs in a subprocess."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_megatron.config import ConfigError

REPORT_RESERVE_S = 5.0  # kept back from the budget for the recalibrated search and the report
MIN_LAUNCH_S = 10.0  # no launch finishes faster (launcher, imports, process group, data): do not start one
FIRST_RUN_S = 120.0  # timeout floor before any run has finished (it builds the tokenizer/corpus cache)
HANG_FACTOR = 3.0  # later runs may take this many times the slowest finished run before they count as hung
DEVICES = ("auto", "cpu", "gpu")
NOT_RUN = "not run"
NOT_RUN_REASON = "not run: the --max-minutes budget would be exceeded"
NOTHING_MEASURED = "no candidate was measured: the analytic model is kept"


@dataclass
class Session:
    """What an empirical session found; each half adds its own figures and its ``as_dict``."""

    options: Any  # the half's options: device resolved ("cpu" | "gpu"), work_dir set
    budget_s: float
    runs: list  # the half's runs, each with ``index`` and ``status``
    calibration: Any = None  # core.calibration.Calibration, None when nothing was fitted
    calibration_note: str = ""  # why there is no calibration, when there is none
    recalibrated: Any = None  # the half's search again at the fitted constants
    final: list = field(default_factory=list)  # the final ranking, each entry with ``source`` and ``as_dict``
    elapsed_s: float = 0.0  # since the command started (the budget's clock)

    @property
    def not_run(self) -> list[int]:
        return [r.index for r in self.runs if r.status == NOT_RUN]

    def budget_dict(self) -> dict:
        o = self.options
        return {"max_minutes": o.max_minutes, "elapsed_s": self.elapsed_s, "work_dir": o.work_dir}

    def outcome_dict(self, top: int, correlations: dict, winner) -> dict:
        cal = self.calibration
        return {
            "calibration": dataclasses.asdict(cal) if cal else None,
            "calibration_note": self.calibration_note,
            **correlations,
            "final_ranking": [f.as_dict() for f in self.final[:top]],
            "winner": winner.as_dict() if winner else None,
        }


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None for fewer than 2 points or a constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} x values but {len(ys)} y values")
    try:
        return statistics.correlation(_ranks(xs), _ranks(ys))
    except statistics.StatisticsError:  # fewer than 2 points, or a constant
        return None


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average: c equal values from sorted position i all rank i + (c + 1) / 2."""
    order = sorted(values)
    return [order.index(v) + (order.count(v) + 1) / 2 for v in values]


def plan_timeout(remaining_s: float, left: int, durations: list[float]) -> float | None:
    """Timeout of the next run, or None when it should not start (docs/tuner.md, "Budget").  ``remaining_s``: budget
    left after the report reserve; ``left``: runs to go (this one too); ``durations``: measured runs' wall times."""
    expected = statistics.median(durations) if durations else 0.0
    if remaining_s < max(MIN_LAUNCH_S, expected):
        return None
    floor = HANG_FACTOR * max(durations) if durations else FIRST_RUN_S
    return min(remaining_s, max(remaining_s / max(left, 1), floor))


@dataclass
class Budget:
    """The launches' clock: ``deadline`` (a time.monotonic() value) and the wall times of the finished launches."""

    deadline: float
    durations: list[float] = field(default_factory=list)

    def next_timeout(self, left: int) -> tuple[float | None, float]:
        """(the next launch's timeout, None when it should not start; the seconds left after the report reserve)."""
        remaining = self.deadline - time.monotonic() - REPORT_RESERVE_S
        return plan_timeout(remaining, left, self.durations), remaining

    def elapsed_s(self, max_minutes: float) -> float:
        """Seconds used of the whole command's budget, which ends at the deadline."""
        return time.monotonic() - (self.deadline - 60 * max_minutes)


@functools.cache  # asked once per process: the command line resolves it before the search, the session again
def resolve_device(device: str, num_gpus: int) -> str:
    """``auto`` becomes ``gpu`` when torch (asked in a subprocess of this interpreter) sees a CUDA device, else ``cpu``;
    a GPU run needs enough devices."""
    if device not in DEVICES:
        raise ConfigError("--device", "unknown device", repr(device), f"use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    probe_cmd = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        proc = subprocess.run([sys.executable, "-c", probe_cmd], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise ConfigError("--device", "importing torch timed out", "300 s", "pass --device cpu or gpu") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError("--empirical", "cannot import torch to look for GPUs", last, "install torch and deepspeed")
    count = int(proc.stdout.strip().splitlines()[-1])
    if device == "auto" and count == 0:
        return "cpu"
    if count < num_gpus:
        raise ConfigError(
            "--device", "not enough GPUs on this machine", f"{count} visible, --gpus {num_gpus}", "lower --gpus"
        )
    return "gpu"


def work_dir(given: str | None, suffix: str = "") -> Path:
    """The session's directory: ``--empirical-dir``, else ``runs/tune/<date-time><suffix>``."""
    return Path(given or f"runs/tune/{time.strftime('%Y%m%d-%H%M%S')}{suffix}")


def check_budget(max_minutes: float, counts: Iterable[tuple[str, int, int]]) -> None:
    """Refuse a budget that is not positive and (flag, value, least) counts below their least."""
    if not max_minutes > 0:
        raise ConfigError("--max-minutes", "must be positive", f"got {max_minutes}", "pass e.g. 10")
    for flag, value, least in counts:
        if value < least:
            raise ConfigError(flag, f"must be at least {least}", f"got {value}", f"pass e.g. {max(least, 3)}")


def check_one_node(num_gpus: int, gpus_per_node: int) -> None:
    """The measuring runs launch on this machine only."""
    if num_gpus > gpus_per_node:
        raise ConfigError(
            "--empirical",
            "runs on this machine only",
            f"gpus={num_gpus} > gpus_per_node={gpus_per_node}",
            "measure a one-node problem (--gpus <= --gpus-per-node) or drop --empirical",
        )


def fit_or_keep(measured: list, fit: Callable[[], Any]) -> tuple[Any, str]:
    """(the calibration ``fit()`` gives, ""), or (None, why the analytic model is kept)."""
    if not measured:
        return None, NOTHING_MEASURED
    try:
        return fit(), ""
    except ValueError as err:
        return None, f"calibration failed, the analytic model is kept: {err}"


def measured_or_predicted(
    ranked: Iterable, key: Callable[[Any], Hashable], measured: dict, failed: set, predicted: Callable[[Any], Any]
) -> list[tuple[Any, Any, str]]:
    """(candidate, value, source) of the recalibrated ranking's candidates: the measured value where a run measured
    one, the recalibrated prediction otherwise; the candidates whose run failed left out.  Each half orders them,
    a measurement before a prediction of the same figures."""
    return [
        (e, measured[k], "measured") if k in measured else (e, predicted(e), "predicted")
        for e in ranked
        if (k := key(e)) not in failed
    ]
