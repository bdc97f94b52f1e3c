"""The launcher tests of ``tests/unit/test_recompute.py``: that file's docstring states their subject."""

from __future__ import annotations

import json

import pytest
from launch import shared_launch

# both variants in one run: SP off (GPT), then SP on (GPT and Llama), in the 4-process launch shared with other modules
LAUNCH = shared_launch(__name__, 4, lambda out: [f"recompute.py --out {out} --variants tp,tp+sp"])


@pytest.fixture(scope="module")
def recompute_results():
    return LAUNCH()


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_recompute_replays_dropout_exactly(recompute_results, sp):
    """Every policy at tp 2 x pp 2; with SP for both families (the Llama's dropout is on its attention only)."""
    files = sorted(recompute_results.glob("recompute-sp*.rank*.json" if sp else "recompute.rank*.json"))
    assert len(files) == (8 if sp else 4)
    for f in files:
        result = json.loads(f.read_text())
        assert set(result) == {"none", "selective", "full-uniform-1", "full-uniform-2", "full-block-1", "modules"}
        for name, r in result.items():
            assert r["grad_diff"] <= 1e-6, (f.name, name, r)
            assert r["loss"] == r["base_loss"], (f.name, name, r)
