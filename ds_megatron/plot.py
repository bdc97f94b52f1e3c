"""L3: the figure of a run, ``loss.png``, drawn with matplotlib from the records of ``metrics.jsonl``.

Four panels sharing one x axis, the tokens trained on (step x tokens per step; the step itself when the caller does
not know the tokens per step): training and validation loss, learning rate, gradient norm and tokens/s.

matplotlib is imported only when a figure is drawn (the trainer imports this module on every rank), and only its object
API on the Agg canvas is used: no pyplot, hence no GUI backend to pick, no display and no global list of open figures
on a training node.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (record key, y label) of each panel, row by row; the loss panel also draws "val_loss".
PANELS = (
    ("loss", "loss (cross-entropy, nats/token)"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm (global L2)"),
    ("tokens_per_s", "tokens/s"),
)
SERIES_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")
SIZE_INCHES, DPI = (10.0, 6.5), 100  # a 1000 x 650 pixel PNG
TRAIN_COLOR, VAL_COLOR = "tab:blue", "tab:orange"


def read_records(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a line a crashed run left half-written is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def figure_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """For each key of SERIES_KEYS, its (step, value) points sorted by step, finite values only (a skipped step logs
    a NaN gradient norm).  A resumed run appends to the same file and may log a step twice (those after its
    checkpoint); the later record wins."""
    series: dict[str, dict[int, float]] = {key: {} for key in SERIES_KEYS}
    for r in records:
        step = r.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool)):
            continue
        for key, points in series.items():
            v = r.get(key)
            if _is_number(v) and math.isfinite(v):
                points[step] = float(v)
    return {key: sorted(points.items()) for key, points in series.items()}


def _title(
    name: str, series: dict[str, list[tuple[int, float]]], tokens_per_step: int | None, eng: Callable[[float], str]
) -> str:
    """The run's name and where it ended: last step, tokens (written by ``eng``, the axes' formatter), last training
    and validation loss."""
    last = max((s for points in series.values() for s, _ in points), default=None)
    if last is None:
        return f"{name}: no finite values logged"
    parts = [f"step {last:,}"]
    if tokens_per_step:
        parts.append(f"{eng(last * tokens_per_step)} tokens")
    for key, label in (("loss", "training loss"), ("val_loss", "validation loss")):
        if series[key]:
            parts.append(f"{label} {series[key][-1][1]:.3f}")
    return f"{name}: " + ", ".join(parts)


def draw_figure(records: list[dict], tokens_per_step: int | None = None, title: str = "run") -> Figure:
    """The four-panel ``matplotlib.figure.Figure`` of ``records``; a panel without finite values says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

    series = figure_series(records)
    scale = tokens_per_step or 1
    fig = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    for ax, (key, ylabel) in zip(axes, PANELS):
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        lines = [(key, "training" if key == "loss" else None, TRAIN_COLOR)]
        if key == "loss":
            lines.append(("val_loss", "validation", VAL_COLOR))
        for name, label, color in lines:
            points = series[name]
            if not points:
                continue
            # validation points are few and far apart, and a lone point draws no line: both get markers
            marker = "o" if name == "val_loss" or len(points) == 1 else None
            xs, ys = [s * scale for s, _ in points], [v for _, v in points]
            ax.plot(xs, ys, color=color, marker=marker, markersize=4, linewidth=1.5, label=label)
        if not ax.lines:
            ax.text(0.5, 0.5, "no finite values logged", transform=ax.transAxes, ha="center", va="center", color="0.5")
        if key == "loss" and ax.lines:
            ax.legend(loc="upper right")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and tokens are whole numbers
        ax.xaxis.set_major_formatter(EngFormatter())
    rates = [abs(v) for _, v in series["lr"] if v]
    if rates:  # the power of ten goes into the label: matplotlib's offset text above the panel covers its step axis
        exp = math.floor(math.log10(max(rates)))
        axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 10**exp:g}"))
        axes[1].set_ylabel(rf"{PANELS[1][1]} ($\times 10^{{{exp}}}$)")
    axes[3].yaxis.set_major_formatter(EngFormatter())
    for ax in axes[2:]:
        ax.set_xlabel("tokens" if tokens_per_step else "step")
    for ax in axes[:2] if tokens_per_step else ():  # the step on top, to read against the console and metrics.jsonl
        ax.secondary_xaxis("top", functions=(lambda t: t / scale, lambda s: s * scale)).set_xlabel("step")
    fig.suptitle(_title(title, series, tokens_per_step, EngFormatter()))
    return fig


def write_loss_plot(
    records: list[dict], path: str | Path, tokens_per_step: int | None = None, title: str = "run"
) -> Path:
    """Draw the records' figure into the PNG file ``path`` and return the path.  The PNG is written next to it and
    renamed over it, so a drawing that fails leaves the previous figure (a resumed run's first part) in place."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        draw_figure(records, tokens_per_step, title).savefig(partial, format="png", dpi=DPI)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path
