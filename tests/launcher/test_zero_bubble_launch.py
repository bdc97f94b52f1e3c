"""The launcher tests of ``tests/unit/test_zero_bubble.py`` (its subject below), slow tier.

ZB-H1 on DeepSpeed's pipeline engine: the schedule (unit tier) and the trained result (one launcher run).

Unit tier: with the W passes removed, the ZB-H1 stream of every stage is DeepSpeed's 1F1B stream, instruction for
instruction (same communication order, so no new deadlock); every backward pass gets exactly one W pass, no W pass
runs before its backward, stage s holds at most s when it runs a forward, and all have run before the step's
reductions.  A timing model of the streams (T_F = T_B = T_W; a send and its receive block until both sides are
there, as DeepSpeed's p2p does) shows the bubble going from 1F1B's (p-1)(T_F+T_B+T_W) to ZB-H1's (p-1)(T_F+T_B-T_W),
and, with the costs measured on CPU (T_F 1.6, T_B 1.4, T_W 1), halving.  The schedule key
is validated before anything starts.  The engine's W instruction frames each W pass for DeepSpeed's BF16 optimizer
like a backward pass, and its optimizer step refuses to run with W passes queued.

Launcher tier (one run, 2 processes, pp 2): GPT-2 (tied embeddings across the two stages) and Llama (untied) in
fp32, and GPT-2 with DeepSpeed's BF16 optimizer (ZeRO-1, fp32 accumulators), each train three steps with 1F1B and
with ZB-H1: losses, step-1 gradients (bf16: the fp32 accumulators) and the weights after three steps agree within
fp32 rounding (measured: bit for bit), and ZB-H1 ran one W pass with deferred work per micro-batch.
"""

from __future__ import annotations

import json

import pytest
from launch import WORKERS, deepspeed_launch


@pytest.mark.slow  # one deepspeed launch: both families, both schedules
def test_zb_h1_trains_like_1f1b(tmp_path):
    layouts = ["1,2,1", "1,2,1,llama", "1,2,1,bf16"]
    deepspeed_launch(WORKERS / "zero_bubble.py", 2, ["--out", str(tmp_path), "--layouts", *layouts])
    for layout in (lay.replace(",", "-") for lay in layouts):
        ranks = [json.loads(f.read_text()) for f in sorted(tmp_path.glob(f"{layout}.rank*.json"))]
        assert len(ranks) == 2, layout
        for r in ranks:
            for a, b in zip(r["losses_1f1b"], r["losses_zb"], strict=True):
                assert abs(a - b) <= 1e-6 * abs(a), (layout, r["losses_1f1b"], r["losses_zb"])
            assert r["grad_diff"] <= 1e-6 * r["grad_scale"], (layout, r["grad_diff"], r["grad_scale"])
            assert r["param_diff"] <= 1e-5, (layout, r["param_diff"])
            assert r["w_passes"] == r["expected_w_passes"], (layout, r["w_passes"], r["expected_w_passes"])
            assert r["left_at_reduce"] == 0, layout
