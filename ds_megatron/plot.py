"""L3: the loss picture of a run, ``loss.png``, drawn from the records of ``metrics.jsonl`` (standard library only).

matplotlib is not a dependency and one picture does not justify adding it, so this is a tiny raster: an RGB canvas,
lines, disks and a 3x5 bitmap font (digits and the capitals of the labels), encoded as a PNG with zlib and struct.
The picture: training loss per logged step (a line), validation loss (points), ticks with labels, a legend.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (226, 226, 226)
TRAIN_COLOR, VAL_COLOR = (31, 119, 180), (230, 110, 0)

# 3x5 glyphs, one number per row from the top: bit 4 is the left column, bit 1 the right one.
FONT = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 2, 2, 2),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
    "-": (0, 0, 7, 0, 0),
    " ": (0, 0, 0, 0, 0),
    "A": (2, 5, 7, 5, 5),
    "D": (6, 5, 5, 5, 6),
    "E": (7, 4, 6, 4, 7),
    "I": (7, 2, 2, 2, 7),
    "L": (4, 4, 4, 4, 7),
    "N": (6, 5, 5, 5, 5),
    "O": (2, 5, 5, 5, 2),
    "P": (6, 5, 6, 4, 4),
    "R": (6, 5, 6, 5, 5),
    "S": (3, 4, 2, 1, 6),
    "T": (7, 2, 2, 2, 2),
    "V": (5, 5, 5, 5, 2),
}


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG: signature, IHDR, one zlib IDAT of rows each prefixed by filter type 0, IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # bit depth 8, colour type 2 (RGB)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    """RGB pixels, row-major; drawing outside the canvas is clipped."""

    def __init__(self, width: int, height: int, color: tuple = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(color) * (width * height))

    def pixel(self, x: int, y: int) -> tuple:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i : i + 3])

    def fill(self, x: int, y: int, w: int, h: int, color: tuple) -> None:
        x0, x1 = max(0, x), min(self.width, x + w)
        for row in range(max(0, y), min(self.height, y + h)):
            if x1 > x0:
                i = 3 * (row * self.width + x0)
                self.pixels[i : i + 3 * (x1 - x0)] = bytes(color) * (x1 - x0)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple, size: int = 1) -> None:
        """Bresenham's line, each point a size x size square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.fill(x0 - size // 2, y0 - size // 2, size, size, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def disk(self, x: int, y: int, r: int, color: tuple) -> None:
        for dy in range(-r, r + 1):
            half = int(math.sqrt(r * r - dy * dy) + 0.5)
            self.fill(x - half, y + dy, 2 * half + 1, 1, color)

    def text(self, x: int, y: int, s: str, color: tuple = BLACK, scale: int = 2) -> None:
        """``s`` with its top-left corner at (x, y); characters without a glyph are left blank."""
        for ch in s.upper():
            for row, bits in enumerate(FONT.get(ch, FONT[" "])):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        self.fill(x + col * scale, y + row * scale, scale, scale, color)
            x += 4 * scale


def text_width(s: str, scale: int = 2) -> int:
    return max(0, 4 * scale * len(s) - scale)


def nice_ticks(lo: float, hi: float, target: int = 5, least: float = 0.0) -> tuple[list[float], int]:
    """Ticks at multiples of 1, 2 or 5 x 10^k (at least ``least``) inside [lo, hi], and the decimals their labels
    need."""
    raw = max((hi - lo) / target, least)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = [k * step for k in range(first, int(math.floor(hi / step + 1e-9)) + 1)]
    return ticks, max(0, -math.floor(math.log10(step) + 1e-9))


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


