"""At tp 1 the GPT's logits equal transformers' GPT2LMHeadModel with the same weights."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_gpt
from transformers import GPT2LMHeadModel

from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.model.gpt2.model import GPT, GPTConfig


def to_hf_state_dict(state, cfg):
    return StateDictAdapter.of(cfg).to_hf_state_dict(state)


def from_hf_state_dict(hf_state, cfg):
    return StateDictAdapter.of(cfg).from_hf_state_dict(hf_state)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_logits_equal_transformers(attention):
    cfg = GPTConfig(vocab_size=1001, n_positions=64, n_embd=64, n_layer=3, n_head=4, attention=attention)
    ours = GPT(cfg, seed=3).eval()
    hf = GPT2LMHeadModel(cfg.to_hf()).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg))
    assert hf.config._attn_implementation == attention
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_hf_weights_load_back_bitwise():
    cfg = tiny_gpt(vocab_size=1001, n_positions=32)
    hf = GPT2LMHeadModel(cfg.to_hf())
    ours = GPT(GPTConfig.from_hf(hf.config))
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    back = to_hf_state_dict(ours.state_dict(), cfg)
    for name, tensor in hf.state_dict().items():
        if name in back:
            assert torch.equal(back[name], tensor), name


def test_config_round_trip():
    cfg = GPTConfig(vocab_size=1001, n_positions=128, n_embd=96, n_layer=3, n_head=6, attn_pdrop=0.0)
    assert GPTConfig.from_hf(cfg.to_hf()) == cfg


def test_unsupported_hf_config_is_refused():
    cfg = tiny_gpt(vocab_size=100, n_layer=1).to_hf()
    cfg.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        GPTConfig.from_hf(cfg)


def test_dropout_is_active_only_in_training():
    cfg = tiny_gpt(vocab_size=100, n_layer=1)
    model = GPT(cfg)
    ids = torch.randint(0, 100, (2, 8))
    model.train()
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))
