"""The run's figure (ds_megatron/plot.py) without processes: a valid PNG of the expected size, each panel drawing
exactly the logged finite points against tokens, no crash on degenerate metrics, and a failed drawing that neither
destroys the previous figure nor stops the run."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_megatron import plot
from ds_megatron.plot import DPI, PANELS, SIZE_INCHES, draw_figure, figure_series, read_records, write_loss_plot

WIDTH, HEIGHT = round(SIZE_INCHES[0] * DPI), round(SIZE_INCHES[1] * DPI)
TOKENS_PER_STEP = 16 * 128  # the demo's global batch x sequence


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, after checking the signature, every chunk's CRC, the chunk order and that the pixel
    data inflates to exactly height rows of the header's width."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[0][1])
    channels = {2: 3, 6: 4}[color]  # RGB or RGBA
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert depth == 8 and len(raw) == height * (1 + channels * width)
    return width, height


def demo_records() -> list[dict]:
    """What the trainer logs: a training record every 10 steps, validation at 100 inside the step's record and at the
    end in a record of its own, then the sample record."""
    train = [
        {
            "step": s,
            "loss": 4.6 + 2.3 * math.exp(-s / 50),
            "lr": 1e-3 * min(1.0, s / 50),
            "grad_norm": 1.0 + 3.0 * math.exp(-s / 30),
            "tokens_per_s": 9000.0 + 10 * s,
        }
        for s in range(10, 201, 10)
    ]
    train[9].update(val_loss=5.2, val_ppl=181.0)
    return train + [{"step": 200, "val_loss": 4.9, "val_ppl": 134.3}, {"step": 200, "sample": "text"}]


def panels(fig) -> dict[str, object]:
    """The four panels by record key, row by row (the step axes on top are not among the figure's axes)."""
    assert len(fig.axes) == len(PANELS)
    assert all(ax.get_ylabel().startswith(label) for ax, (_, label) in zip(fig.axes, PANELS))
    return {key: ax for ax, (key, _) in zip(fig.axes, PANELS)}


def points(ax) -> dict[str, list[tuple[float, float]]]:
    return {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines}


def test_figure_is_a_png_of_the_expected_size(tmp_path):
    path = write_loss_plot(demo_records(), tmp_path / "loss.png", TOKENS_PER_STEP, "gpt_tiny")
    assert path == tmp_path / "loss.png" and png_size(path.read_bytes()) == (WIDTH, HEIGHT) == (1000, 650)
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # nothing partial left next to it


def test_each_panel_draws_the_logged_points_against_tokens():
    records = demo_records()
    records[4]["grad_norm"] = float("nan")  # a skipped step logs a NaN norm: no point, the rest of the step stays
    fig = draw_figure(records, TOKENS_PER_STEP, "gpt_tiny")
    by_key = panels(fig)
    steps = range(10, 201, 10)
    loss = points(by_key["loss"])
    assert loss["training"] == [(s * TOKENS_PER_STEP, pytest.approx(4.6 + 2.3 * math.exp(-s / 50))) for s in steps]
    assert loss["validation"] == [(100 * TOKENS_PER_STEP, 5.2), (200 * TOKENS_PER_STEP, 4.9)]
    for key, count in (("lr", 20), ("grad_norm", 19), ("tokens_per_s", 20)):
        (line,) = points(by_key[key]).values()
        expected = [(r["step"] * TOKENS_PER_STEP, r[key]) for r in records if math.isfinite(r.get(key, math.nan))]
        assert line == expected and len(line) == count, key
    # the learning rate's power of ten is in its label, its ticks are the mantissas
    assert by_key["lr"].get_ylabel() == r"learning rate ($\times 10^{-3}$)"
    assert by_key["lr"].yaxis.get_major_formatter()(5e-4, 0) == "0.5"
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "", "tokens", "tokens"]
    assert [ax.child_axes[0].get_xlabel() for ax in fig.axes[:2]] == ["step", "step"]  # the top row's step axis
    title = fig.get_suptitle()
    assert title.startswith("gpt_tiny: step 200, 409.6 k tokens") and "training loss 4.642" in title, title
    assert title.endswith("validation loss 4.900"), title
    # without the tokens per step the x axis is the step
    fig = draw_figure(records)
    assert points(panels(fig)["loss"])["validation"] == [(100, 5.2), (200, 4.9)]
    assert fig.axes[2].get_xlabel() == "step" and not fig.axes[0].child_axes


