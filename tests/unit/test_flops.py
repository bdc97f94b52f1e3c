"""FLOPs formulas against the published closed forms (Narayanan et al. 2021, eq. 3; Korthikanti et al. 2022, sec. 5)."""

from __future__ import annotations

import pytest

from ds_megatron.flops import (
    core_attention_forward_flops,
    executed_flops_per_step,
    layer_forward_flops,
    logits_forward_flops,
    model_flops_per_step,
)

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


# The llama family: SwiGLU (three h x F matrices) and grouped-query attention (K and V of width k d)

LLAMA_8B = dict(family="llama", num_heads=32, num_kv_heads=8, intermediate_size=14336)  # h 4096, d 128, L 32


def test_llama_3_8b_layer_by_hand():
    b, s, h = 1, 8192, 4096
    q_and_o = 2 * (2 * b * s * h * h)  # 549,755,813,888
    k_and_v = 2 * (2 * b * s * h * (8 * 128))  # 137,438,953,472
    swiglu = 3 * (2 * b * s * h * 14336)  # 2,886,218,022,912
    core = 4 * b * s * s * h  # QK^T and x V: 1,099,511,627,776
    assert layer_forward_flops(b, s, h, **LLAMA_8B) == q_and_o + k_and_v + swiglu + core == 4_672_924_418_048


def test_llama_matmul_flops_are_six_per_parameter_per_token():
    """Forward + backward of every weight matrix is 6 FLOPs per parameter and token (2 + 4): the model FLOPs minus
    the attention core and the logits equal 6 x (the blocks' matrix parameters) x tokens."""
    B, s, L, h, V = 64, 8192, 32, 4096, 128256
    matrix_params = L * (2 * h * h + 2 * h * 1024 + 3 * h * 14336)  # 6,979,321,856 for Llama 3 8B
    total = model_flops_per_step(B, s, L, h, V, **LLAMA_8B)
    rest = 3 * (L * core_attention_forward_flops(B, s, h) + logits_forward_flops(B, s, h, V))
    assert total - rest == pytest.approx(6 * matrix_params * B * s, rel=1e-12)


def test_llama_recompute_and_the_gpt_default():
    B, s, L, h, V = 8, 4096, 16, 2048, 128256
    llama = dict(family="llama", num_heads=32, num_kv_heads=8, intermediate_size=8192)  # Llama 3.2 1B
    model = model_flops_per_step(B, s, L, h, V, **llama)
    full = executed_flops_per_step(B, s, L, h, V, "full", **llama)
    assert full - model == pytest.approx(L * layer_forward_flops(B, s, h, **llama))
    selective = executed_flops_per_step(B, s, L, h, V, "selective", **llama)
    assert selective - model == pytest.approx(4 * B * s**2 * h * L)  # the same core: every query head is scored
    explicit = executed_flops_per_step(B, s, L, h, V, "selective", recompute_modules=("core_attn",), **llama)
    assert explicit == selective  # no modules named: the default, core_attn
    # A GPT block is the default; stating its fixed fields changes nothing, bit for bit.
    gpt = dict(family="gpt2", num_heads=16, num_kv_heads=16, intermediate_size=4 * h)
    assert model_flops_per_step(B, s, L, h, V, **gpt) == model_flops_per_step(B, s, L, h, V)
    assert model_flops_per_step(B, s, L, h, V) < model  # SwiGLU's third matrix outweighs GQA's smaller K and V here
    with pytest.raises(ValueError, match="needs num_heads, num_kv_heads and intermediate_size"):
        layer_forward_flops(1, s, h, family="llama")


def test_mfu_inputs_follow_the_resolved_shape():
    """metrics.throughput takes the family's fields as ``block_fields`` reads them off a resolved ModelShape."""
    from ds_megatron.config import resolve
    from ds_megatron.flops import block_fields
    from ds_megatron.metrics import throughput

    shape = resolve({"train_batch_size": 8, "ds_megatron": {"model": {"size": "llama3-8b"}}}, 1).model
    assert block_fields(shape) == LLAMA_8B
    t = throughput(2.0, 8, 8192, 32, 4096, 128256, 4, "none", None, 989.0, **block_fields(shape))
    assert t["tflops_per_gpu"] == pytest.approx(model_flops_per_step(8, 8192, 32, 4096, 128256, **LLAMA_8B) / 8e12)


def test_selective_counts_only_the_modules_it_recomputes():
    """HFU counts each recomputed module at its own matmul FLOPs: the shipped Llama 3 8B configs recompute the MLP
    activation (8k) or the norms (128k), elementwise functions with no matmul, so their HFU equals their MFU; the
    core attention, counted whatever the modules, overstated it by 35.2 of 474.4 TFLOP per sequence at 8k (7.4%)
    and 9.0 of 32.9 PFLOP at 128k (27.4%)."""
    L, h, V = 32, 4096, 128256
    for s, shipped in ((8192, ("mlp_act",)), (131072, ("layernorm",))):
        model = model_flops_per_step(1, s, L, h, V, **LLAMA_8B)
        for modules in (shipped, ("mlp_act", "layernorm")):
            got = executed_flops_per_step(1, s, L, h, V, "selective", recompute_modules=modules, **LLAMA_8B)
            assert got == model, (s, modules)
    core_8k = 32 * 4 * 8192**2 * 4096  # 32 layers x QK^T and x V: 35,184,372,088,832
    model_8k = model_flops_per_step(1, 8192, L, h, V, **LLAMA_8B)
    with_core = executed_flops_per_step(
        1, 8192, L, h, V, "selective", recompute_modules=("core_attn", "mlp_act"), **LLAMA_8B
    )
    assert with_core - model_8k == core_8k == 35_184_372_088_832
    assert round(core_8k / model_8k, 3) == 0.074
    with pytest.raises(ValueError, match="unknown recompute module 'attn'"):
        executed_flops_per_step(1, 8192, L, h, V, "selective", recompute_modules=("attn",), **LLAMA_8B)
