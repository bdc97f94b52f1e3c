"""Selective, full-uniform and full-block recompute give the gradients of no recompute with
dropout 0.1 and the same seed (exact RNG replay), inside the pipeline engine at tp 2 x pp 2, with and without SP."""

from __future__ import annotations

import pytest
from tiny import gpt_tiny

from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.schema import RecomputeSection


def test_chunks():
    assert RecomputeSection("none").chunks(4) == [(0, 4, False)]
    assert RecomputeSection("selective").chunks(3) == [(0, 3, False)]
    assert RecomputeSection("full", num_layers=2, method="uniform").chunks(5) == [
        (0, 2, True),
        (2, 4, True),
        (4, 5, True),
    ]
    assert RecomputeSection("full", num_layers=2, method="block").chunks(5) == [
        (0, 1, True),
        (1, 2, True),
        (2, 5, False),
    ]
    assert RecomputeSection("full", num_layers=3, method="block").chunks(3) == [
        (0, 1, True),
        (1, 2, True),
        (2, 3, True),
    ]


def _cfg(**recompute):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "ds_megatron": {
            "model": {
                "num_layers": 8,
                "hidden_size": 64,
                "num_heads": 4,
                "vocab_size": 100,
                "seq_length": 16,
                "attention": recompute.pop("attention", "eager"),
            },
            "parallel": {"tp": 1, "pp": 2},
            "recompute": recompute,
        },
    }


def test_selective_with_sdpa_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="sdpa kernel never stores"):
        resolve(_cfg(policy="selective", attention="sdpa"), 2)


def test_more_recomputed_layers_than_a_stage_holds_is_refused():
    with pytest.raises(ConfigError, match=r"num_layers=5, 8 layers / pp 2 = at most 4 per stage"):
        resolve(_cfg(policy="full", num_layers=5, method="block"), 2)
    assert resolve(_cfg(policy="full", num_layers=4, method="uniform"), 2).section.recompute.num_layers == 4


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_full_recompute_replays_dropout_for_both_attention_kernels(kernel):
    """On CPU, sdpa's dropout (the fused kernel's own RNG draws) is replayed exactly by full recompute, as eager's:
    gradients with recompute equal those without, bit for bit, with dropout 0.1 everywhere."""
    import torch

    from ds_megatron.model.gpt2.model import GPTBlock, GPTConfig, init_module
    from ds_megatron.random import build_rng
    from ds_megatron.recompute import checkpoint

    cfg = GPTConfig(32, 32, 32, 1, 4, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1, attention=kernel)
    block = GPTBlock(cfg)
    init_module(block, cfg, 1, prefix="transformer.h.0.")
    x = torch.randn(32, 2, 32, generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        rng = build_rng(7, 0, 0, 0)
        xi = x.clone().requires_grad_()
        y = checkpoint(block.train(), xi, rng=rng) if recompute else block.train()(xi)
        y.square().sum().backward()
        grads.append([xi.grad.clone()] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert not torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))


@pytest.mark.parametrize(
    "recompute,attention,message",
    [
        (
            {"policy": "selective"},
            "sdpa",
            "error: ds_megatron.recompute.modules: core_attn recomputes the s x s attention core, which the sdpa "
            "kernel never stores, so it would save nothing and cost a recompute (policy=selective, "
            "modules=['core_attn'] (the default), attention=sdpa); with sdpa list other modules in "
            "ds_megatron.recompute.modules (e.g. mlp_act, layernorm), or set ds_megatron.model.attention to eager",
        ),
        (
            {"policy": "selective", "modules": ["mlp_act", "gelu"]},
            "eager",
            "error: ds_megatron.recompute.modules: unknown or repeated module (got ['mlp_act', 'gelu']); list each at "
            "most once from ['core_attn', 'mlp_act', 'layernorm', 'moe']",
        ),
        (
            {"policy": "full", "modules": ["mlp_act"]},
            "eager",
            "error: ds_megatron.recompute.modules: applies to policy selective only (policy='full', "
            "modules=['mlp_act']); set policy \"selective\" or remove modules",
        ),
    ],
    ids=["core-attn-with-sdpa", "unknown-module", "modules-without-selective"],
)
def test_recompute_modules_are_validated(recompute, attention, message):
    from ds_megatron.config import ConfigError, resolve

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "ds_megatron": {
            "model": gpt_tiny(attention=attention),
            "recompute": recompute,
        },
    }
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 1)
    assert str(err.value) == message


def test_recompute_modules_compose_with_sdpa():
    from ds_megatron.config import resolve

    model = gpt_tiny(attention="sdpa")
    cfg = {"train_micro_batch_size_per_gpu": 1, "ds_megatron": {"model": model}}
    cfg["ds_megatron"]["recompute"] = {"policy": "selective", "modules": ["mlp_act", "layernorm"]}
    assert resolve(cfg, 1).section.recompute.modules == ("mlp_act", "layernorm")


def test_recompute_without_a_tracker_replays_the_cuda_generator(monkeypatch):
    """Without a tracker (rng=None) the checkpoint captures the global generators, the current CUDA device's too
    once CUDA is in use: every dropout on a CUDA tensor draws from it, so capturing the CPU's alone would draw a new
    mask in the recompute.  Here torch.cuda's RNG is a stand-in generator and CUDA reports itself initialised; the
    region draws its "CUDA dropout" mask from it: backward must see the forward's mask and leave the generator where
    the forward left it."""
    import torch

    from ds_megatron.recompute import checkpoint

    fake_cuda = torch.Generator().manual_seed(5)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": fake_cuda.get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": fake_cuda.set_state(state))

    def region(x):  # dropout as CUDA runs it: the mask comes from the device's generator
        return x * (torch.rand(x.shape, generator=fake_cuda) > 0.5)

    x = torch.ones(64, requires_grad=True)
    y = checkpoint(region, x, rng=None)
    after_forward = fake_cuda.get_state()
    mask = y.detach()  # the forward's mask (x is ones)
    assert 0 < mask.sum() < 64
    y.sum().backward()
    assert torch.equal(x.grad, mask)
    assert torch.equal(fake_cuda.get_state(), after_forward)
