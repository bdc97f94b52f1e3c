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

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from activation_memory import DTYPES, measure, probe_mask_bytes

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.gpt2.model import GPTBlock, GPTConfig, init_module
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    s, b, h, a = 128, 2, 64, 4
    config = GPTConfig(vocab_size=128, n_positions=s, n_embd=h, n_layer=1, n_head=a)
    rng = build_rng(1234, 0, 0, 0)
    plan = ParallelContext(config, Group(), False, rng, recompute=RecomputeSection(recompute))
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

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from activation_memory import DTYPES, measure, probe_mask_bytes

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.gpt2.model import GPTBlock, GPTConfig, init_module
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    s, b, h, a = 128, 2, 64, 4
    config = GPTConfig(
        vocab_size=128, n_positions=s, n_embd=h, n_layer=1, n_head=a, attention="sdpa", attn_pdrop=attn_dropout
    )
    rng = build_rng(1234, 0, 0, 0)
    plan = ParallelContext(config, Group(), False, rng, recompute=RecomputeSection("none"))
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


# The llama family (RMSNorm, rotary embedding, grouped-query attention, SwiGLU)

# Llama 3 8B (s 8192, b 1, h 4096, a 32, k 8 KV heads of d 128, F 14336) in bf16, t 8, eager, no dropout, per token:
# replicated under TP, split by SP: two norm inputs, q/k/v and gate/up inputs 4 h x 2 bytes + two fp32 1/rms 8 bytes
L8B = dict(s=8192, h=4096, a=32, k=8, f=14336)
L8B_SP_SPLIT = 4 * 4096 * 2 + 8  # 32,776
# split by TP: Q, o_proj input 2 h; K, V 2 k d; gate, up, down_proj input 3 F; 2 bytes each
L8B_TP_SPLIT = (2 * 4096 + 2 * 8 * 128 + 3 * 14336) * 2  # 106,496
L8B_SOFTMAX = 32 * 8192 * 2  # a s, bf16: 524,288


def _llama_8b(t: int, sp: bool, recompute: str, **kw) -> float:
    s, h, a, k, f = (L8B[n] for n in ("s", "h", "a", "k", "f"))
    return activation_bytes_per_layer(
        s, 1, h, a, t, sp, recompute, family="llama", num_kv_heads=k, intermediate_size=f, **kw
    )


@pytest.mark.parametrize(
    "t,sp,recompute,per_token",
    [
        (8, True, "none", (L8B_SP_SPLIT + L8B_TP_SPLIT + L8B_SOFTMAX) / 8),  # 82,945
        (8, False, "none", L8B_SP_SPLIT + (L8B_TP_SPLIT + L8B_SOFTMAX) / 8),  # 111,624
        (8, True, "selective", (L8B_SP_SPLIT + L8B_TP_SPLIT) / 8),  # 17,409
        (8, False, "selective", L8B_SP_SPLIT + L8B_TP_SPLIT / 8),  # 46,088
        (1, False, "none", L8B_SP_SPLIT + L8B_TP_SPLIT + L8B_SOFTMAX),  # 663,560
        (8, True, "full", 4096 * 2 / 8),  # the block input only
        (8, False, "full", 4096 * 2),
    ],
)
def test_llama_3_8b_by_hand(t, sp, recompute, per_token):
    assert _llama_8b(t, sp, recompute) == pytest.approx(8192 * per_token, rel=1e-12)


