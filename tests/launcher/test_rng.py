"""Dropout masks are identical across TP ranks in replicated regions, different inside TP-split
regions (attention probabilities of the local heads), and different across DP ranks (same data on both)."""

from __future__ import annotations

import json

import pytest
from launch import shared_launch

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher


# SP off (rng.json), then on (rng-sp.json), in the 4-process launch shared with other modules
LAUNCH = shared_launch(__name__, 4, lambda out: [f"rng.py --out {out} --both"])


@pytest.fixture(scope="module")
def masks():
    return LAUNCH()


def test_dropout_masks_follow_the_regions(masks):
    result = json.loads((masks / "rng.json").read_text())
    for name in ("embedding_dropout", "residual_dropout", "mlp_dropout"):
        assert result[name]["same_across_tp"], (name, result[name])
        assert not result[name]["same_across_dp"], (name, result[name])
        assert 0.2 < result[name]["dropped_fraction"] < 0.4, result[name]
    attn = result["attention_probs_dropout"]
    assert not attn["same_across_tp"] and not attn["same_across_dp"], attn


def test_sequence_parallel_regions_draw_different_masks_per_tp_rank(masks):
    """Under SP the embedding and residual dropouts act on different sequence shards: masks must differ."""
    result = json.loads((masks / "rng-sp.json").read_text())
    for name in ("embedding_dropout", "residual_dropout", "mlp_dropout", "attention_probs_dropout"):
        assert not result[name]["same_across_tp"], (name, result[name])
        assert not result[name]["same_across_dp"], (name, result[name])
