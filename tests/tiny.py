"""The tiny model shapes the unit tests share: a few layers of width 32-64, built and run in milliseconds.  Each helper
takes keyword overrides for the one or two numbers a test is about (a padded vocabulary, a layer count), so a reader
sees at the call what differs from the common shape."""

from __future__ import annotations

from typing import Any

from ds_megatron.model import GPTConfig, LlamaConfig

# The single-device models' own configs (transformers' field names of each family).
TINY_GPT = {"vocab_size": 128, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4}
TINY_LLAMA = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
}
# A run config's ``ds_megatron.model`` section (GPT-2, the default family): 4 layers so that pp 2 and pp 4 fit.
TINY_MODEL = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 1001, "seq_length": 16}


def tiny_gpt(**overrides: Any) -> GPTConfig:
    return GPTConfig(**{**TINY_GPT, **overrides})


def tiny_llama(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_model(**overrides: Any) -> dict[str, Any]:
    """A fresh ``ds_megatron.model`` section (a test may change it in place)."""
    return {**TINY_MODEL, **overrides}


def gpt_tiny(**overrides: Any) -> dict[str, Any]:
    """A ``ds_megatron.model`` section naming the ``gpt-tiny`` size, with the vocabulary and sequence length the
    named size leaves to the run."""
    return {"size": "gpt-tiny", "vocab_size": 1000, "seq_length": 32, **overrides}
