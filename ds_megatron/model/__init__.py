"""L2': the single-device models with Hugging Face parameter names, one file per family.  Imports torch only.

``FAMILIES`` maps the config's ``model.family`` to the family's config, model and block classes and initialiser;
code that builds a model from a resolved shape calls :func:`model_config` and :func:`build_model`."""

from __future__ import annotations

from typing import Any, NamedTuple

from ds_megatron.model.config import GPTConfig
from ds_megatron.model.gpt import GPT, MLP, CausalSelfAttention, CoreAttention, GPTBlock, init_module, init_parameter
from ds_megatron.model.llama import Llama, LlamaBlock, LlamaConfig, init_llama_module


class Family(NamedTuple):
    config: type
    model: type
    block: type
    init: Any  # init(module, config, seed, prefix): parameters initialised by full name


FAMILIES: dict[str, Family] = {
    "gpt2": Family(GPTConfig, GPT, GPTBlock, init_module),
    "llama": Family(LlamaConfig, Llama, LlamaBlock, init_llama_module),
}

ModelConfig = GPTConfig | LlamaConfig


def model_config(shape: Any) -> ModelConfig:
    """The family's model config from a resolved ``ModelShape``."""
    return FAMILIES[getattr(shape, "family", "gpt2")].config.from_shape(shape)


def family_of(config: ModelConfig) -> Family:
    return FAMILIES[config.family]


def build_model(config: ModelConfig, seed: int = 1234):
    """The single-device model of ``config``'s family."""
    return family_of(config).model(config, seed=seed)


__all__ = [
    "FAMILIES",
    "GPT",
    "GPTBlock",
    "GPTConfig",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "MLP",
    "CausalSelfAttention",
    "CoreAttention",
    "build_model",
    "family_of",
    "init_module",
    "init_parameter",
    "model_config",
]
