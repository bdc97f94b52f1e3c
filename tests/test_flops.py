"""FLOPs formulas against the published closed forms (Narayanan et al. 2021, eq. 3; Korthikanti et al. 2022, sec. 5)."""

from __future__ import annotations

import pytest

from ds_megatron.flops import executed_flops_per_step, model_flops_per_step

B, S, L, H, V = 1536, 2048, 96, 12288, 50257


def test_model_flops_closed_form():
    expected = 72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * H * L))
    assert model_flops_per_step(B, S, L, H, V) == pytest.approx(expected)


def test_full_recompute_closed_form():
    expected = 96 * B * S * L * H**2 * (1 + S / (6 * H) + V / (16 * H * L))
    assert executed_flops_per_step(B, S, L, H, V, "full") == pytest.approx(expected)


def test_selective_adds_the_attention_core_forward():
    extra = executed_flops_per_step(B, S, L, H, V, "selective") - model_flops_per_step(B, S, L, H, V)
    assert extra == pytest.approx(4 * B * S**2 * H * L)
