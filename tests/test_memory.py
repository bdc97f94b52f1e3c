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


# The sdpa kernel (torch.nn.functional.scaled_dot_product_attention)

GPT3_SHAPES = [("1.3B", 32, 2048), ("13B", 40, 5120), ("175B", 96, 12288)]  # (name, a, h), s = 2048


@pytest.mark.parametrize("name,a,h", GPT3_SHAPES)
@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (8, False), (8, True)])
def test_sdpa_none_is_eager_selective_plus_the_log_sum_exp(name, a, h, t, sp):
    """Exact relation: sdpa with recompute none = eager with selective recompute + 4 a s b / t bytes (the fp32
    log-sum-exp [b, a/t, s]); with it, the two are within 1% of each other at GPT-3 shapes."""
    from ds_megatron.memory import lse_bytes_per_layer

    b = 2
    sdpa = activation_bytes_per_layer(S, b, h, a, t, sp, "none", attention="sdpa")
    selective = activation_bytes_per_layer(S, b, h, a, t, sp, "selective")
    assert sdpa == pytest.approx(selective + 4 * a * S * b / t, rel=1e-12)
    assert sdpa == pytest.approx(selective + lse_bytes_per_layer(S, b, a, t), rel=1e-12)
    assert abs(sdpa / selective - 1) < 0.01
    eager = activation_bytes_per_layer(S, b, h, a, t, sp, "none")
    assert sdpa < eager  # the log-sum-exp (4 a s b bytes) is far below the s^2 terms (5 a s^2 b bytes)
    full = activation_bytes_per_layer(S, b, h, a, t, sp, "full")
    assert activation_bytes_per_layer(S, b, h, a, t, sp, "full", attention="sdpa") == full


def test_sdpa_refuses_selective_and_unknown_kernels():
    with pytest.raises(ValueError, match="selective"):
        activation_bytes_per_layer(S, 1, 1024, 16, recompute="selective", attention="sdpa")
    with pytest.raises(ValueError, match="attention"):
        activation_bytes_per_layer(S, 1, 1024, 16, attention="flash")
    with pytest.raises(ValueError, match="sdpa_path"):
        activation_bytes_per_layer(S, 1, 1024, 16, attention="sdpa", sdpa_path="cudnn")


def test_sdpa_math_path_is_the_eager_table_in_its_own_dtype():
    # fp32 everywhere with 4-byte masks: the math path stores exactly the eager kernel's tensors.
    s, h, a, t = 1024, 512, 8, 4
    eager = activation_bytes_per_layer(s, 2, h, a, t, act_bytes=4, mask_bytes=4)
    math_path = activation_bytes_per_layer(s, 2, h, a, t, act_bytes=4, mask_bytes=4, attention="sdpa", sdpa_path="math")
    assert math_path == pytest.approx(eager)
    # bf16 activations, fp32 inside the path: Q, K, V and the s^2 terms at 4 bytes, the rest at 2.
    got = activation_bytes_per_layer(s, 1, h, a, t, act_bytes=2, mask_bytes=2, attention="sdpa", sdpa_path="math")
    assert got / (s * h) == pytest.approx(12 + (30 + 12 * a * s / h) / t)


def _cpu_sdpa_path(dtype, dropout: float) -> str:
    """Which path this torch's CPU sdpa takes: "math" when it saves an s x s tensor for backward, else "fused"."""
    import torch
    import torch.nn.functional as F

    s = 32
    q, k, v = (torch.randn(1, 2, s, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    return "math" if any(shape[-2:] == (s, s) for shape in shapes) else "fused"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attn_dropout", [0.1, 0.0])
def test_one_sdpa_block_stores_what_the_formula_counts(dtype, attn_dropout):
    """A real block with attention="sdpa", residual dropouts on, recompute none: the bytes it saves for backward
    within 5% of the formula for the path torch takes on CPU.  With the attention dropout on (the training default)
    this torch runs its math path (s^2 terms, in fp32 even for bf16); with it off, the fused CPU flash kernel, which
    saves what CUDA's flash kernel does (Q, K, V, the output and the fp32 log-sum-exp)."""
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
    config = GPTConfig(
        vocab_size=128, n_positions=s, n_embd=h, n_layer=1, n_head=a, attention="sdpa", attn_pdrop=attn_dropout
    )
    rng = build_rng(1234, 0, 0, 0)
    plan = ParallelPlan(config, None, 0, 1, False, rng, recompute=RecomputePlan("none"))
    block = GPTBlock(config)
    init_module(block, config, 1234, prefix="transformer.h.0.")
    block = parallelize_block(block, plan).to(DTYPES[dtype]).train()
    x = torch.randn(s, b, h).to(DTYPES[dtype]).requires_grad_()
    measured = measure(block, x, False, rng)
    path = _cpu_sdpa_path(DTYPES[dtype], attn_dropout)
    if attn_dropout == 0.0:
        assert path == "fused"  # so the formula the tuner uses is measured here
    formula = activation_bytes_per_layer(
        s,
        b,
        h,
        a,
        act_bytes=torch.finfo(DTYPES[dtype]).bits // 8,
        mask_bytes=probe_mask_bytes(DTYPES[dtype]),
        attention="sdpa",
        sdpa_path=path,
        math_act_bytes=4,  # the math path upcasts bf16 to fp32
        math_mask_bytes=probe_mask_bytes(torch.float32),
    )
    print(
        f"\nsdpa block {dtype}, attention dropout {attn_dropout}: {path} path, measured {measured} B, formula "
        f"{formula:.0f} B, ratio {measured / formula:.4f}"
    )
    assert abs(measured / formula - 1) < 0.05, (path, measured, formula)
