"""The single-device GPT.  It knows nothing about parallelism (torch only).

Parameter names follow the Hugging Face GPT-2 keys (``transformer.h.0.attn.c_attn.weight``...).  Linear weights are
stored as ``nn.Linear`` ([out, in]); GPT-2's ``Conv1D`` stores [in, out], so the HF key map transposes them.

Activations inside the transformer stack are laid out ``[s, b, h]`` (sequence first), so a sequence shard is a
contiguous slice of dim 0; ``GPT.forward`` takes ``[b, s]`` ids and returns ``[b, s, V]`` logits like transformers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ds_megatron.model.gpt2 import FAMILY, GPTConfig
from ds_megatron.model.layers import (
    SINGLE_DEVICE,
    BlockHooks,
    CoreAttention,
    Modeling,
    Slices,
    TiedEmbedding,
    init_by_name,
    whole,
)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # fused [q | k | v], each head-major
        self.core_attention = CoreAttention(config)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, hooks: BlockHooks, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [s, b, h] -> [s, b, h].  After TP the local head count is read off c_attn's output width.  ``doc_ids``
        [b, s] (packed documents): attention stays inside each document."""
        qkv = self.c_attn(x)  # [s, b, 3 * n_local * d]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each [b, n_local, s, d]
        ctx = hooks.core_attention(self.core_attention, q, k, v, doc_ids)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n_local * d]
        return self.resid_dropout(self.c_proj(ctx))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, hooks: BlockHooks) -> torch.Tensor:
        return self.dropout(hooks.around_act(gelu_tanh, (self.c_fc(x),), self.c_proj))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block.  ``hooks``: what TP, SP and recompute change in its forward (the default is
    the single-device block; ``ds_megatron.parallelize.parallelize_block`` sets the parallel ones)."""

    def __init__(self, config: GPTConfig, hooks: BlockHooks = SINGLE_DEVICE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.hooks = hooks

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [s(/t), b, h] -> same: x + attn(ln_1(x)), then + mlp(ln_2(.)).  ``doc_ids`` [b, s] (packed documents);
        ``positions`` are unused here (learned positions are added before the blocks)."""
        hooks = self.hooks
        x = x + hooks.around_norm(self.ln_1, (x,), lambda y: self.attn(y, hooks, doc_ids))
        return x + hooks.around_norm(self.ln_2, (x,), lambda y: self.mlp(y, hooks))


class GPT(nn.Module):
    """GPT-2/GPT-3 language model with tied input/output embedding."""

    def __init__(self, config: GPTConfig, seed: int = 1234):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=TiedEmbedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                drop=nn.Dropout(config.embd_pdrop),
                h=nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        init_module(self, config, seed)

    def forward(
        self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V].  Packed documents (``data.document_mask``): ``doc_ids`` and
        ``positions`` [b, s] (``data.document_mask.document_layout``) keep attention inside each document and give
        each token its position (per row); without them, positions 0..s-1 and attention over the whole window."""
        t = self.transformer
        if positions is None:
            pos = t.wpe(torch.arange(input_ids.shape[1], device=input_ids.device)).unsqueeze(1)  # [s, 1, h]
        else:
            pos = t.wpe(positions.t())  # [s, b, h]
        x = t.drop(t.wte(input_ids.t()) + pos)  # [s, b, h]
        for block in t.h:
            x = block(x, doc_ids)
        return t.wte.logits(t.ln_f(x)).transpose(0, 1)


def init_module(
    module: nn.Module, config: GPTConfig, seed: int, prefix: str = "", slices: Slices | None = None
) -> None:
    """GPT-2 initialisation of every parameter of ``module`` by its full name ``prefix + local name``: N(0, std) for
    weights, std / sqrt(2 L) for the residual projections, ones and zeros for the LayerNorms and biases
    (``slices``: the part of each full parameter the module holds, ``model.layers.Slices``; None: all)."""

    def std_of(name: str) -> float | None:
        if name.endswith("c_proj.weight"):
            return config.initializer_range / math.sqrt(2 * config.n_layer)
        leaf = name.split(".")[-2] if "." in name else name
        return config.initializer_range if name.endswith(".weight") and not leaf.startswith("ln_") else None

    init_by_name(module, prefix, seed, std_of, slices or whole(FAMILY))


def final_norm(config: GPTConfig) -> nn.Module:
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


# The state-dict adapter to and from transformers' GPT2LMHeadModel: the names are identical; the Conv1D weights are
# transposed; lm_head.weight, tied to transformer.wte.weight, is written for transformers' sake and never read back.


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full (unsharded, unpadded) state dict -> GPT2LMHeadModel's."""
    out = {name: (t.t().contiguous() if FAMILY.is_hf_transposed(name) else t) for name, t in state.items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict -> ours (drops the tied head and non-parameter buffers)."""
    skip = ("lm_head.weight", ".attn.bias", ".attn.masked_bias")
    return {
        n: t.t().contiguous() if FAMILY.is_hf_transposed(n) else t for n, t in hf_state.items() if not n.endswith(skip)
    }


MODELING = Modeling(GPT, GPTBlock, final_norm, init_module)
