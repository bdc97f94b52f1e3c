"""The loss picture (ds_megatron/plot.py) without processes: a valid PNG, series where the axes put them, and no crash
on degenerate metrics."""

from __future__ import annotations

import json
import math
import struct
import zlib

import pytest

from ds_megatron.plot import TRAIN_COLOR, VAL_COLOR, WHITE, draw_loss_plot, nice_ticks, read_records, write_loss_plot


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG, checking the signature and every chunk's CRC."""
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
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)  # filter type 0: the bytes are the pixels
    return width, height, [row[1:] for row in rows]


def pixel(rows: list[bytes], x: int, y: int) -> tuple:
    return tuple(rows[y][3 * x : 3 * x + 3])


def demo_records() -> list[dict]:
    train = [{"step": s, "loss": 4.6 + 2.3 * math.exp(-s / 50), "lr": 1e-3} for s in range(10, 201, 10)]
    return train + [{"step": 100, "val_loss": 5.2, "val_ppl": 181.0}, {"step": 200, "val_loss": 4.9}]


def test_png_is_valid_and_series_are_drawn(tmp_path):
    records = demo_records()
    path = write_loss_plot(records, tmp_path / "loss.png")
    width, height, rows = decode_png(path.read_bytes())
    assert (width, height) == (640, 400)
    _, ax = draw_loss_plot(records)
    for r in records:
        if "loss" in r:
            assert pixel(rows, *ax.px(r["step"], r["loss"])) == TRAIN_COLOR, r
        else:
            assert pixel(rows, *ax.px(r["step"], r["val_loss"])) == VAL_COLOR, r
    # between two training points the line is drawn too, and far from the data the canvas is background
    mid_x, mid_y = ax.px(15, (records[0]["loss"] + records[1]["loss"]) / 2)
    assert any(pixel(rows, mid_x, y) == TRAIN_COLOR for y in range(mid_y - 3, mid_y + 4))
    assert pixel(rows, width - 3, height - 3) == WHITE
    # ticks, labels and legend: dark pixels left of the y axis, under the x axis and in the top band
    dark = [(x, y) for y in range(height) for x in range(width) if sum(pixel(rows, x, y)) < 100]
    assert any(x < ax.left - 5 for x, _ in dark) and any(y > ax.bottom + 5 for _, y in dark)
    assert any(y < ax.top and x > width // 2 for x, y in dark)


def test_reads_metrics_jsonl_and_later_records_win(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in demo_records()]
    lines += [json.dumps({"step": 200, "loss": 9.0}), '{"step": 210, "lo']  # a resume re-logged 200; a torn line
    metrics.write_text("\n".join(lines) + "\n")
    records = read_records(metrics)
    assert len(records) == len(demo_records()) + 1
    canvas, ax = draw_loss_plot(records)
    assert ax.y1 > 9.0  # the re-logged step replaced the first value
    assert canvas.pixel(*ax.px(200, 9.0)) == TRAIN_COLOR


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{"step": 1, "loss": 3.0}],
        [{"step": 5, "val_loss": 2.5}, {"step": 9, "val_loss": 2.0}],
        [{"step": 1, "loss": float("nan")}, {"step": 2, "loss": float("inf")}, {"step": 3, "loss": 4.0}],
        [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 2.0}, {"sample": "text"}, {"step": 3, "val_loss": None}],
        [{"step": 1, "loss": float("nan")}],
    ],
    ids=["empty", "one-point", "only-validation", "nan-and-inf", "flat-and-odd-records", "only-nan"],
)
def test_degenerate_inputs_still_make_a_picture(tmp_path, records):
    path = write_loss_plot(records, tmp_path / "loss.png")
    _, _, rows = decode_png(path.read_bytes())
    _, ax = draw_loss_plot(records)
    for r in records:
        for key, color in (("loss", TRAIN_COLOR), ("val_loss", VAL_COLOR)):
            if isinstance(r.get(key), float) and math.isfinite(r[key]):
                assert pixel(rows, *ax.px(r["step"], r[key])) == color, r


def test_ticks_are_round_numbers():
    ticks, decimals = nice_ticks(4.51, 6.93)
    assert ticks == pytest.approx([5.0, 5.5, 6.0, 6.5]) and decimals == 1
    ticks, decimals = nice_ticks(6.2, 199.8, least=1)
    assert ticks == [50, 100, 150] and decimals == 0
    assert nice_ticks(4.0, 6.0, least=1) == ([4, 5, 6], 0)  # steps never get fractional ticks
