"""The launcher tests of ``tests/unit/test_zero_bubble.py``: that file's docstring states their subject."""

from __future__ import annotations

import json

import pytest
from launch import shared_launch

LAYOUTS = ["1,2,1", "1,2,1,llama", "1,2,1,bf16"]
# one run (both families, both schedules) in the 2-process launch shared with other modules
LAUNCH = shared_launch(__name__, 2, lambda out: [f"zero_bubble.py --out {out} --layouts {' '.join(LAYOUTS)}"])


@pytest.mark.slow
def test_zb_h1_trains_like_1f1b():
    out = LAUNCH()
    for layout in (lay.replace(",", "-") for lay in LAYOUTS):
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{layout}.rank*.json"))]
        assert len(ranks) == 2, layout
        for r in ranks:
            for a, b in zip(r["losses_1f1b"], r["losses_zb"], strict=True):
                assert abs(a - b) <= 1e-6 * abs(a), (layout, r["losses_1f1b"], r["losses_zb"])
            assert r["grad_diff"] <= 1e-6 * r["grad_scale"], (layout, r["grad_diff"], r["grad_scale"])
            assert r["param_diff"] <= 1e-5, (layout, r["param_diff"])
            assert r["w_passes"] == r["expected_w_passes"], (layout, r["w_passes"], r["expected_w_passes"])
            assert r["left_at_reduce"] == 0, layout
