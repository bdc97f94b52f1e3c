"""The state-dict adapter between ds_megatron's GPT and Hugging Face ``GPT2LMHeadModel``.

Names are identical; GPT-2's ``Conv1D`` stores [in, out] where our ``nn.Linear`` stores [out, in], so those four
weights are transposed.  ``lm_head.weight`` is tied to ``transformer.wte.weight`` and is written for transformers'
sake but never read back as a separate tensor.
"""

from __future__ import annotations

import torch

from ds_megatron.model.gpt2 import FAMILY

TIED_HEAD = "lm_head.weight"
WTE = "transformer.wte.weight"
is_conv1d = FAMILY.is_hf_transposed


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full (unsharded, unpadded) state dict -> GPT2LMHeadModel's."""
    out = {name: (t.t().contiguous() if is_conv1d(name) else t) for name, t in state.items()}
    out[TIED_HEAD] = out[WTE]
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict -> ours (drops the tied head and non-parameter buffers)."""
    out = {}
    for name, t in hf_state.items():
        if name == TIED_HEAD or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[name] = t.t().contiguous() if is_conv1d(name) else t
    return out
