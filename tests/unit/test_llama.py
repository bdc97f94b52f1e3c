"""The Llama family's single-device model against transformers' ``LlamaForCausalLM``, and its configuration rules.

Same weights (our state dict loads into transformers with no key map), fp32: logits and every gradient within 1e-5,
eager and sdpa, tied and untied, grouped-query attention with fewer KV heads than heads, Llama 3's rope scaling.
The parallel layouts are checked against this model by the parity launches (tests/launcher/test_parity.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_megatron.config import ConfigError, resolve, resolve_shape
from ds_megatron.config.schema import ModelSection
from ds_megatron.model import LlamaConfig, build_model, model_config
from ds_megatron.model.layers import RMSNormFunction
from ds_megatron.model.llama.model import Llama, SwiGLUFunction

SCALING = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 16),
    ("rope_type", "llama3"),
)


def tiny(attention: str = "eager", tied: bool = False, scaling=SCALING, kv: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1001,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=kv,
        intermediate_size=176,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=scaling,
        tie_word_embeddings=tied,
        attention=attention,
    )


def pair(cfg: LlamaConfig):
    from transformers import LlamaForCausalLM

    ours = Llama(cfg, seed=3)
    hf = LlamaForCausalLM(cfg.to_hf())
    result = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    return ours, hf


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_and_gradients_equal_transformers(attention, tied):
    cfg = tiny(attention, tied)
    ours, hf = pair(cfg)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # 40 > 16: scaled
    logits = ours(ids)
    ref = hf(ids).logits
    assert (logits - ref).abs().max() <= 1e-5
    for out in (logits, ref):
        F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref_grad = hf_params[name].grad
        assert (p.grad - ref_grad).abs().max() <= 1e-5 * max(1.0, ref_grad.abs().max().item()), name


def test_greedy_generation_equals_transformers():
    cfg = tiny(kv=4)
    ours, hf = pair(cfg)
    ours.eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, ours(ids)[:, -1:].argmax(-1)], dim=1)
    assert ids[0].tolist() == expected


def test_bf16_forward_close_to_transformers_bf16():
    cfg = tiny(tied=True)
    ours, hf = pair(cfg)
    ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 2e-2, diff  # bf16 rounding of a different (equally valid) order of the attention scaling


def test_lean_autograd_functions_match_plain_torch_and_save_less():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-5), (x, w))
    gate = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (gate, up))

    def saved_elements(fn) -> int:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn()
        return sum(sizes)

    a = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(32, 64, requires_grad=True)
    assert saved_elements(lambda: SwiGLUFunction.apply(a, b)) == 2 * a.numel()
    assert saved_elements(lambda: F.silu(a) * b) == 3 * a.numel()  # plain torch keeps silu(gate) as well


def test_swiglu_backward_stays_in_bf16_and_matches_fp32():
    """The bf16 backward converts nothing to fp32 (torch's bf16 silu kernels accumulate in fp32 themselves: the
    round trips cost ~170 ms of a 1.3-1.5 s CPU step at s 2048) and stays within bf16 rounding of fp32 autograd."""
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(5)
    gate32, up32, dy32 = (torch.randn(64, 96, generator=g) for _ in range(3))
    gate, up = (t.bfloat16().requires_grad_() for t in (gate32, up32))
    out = SwiGLUFunction.apply(gate, up)
    seen: list[torch.dtype] = []

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(t.dtype for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Dtypes():
        out.backward(dy32.bfloat16())
    assert seen and set(seen) == {torch.bfloat16}, set(seen)
    ref_gate, ref_up = (t.double().requires_grad_() for t in (gate32.bfloat16(), up32.bfloat16()))
    (F.silu(ref_gate) * ref_up).backward(dy32.bfloat16().double())
    for name, got, ref in (("gate", gate.grad, ref_gate.grad), ("up", up.grad, ref_up.grad)):
        err = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max()
        assert err < 2**-6, (name, float(err))  # bf16 keeps 8 bits: two roundings stay well under 2^-6


def test_config_round_trip_and_refusals():
    for cfg in (tiny(), tiny(tied=True, scaling=None, kv=8)):
        assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    hf = tiny().to_hf()
    hf.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_scaling.rope_type=yarn"):
        LlamaConfig.from_hf(hf)


def test_named_sizes_resolve_to_published_shapes():
    published = {  # layers, hidden, heads, kv heads, intermediate, tied (the models' config.json)
        "llama3.2-1b": (16, 2048, 32, 8, 8192, True),
        "llama3.2-3b": (28, 3072, 24, 8, 8192, True),
        "llama3-8b": (32, 4096, 32, 8, 14336, False),
        "llama3-70b": (80, 8192, 64, 8, 28672, False),
    }
    for name, (layers, h, a, kv, ffn, tied) in published.items():
        m = resolve_shape(ModelSection(size=name))
        got = (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.tie_word_embeddings)
        assert got == (layers, h, a, kv, ffn, tied), name
        assert (m.family, m.vocab_size, m.rope_theta) == ("llama", 128256, 500000.0)
    assert resolve_shape(ModelSection(size="llama3.2-1b")).rope_scaling is not None
    assert resolve_shape(ModelSection(size="llama3-8b")).rope_scaling is None


def _run(model: dict, tp: int = 1) -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "ds_megatron": {"model": {"seq_length": 32, "vocab_size": 1000, **model}, "parallel": {"tp": tp}},
    }
    resolve(cfg, tp)


@pytest.mark.parametrize(
    "model,tp,message",
    [
        (
            {"size": "llama-tiny"},
            4,
            "error: ds_megatron.parallel.tp: num_kv_heads not divisible by tp (num_kv_heads=2, tp=4); choose tp from "
            "[1, 2] (TP splits the KV heads like the query heads)",
        ),
        (
            {"size": "llama-tiny", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            1,
            "error: ds_megatron.model.rope_scaling: unsupported rope scaling type (rope_type='linear'); use one of "
            "('llama3',) or null (no scaling)",
        ),
        (
            {"size": "llama-tiny", "num_kv_heads": 3},
            1,
            "error: ds_megatron.model.num_kv_heads: must divide num_heads (num_heads=4, num_kv_heads=3); use one of "
            "[1, 2, 4]",
        ),
        (
            {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2},
            1,
            "error: ds_megatron.model.num_kv_heads: applies to the llama, qwen3_moe, mixtral, qwen2_moe families only "
            "(family=gpt2, num_kv_heads set); remove it or set model.family to one of llama, qwen3_moe, mixtral, "
            "qwen2_moe",
        ),
        (
            {"size": "gpt3-125m", "family": "llama"},
            1,
            "error: ds_megatron.model.family: differs from the named size's family (family='llama', size='gpt3-125m' "
            "is 'gpt2'); remove model.family or set it to 'gpt2'",
        ),
    ],
    ids=["kv-heads-vs-tp", "rope-scaling-type", "kv-heads-vs-heads", "llama-field-on-gpt2", "family-vs-size"],
)
def test_bad_llama_configs_are_refused_in_one_line(model, tp, message):
    with pytest.raises(ConfigError) as err:
        _run(model, tp)
    assert str(err.value) == message


def test_model_config_follows_the_family():
    m = resolve_shape(ModelSection(size="llama-tiny", vocab_size=500, seq_length=32))
    cfg = model_config(m)
    assert isinstance(cfg, LlamaConfig) and (cfg.num_kv_heads, cfg.intermediate_size) == (2, 352)
    assert isinstance(build_model(cfg), Llama)