def loss_series(records: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """(step, loss) and (step, val_loss), sorted by step, finite values only.  A resumed run appends to the same
    file and may log a step twice (those after its checkpoint); the later record wins."""
    train, val = {}, {}
    for r in records:
        step = r.get("step")
        for key, series in (("loss", train), ("val_loss", val)):
            v = r.get(key)
            finite = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if finite and isinstance(step, int) and not isinstance(step, bool):
                series[step] = float(v)
    return sorted(train.items()), sorted(val.items())


def _span(values: list[float], pad: float, empty: float) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:  # one point, or a flat series: give it room
        return lo - empty, hi + empty
    return lo - pad * (hi - lo), hi + pad * (hi - lo)


@dataclass(frozen=True)
class Axes:
    """Data ranges and the pixel box they map to (y grows downwards on the canvas)."""

    x0: float
    x1: float
    y0: float
    y1: float
    left: int
    top: int
    right: int
    bottom: int

    def px(self, x: float, y: float) -> tuple[int, int]:
        fx, fy = (x - self.x0) / (self.x1 - self.x0), (y - self.y0) / (self.y1 - self.y0)
        return round(self.left + fx * (self.right - self.left)), round(self.bottom - fy * (self.bottom - self.top))


def draw_loss_plot(records: list[dict], width: int = 640, height: int = 400) -> tuple[Canvas, Axes]:
    train, val = loss_series(records)
    points = train + val
    x0, x1 = _span([s for s, _ in points], 0.02, 1.0)
    y0, y1 = _span([v for _, v in points], 0.05, 0.5)
    ax = Axes(x0, x1, y0, y1, left=64, top=36, right=width - 20, bottom=height - 44)
    c = Canvas(width, height)
    for value, label in zip(*_labelled(y0, y1)):
        _, y = ax.px(x0, value)
        c.line(ax.left, y, ax.right, y, GRID)
        c.line(ax.left - 5, y, ax.left, y, BLACK)
        c.text(ax.left - 9 - text_width(label), y - 5, label)
    for value, label in zip(*_labelled(x0, x1, least=1)):  # steps are whole numbers
        x, _ = ax.px(value, y0)
        c.line(x, ax.bottom, x, ax.bottom + 5, BLACK)
        c.text(x - text_width(label) // 2, ax.bottom + 9, label)
    c.line(ax.left, ax.top, ax.left, ax.bottom, BLACK)
    c.line(ax.left, ax.bottom, ax.right, ax.bottom, BLACK)
    c.text((ax.left + ax.right - text_width("STEP")) // 2, height - 14, "STEP")
    c.text(8, 12, "LOSS")
    pixels = [ax.px(s, v) for s, v in train]
    for a, b in zip(pixels, pixels[1:]):
        c.line(*a, *b, TRAIN_COLOR, size=2)
    if len(pixels) == 1:
        c.disk(*pixels[0], 3, TRAIN_COLOR)
    pixels = [ax.px(s, v) for s, v in val]
    for a, b in zip(pixels, pixels[1:]):
        c.line(*a, *b, VAL_COLOR)
    for p in pixels:
        c.disk(*p, 4, VAL_COLOR)
    # Legend, top right: a line for the training series, a point for the validation one.
    x = ax.right - text_width("TRAIN LOSS") - text_width("VALIDATION LOSS") - 64
    c.line(x, 16, x + 16, 16, TRAIN_COLOR, size=2)
    c.text(x + 22, 12, "TRAIN LOSS")
    x += 22 + text_width("TRAIN LOSS") + 20
    c.disk(x + 4, 16, 4, VAL_COLOR)
    c.text(x + 14, 12, "VALIDATION LOSS")
    return c, ax


def _labelled(lo: float, hi: float, least: float = 0.0) -> tuple[list[float], list[str]]:
    ticks, decimals = nice_ticks(lo, hi, least=least)
    return ticks, [f"{t:.{decimals}f}" for t in ticks]


def write_loss_plot(records: list[dict], path: str | Path) -> Path:
    """Draw the records' losses into the PNG file ``path``; returns the path."""
    canvas, _ = draw_loss_plot(records)
    path = Path(path)
    path.write_bytes(encode_png(canvas.width, canvas.height, canvas.pixels))
    return path
