"""The launcher tests of ``tests/unit/test_zero_bubble.py``: that file's docstring states their subject."""

from __future__ import annotations

import json

import pytest
from launch import shared_launch

LAYOUTS = ["1,2,1", "1,2,1,llama", "1,2,1,bf16"]
# one run (both families, 1f1b, zb-h1 and zb-h2) in the 2-process launch shared with other modules
LAUNCH = shared_launch(__name__, 2, lambda out: [f"zero_bubble.py --out {out} --layouts {' '.join(LAYOUTS)}"])


@pytest.mark.slow  # one run in the shared 2-process launch: both families, all three schedules
def test_zb_h1_and_zb_h2_train_like_1f1b():
    out = LAUNCH()
    for layout in (lay.replace(",", "-") for lay in LAYOUTS):
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{layout}.rank*.json"))]
        assert len(ranks) == 2, layout
        for r in ranks:
            for name in ("zb-h1", "zb-h2"):
                z = r[name]
                for a, b in zip(z["losses_1f1b"], z["losses_zb"], strict=True):
                    assert abs(a - b) <= 1e-6 * abs(a), (layout, name, z["losses_1f1b"], z["losses_zb"])
                assert z["grad_diff"] <= 1e-6 * r["grad_scale"], (layout, name, z["grad_diff"], r["grad_scale"])
                assert z["param_diff"] <= 1e-5, (layout, name, z["param_diff"])
                assert z["w_passes"] == z["expected_w_passes"], (layout, name, z["w_passes"], z["expected_w_passes"])
                assert z["left_at_reduce"] == 0, (layout, name)
            # ZB-H2 rebuilt its order after the first step for the costs it timed (all ranks alike)
            costs = r["zb-h2"]["costs"]  # one (T_F, T_B, T_W) per stage
            assert len(costs) == 2 and costs != [[1.0] * 3] * 2 and costs == ranks[0]["zb-h2"]["costs"], costs