def test_reads_metrics_jsonl_and_later_records_win(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in demo_records()]
    lines += [json.dumps({"step": 200, "loss": 9.0, "lr": 2e-4}), '{"step": 210, "lo']  # a resume re-logged 200; torn
    metrics.write_text("\n".join(lines) + "\n")
    records = read_records(metrics)
    assert len(records) == len(demo_records()) + 1
    series = figure_series(records)
    assert {k: len(v) for k, v in series.items()} == {
        "loss": 20,
        "val_loss": 2,
        "lr": 20,
        "grad_norm": 20,
        "tokens_per_s": 20,
    }
    assert series["loss"][-1] == (200, 9.0) and series["lr"][-1] == (200, 2e-4)
    assert series["grad_norm"][-1] == (200, pytest.approx(1.0 + 3.0 * math.exp(-200 / 30)))  # kept from the first


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 100.0}],
        [{"step": 5, "val_loss": 2.5}, {"step": 9, "val_loss": 2.0}],
        [{"step": 1, "loss": float("nan")}, {"step": 2, "loss": float("inf")}, {"step": 3, "loss": 4.0}],
        [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 2.0}, {"sample": "text"}, {"step": 3, "val_loss": None}],
        [{"step": 1, "loss": float("nan")}, {"step": True, "loss": 1.0}, {"step": 2, "lr": "1e-3"}],
    ],
    ids=["empty", "one-point", "only-validation", "nan-and-inf", "flat-and-odd-records", "nothing-finite"],
)
def test_degenerate_inputs_still_make_a_figure(tmp_path, records):
    path = write_loss_plot(records, tmp_path / "loss.png", TOKENS_PER_STEP, "odd")
    assert png_size(path.read_bytes()) == (WIDTH, HEIGHT)
    fig = draw_figure(records, TOKENS_PER_STEP, "odd")
    series = figure_series(records)
    for key, ax in panels(fig).items():
        keys = (key, "val_loss") if key == "loss" else (key,)
        assert sum(len(line.get_xdata()) for line in ax.lines) == sum(len(series[k]) for k in keys), key
        # a panel without a point says so rather than showing an empty box
        assert bool(ax.lines) != any(t.get_text() == "no finite values logged" for t in ax.texts), key
        # a lone point draws no line segment: it must carry a marker to be visible
        assert all(len(line.get_xdata()) > 1 or line.get_marker() == "o" for line in ax.lines), key


def test_a_failed_drawing_keeps_the_previous_figure(tmp_path, monkeypatch):
    path = write_loss_plot(demo_records(), tmp_path / "loss.png", TOKENS_PER_STEP, "gpt_tiny")
    before = path.read_bytes()

    class Breaks:
        def savefig(self, target, **kwargs):
            Path(target).write_bytes(before[:100])  # half a file, then the failure
            raise OSError("disk full")

    monkeypatch.setattr(plot, "draw_figure", lambda *args: Breaks())
    with pytest.raises(OSError, match="disk full"):
        write_loss_plot(demo_records(), path, TOKENS_PER_STEP, "gpt_tiny")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_the_trainer_draws_the_figure_or_warns_and_goes_on(tmp_path, capsys, monkeypatch):
    """Trainer.plot passes the tokens per step and the run's name; when the figure cannot be written (here loss.png
    is a directory) it prints one warning and returns."""
    from ds_megatron import trainer as trainer_module
    from ds_megatron.metrics import MetricsLogger
    from ds_megatron.trainer import Trainer

    calls = []

    def recorded(records, path, tokens_per_step, title):
        calls.append((len(records), tokens_per_step, title))
        return write_loss_plot(records, path, tokens_per_step, title)

    monkeypatch.setattr(trainer_module, "write_loss_plot", recorded)

    run = SimpleNamespace(
        global_batch_size=16,
        model=SimpleNamespace(seq_length=128),
        section=SimpleNamespace(logging=SimpleNamespace(wandb_run_name=None)),
    )
    logger = MetricsLogger(tmp_path / "gpt_tiny", 200, 0, True, None)
    for record in demo_records():
        logger.log(record)
    trainer = SimpleNamespace(run=run, logger=logger)
    Trainer.plot(trainer)
    png = tmp_path / "gpt_tiny" / "loss.png"
    assert png_size(png.read_bytes()) == (WIDTH, HEIGHT)
    assert f"loss curve | {png} (" in capsys.readouterr().out
    assert calls == [(len(demo_records()), TOKENS_PER_STEP, "gpt_tiny")]  # no wandb name: the run directory's
    png.unlink()
    png.mkdir()
    Trainer.plot(trainer)
    assert capsys.readouterr().out.startswith("warning: loss curve not drawn: IsADirectoryError")
    logger.close()


def test_importing_the_module_does_not_import_matplotlib():
    """The trainer imports ds_megatron.plot on every rank; matplotlib loads only on the rank that draws."""
    code = "import sys, ds_megatron.plot; print('matplotlib' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
