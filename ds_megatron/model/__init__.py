"""L2': the single-device GPT with Hugging Face GPT-2 parameter names.  Imports torch only."""

from ds_megatron.model.config import GPTConfig
from ds_megatron.model.gpt import GPT, MLP, CausalSelfAttention, CoreAttention, GPTBlock, init_module, init_parameter

__all__ = [
    "GPT",
    "GPTBlock",
    "GPTConfig",
    "MLP",
    "CausalSelfAttention",
    "CoreAttention",
    "init_module",
    "init_parameter",
]
