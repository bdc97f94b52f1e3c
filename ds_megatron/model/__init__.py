"""L0: the model families, one folder each, and the one registry every other module reads.  A folder's
``__init__`` (stdlib only: the config and the tuner read it without torch, below the config) holds its config with
the transformers mapping and its record (``model.family.Family``: sizes, plan rows, pipeline layout, FLOPs and
memory terms); its ``model.py`` the
single-device model with transformers' names, imported on first use.  A new family: a folder and one line below.
"""

from __future__ import annotations

from typing import Any

from ds_megatron.model import gpt2, llama, mixtral, qwen2_moe, qwen3_moe
from ds_megatron.model.family import Family
from ds_megatron.model.gpt2 import GPTConfig
from ds_megatron.model.llama import LlamaConfig
from ds_megatron.model.mixtral import MixtralConfig
from ds_megatron.model.qwen2_moe import Qwen2MoeConfig
from ds_megatron.model.qwen3_moe import Qwen3MoeConfig

FAMILIES: dict[str, Family] = {
    f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY)
}
DEFAULT_FAMILY = gpt2.FAMILY.name  # a shape without a family is a GPT

ModelConfig = GPTConfig | LlamaConfig | Qwen3MoeConfig | MixtralConfig | Qwen2MoeConfig


def family_named(name: str) -> Family:
    """The registered family ``name`` (the analytic formulas' ``family=`` argument); ValueError naming the others."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_of(config: Any) -> Family:
    """The family of a model config or a resolved shape (``ds_megatron.config.ModelShape``)."""
    return FAMILIES[getattr(config, "family", None) or DEFAULT_FAMILY]


def model_config(shape: Any) -> ModelConfig:
    """The family's model config from a resolved ``ModelShape``."""
    return family_of(shape).config.from_shape(shape)


def build_model(config: ModelConfig, seed: int = 1234) -> Any:
    """The single-device model of ``config``'s family (imports torch)."""
    return family_of(config).torch_side().model(config, seed=seed)


__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "Family",
    "GPTConfig",
    "LlamaConfig",
    "MixtralConfig",
    "ModelConfig",
    "Qwen2MoeConfig",
    "Qwen3MoeConfig",
    "build_model",
    "family_named",
    "family_of",
]
__all__ += ["model_config"]
