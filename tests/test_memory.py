"""The analytic activation memory reproduces the paper's table (Korthikanti et al. 2022, sec. 4 and Table 2)."""

from __future__ import annotations

import pytest

from ds_megatron.memory import activation_bytes_per_layer, paper_units

# (name, a, h, t) with s = 2048 (the paper's configurations)
PAPER_MODELS = [("22B", 64, 6144, 8), ("175B", 96, 12288, 8), ("530B", 128, 20480, 8), ("1T", 160, 25600, 8)]
S = 2048


@pytest.mark.parametrize("name,a,h,t", PAPER_MODELS)
def test_every_mode_matches_the_paper_formulas(name, a, h, t):
    q = 5 * a * S / h
    assert paper_units(S, h, a) == pytest.approx(34 + q)
    assert paper_units(S, h, a, t) == pytest.approx(10 + 24 / t + q / t)
    assert paper_units(S, h, a, t, sequence_parallel=True) == pytest.approx((34 + q) / t)
    assert paper_units(S, h, a, t, recompute="selective") == pytest.approx(10 + 24 / t)
    assert paper_units(S, h, a, t, sequence_parallel=True, recompute="selective") == pytest.approx(34 / t)
    assert paper_units(S, h, a, t, recompute="full") == pytest.approx(2)
    assert paper_units(S, h, a, t, sequence_parallel=True, recompute="full") == pytest.approx(2 / t)


def test_published_175b_figures():
    # "23 vs 4.25 in units of s*b*h" for GPT-3 175B at t = 8: about 5x less with SP + SAR.
    tp_only = paper_units(S, 12288, 96, 8)
    sp_sar = paper_units(S, 12288, 96, 8, sequence_parallel=True, recompute="selective")
    assert tp_only == pytest.approx(23.0, abs=0.05)
    assert sp_sar == pytest.approx(4.25)
    assert tp_only / sp_sar > 5


def test_dtype_adjustment_is_term_by_term():
    # fp32 activations with 4-byte masks: 24 + 48/t + 12 a s / (h t) units.
    s, h, a, t = 1024, 512, 8, 4
    got = activation_bytes_per_layer(s, 1, h, a, t, act_bytes=4, mask_bytes=4) / (s * h)
    assert got == pytest.approx(24 + 48 / t + 12 * a * s / (h * t))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_one_block_stores_what_the_formula_counts(dtype, recompute):
    """A real block's saved tensors (eager attention, dropout on) within 5% of the formula in the run's dtype: the
    softmax is stored in the activation dtype (2 bytes in bf16, not its fp32 compute dtype) and no causal mask."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from activation_memory import DTYPES, measure, probe_mask_bytes

    from ds_megatron.model import GPTBlock, GPTConfig, init_module
    from ds_megatron.parallelize import ParallelPlan, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.recompute import RecomputePlan

    s, b, h, a = 128, 2, 64, 4
    config = GPTConfig(vocab_size=128, n_positions=s, n_embd=h, n_layer=1, n_head=a)
    rng = build_rng(1234, 0, 0, 0)
    plan = ParallelPlan(config, None, 0, 1, False, rng, recompute=RecomputePlan(recompute))
    block = GPTBlock(config)
    init_module(block, config, 1234, prefix="transformer.h.0.")
    block = parallelize_block(block, plan).to(DTYPES[dtype]).train()
    x = torch.randn(s, b, h).to(DTYPES[dtype]).requires_grad_()
    measured = measure(block, x, False, rng)
    act = torch.finfo(DTYPES[dtype]).bits // 8
    formula = activation_bytes_per_layer(
        s, b, h, a, recompute=recompute, act_bytes=act, mask_bytes=probe_mask_bytes(DTYPES[dtype])
    )
    assert abs(measured / formula - 1) < 0.05, (measured, formula)
