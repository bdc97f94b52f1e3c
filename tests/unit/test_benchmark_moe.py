"""benchmarks/moe.py's pure helpers: the saved-bytes counter (each storage once, parameters left out), the
interleaved timer's medians and order, the relative gap."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe  # noqa: E402


def test_saved_bytes_counts_each_storage_once_and_leaves_parameters_out():
    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(3, 8, requires_grad=True)

    def run():
        y = x @ w  # saves x (3 x 8 fp32) and w (a parameter: not counted)
        z = y.sin()  # saves y (3 x 4 fp32)
        return (z * y).sum()  # saves z and y again (y counted once)

    nbytes, out = moe.saved_bytes(run, [w])
    assert nbytes == (3 * 8 + 3 * 4 + 3 * 4) * 4
    out.backward()
    assert x.grad is not None and w.grad is not None
    # a view of x saved by another op shares x's storage: still once
    nbytes, _ = moe.saved_bytes(lambda: (x * x[:, :4].repeat(1, 2)).sum(), [])
    assert nbytes == 3 * 8 * 4 + 3 * 8 * 4  # x itself and the repeated copy; the slice is x's storage


def test_interleaved_medians_warm_up_then_alternate():
    calls: list[str] = []
    ticks = iter(range(1000))
    clock = lambda: float(next(ticks))  # noqa: E731  each reading one second later than the last
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    medians = moe.interleaved_medians(fns, 3, clock=clock)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert medians == {"a": 1.0, "b": 1.0}


def test_relative_gap():
    assert moe.relative_gap(150.0, 100.0) == 0.5
    assert moe.relative_gap(75.0, 100.0) == -0.25