def test_llama_3_8b_by_hand_exact_figures():
    assert _llama_8b(8, True, "none") == 679_485_440  # 82,945 bytes per token: 20.25 s*b*h (GPT's shape: 44.25)
    assert _llama_8b(8, True, "selective") == 142_614_528
    # sdpa (fused): the fp32 log-sum-exp, 4 a bytes per token, in place of the softmax
    assert _llama_8b(8, True, "none", attention="sdpa") == 8192 * (L8B_SP_SPLIT + L8B_TP_SPLIT + 4 * 32) / 8
    # an attention dropout brings back its output (a s, 2 bytes) and mask (a s, 1 byte)
    dropout = _llama_8b(8, True, "none", attention_dropout=0.1)
    assert dropout == 8192 * (L8B_SP_SPLIT + L8B_TP_SPLIT + L8B_SOFTMAX * 5 // 2) / 8


def test_llama_terms_scale_with_kv_heads_and_width():
    # K and V are stored at KV size: one more KV head adds 2 d s b act bytes split by TP; the MLP 3 s b act per F
    s, b, h, a, t = 1024, 2, 512, 8, 2
    base = activation_bytes_per_layer(s, b, h, a, t, family="llama", num_kv_heads=2, intermediate_size=1024)
    more_kv = activation_bytes_per_layer(s, b, h, a, t, family="llama", num_kv_heads=4, intermediate_size=1024)
    wider = activation_bytes_per_layer(s, b, h, a, t, family="llama", num_kv_heads=2, intermediate_size=1536)
    assert more_kv - base == pytest.approx(2 * 2 * (h // a) * s * b * 2 / t)
    assert wider - base == pytest.approx(3 * 512 * s * b * 2 / t)


def test_gpt_is_the_default_family_and_llama_needs_its_fields():
    s, h, a = 2048, 1024, 16
    gpt = activation_bytes_per_layer(s, 1, h, a, 2)
    assert activation_bytes_per_layer(s, 1, h, a, 2, family="gpt2", num_kv_heads=a, intermediate_size=4 * h) == gpt
    with pytest.raises(ValueError, match="num_kv_heads and intermediate_size"):
        activation_bytes_per_layer(s, 1, h, a, family="llama")
    with pytest.raises(ValueError, match="attention_dropout applies to the llama family"):
        activation_bytes_per_layer(s, 1, h, a, attention_dropout=0.0)
    with pytest.raises(ValueError, match="family"):
        activation_bytes_per_layer(s, 1, h, a, family="mamba")


LLAMA_CASES = [  # (attention, attention dropout, recompute, sdpa path torch takes on CPU)
    ("eager", 0.0, "none", "fused"),
    ("eager", 0.0, "selective", "fused"),
    ("eager", 0.0, "full", "fused"),
    ("eager", 0.1, "none", "fused"),
    ("sdpa", 0.0, "none", "fused"),  # CPU flash kernel, grouped-query attention included
    ("sdpa", 0.1, "none", "math"),  # CPU math path: K and V repeated to every query head, fp32
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attention,dropout,recompute,path", LLAMA_CASES)
def test_one_llama_block_stores_what_the_formula_counts(dtype, attention, dropout, recompute, path):
    """A real LlamaBlock (4 heads, 2 KV heads, SwiGLU 176) saves within 5% of the formula in the run's dtype.  The
    remainder is the rotary cos/sin tables (2 s d elements, shared by every block of a process; here 0.4-1.6%);
    under full recompute only the block input is kept."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from activation_memory import DTYPES, measure, probe_mask_bytes

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.llama.model import LlamaBlock, LlamaConfig, init_llama_module
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    s, b, h, a, k, f = 128, 2, 64, 4, 2, 176
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=h,
        num_layers=1,
        num_heads=a,
        num_kv_heads=k,
        intermediate_size=f,
        max_position_embeddings=s,
        rope_theta=10000.0,
        attention_dropout=dropout,
        attention=attention,
    )
    rng = build_rng(1234, 0, 0, 0)
    plan = ParallelContext(config, Group(), False, rng, recompute=RecomputeSection(recompute))
    block = LlamaBlock(config)
    init_llama_module(block, config, 1234, prefix="model.layers.0.")
    block = parallelize_block(block, plan).to(DTYPES[dtype]).train()
    x = torch.randn(s, b, h).to(DTYPES[dtype]).requires_grad_()
    measured = measure(block, x, recompute == "full", rng)
    if attention == "sdpa":
        assert _cpu_sdpa_path(DTYPES[dtype], dropout) == path
    formula = activation_bytes_per_layer(
        s,
        b,
        h,
        a,
        recompute=recompute,
        act_bytes=torch.finfo(DTYPES[dtype]).bits // 8,
        mask_bytes=probe_mask_bytes(DTYPES[dtype]),
        attention=attention,
        sdpa_path=path,
        math_act_bytes=4,
        math_mask_bytes=probe_mask_bytes(torch.float32),
        family="llama",
        num_kv_heads=k,
        intermediate_size=f,
        attention_dropout=dropout,
    )
    rotary = 2 * s * (h // a) * torch.finfo(DTYPES[dtype]).bits // 8
    print(
        f"\nllama block {dtype} {attention} p={dropout} {recompute}: measured {measured} B, formula {formula:.0f} B, "
        f"ratio {measured / formula:.4f}, rotary tables {rotary} B"
    )
    assert abs(measured / formula - 1) < 0.05, (measured, formula)
    tables = 0 if recompute == "full" else rotary
    assert measured - tables == pytest.approx(formula, rel=1e-9)  # every other saved byte is a counted term


MODULE_CASES = [  # (family, attention, modules)
    ("gpt2", "eager", ("core_attn", "mlp_act", "layernorm")),
    ("gpt2", "eager", ("mlp_act",)),
    ("gpt2", "sdpa", ("mlp_act", "layernorm")),
    ("llama", "eager", ("core_attn", "layernorm")),
    ("llama", "sdpa", ("mlp_act", "layernorm")),
]


def _block(family: str, attention: str, modules: tuple, dtype, seed: int = 1234):
    """One block of ``family`` (dropout 0.1 where the family has it) with selective recompute of ``modules``."""
    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.gpt2.model import GPTBlock, GPTConfig, init_module
    from ds_megatron.model.llama.model import LlamaBlock, LlamaConfig, init_llama_module
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    s, h, a = 128, 64, 4
    if family == "gpt2":
        config = GPTConfig(vocab_size=128, n_positions=s, n_embd=h, n_layer=1, n_head=a, attention=attention)
        block, init, prefix = GPTBlock(config), init_module, "transformer.h.0."
    else:
        config = LlamaConfig(
            vocab_size=128, hidden_size=h, num_layers=1, num_heads=a, num_kv_heads=2, intermediate_size=176,
            max_position_embeddings=s, rope_theta=10000.0, attention=attention,
        )  # fmt: skip
        block, init, prefix = LlamaBlock(config), init_llama_module, "model.layers.0."
    init(block, config, seed, prefix=prefix)
    rng = build_rng(seed, 0, 0, 0)
    recompute = RecomputeSection("selective", modules=modules) if modules else RecomputeSection("none")
    plan = ParallelContext(config, Group(), False, rng, recompute=recompute)
    return parallelize_block(block, plan).to(dtype).train(), config, rng


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family,attention,modules", MODULE_CASES)
def test_recompute_modules_store_what_the_formula_counts(dtype, family, attention, modules):
    """Each recompute module's saving, measured on a real block (saved-tensor hooks), within 5% of the formula."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from activation_memory import DTYPES, measure, probe_mask_bytes

    s, b = 128, 2
    block, config, rng = _block(family, attention, modules, DTYPES[dtype])
    x = torch.randn(s, b, 64).to(DTYPES[dtype]).requires_grad_()
    measured = measure(block, x, False, rng)
    act = torch.finfo(DTYPES[dtype]).bits // 8
    path = _cpu_sdpa_path(DTYPES[dtype], 0.1 if family == "gpt2" else 0.0) if attention == "sdpa" else "fused"
    extra = {} if family == "gpt2" else dict(family="llama", num_kv_heads=2, intermediate_size=176)
    formula = activation_bytes_per_layer(
        s, b, 64, 4, recompute="selective", act_bytes=act, mask_bytes=probe_mask_bytes(DTYPES[dtype]),
        attention=attention, sdpa_path=path, math_mask_bytes=probe_mask_bytes(torch.float32), modules=modules, **extra,
    )  # fmt: skip
    assert abs(measured / formula - 1) < 0.05, (measured, formula)
    full = activation_bytes_per_layer(
        s, b, 64, 4, act_bytes=act, mask_bytes=probe_mask_bytes(DTYPES[dtype]), attention=attention, sdpa_path=path,
        math_mask_bytes=probe_mask_bytes(torch.float32), **extra,
    )  # fmt: skip
    assert formula < full  # every case saves something


@pytest.mark.parametrize("family,attention,modules", MODULE_CASES)
def test_recompute_modules_leave_gradients_unchanged(family, attention, modules):
    """Dropout on (GPT-2's residual and attention dropout): gradients with the modules recomputed equal those of the
    block storing everything, bit for bit (norms and activations are deterministic; core_attn replays its RNG)."""
    import torch

    grads = []
    for mods in ((), modules):
        block, _, rng = _block(family, attention, mods, torch.float32)
        x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        torch.manual_seed(7)
        block(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in block.parameters())])
    for got, ref in zip(*grads):
        assert torch.equal(got, ref)
