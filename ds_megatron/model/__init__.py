"""L2': the model families, one folder each (``gpt2/``, ``llama/``), and the one registry every other module reads.
Stdlib only here and in each folder's ``__init__`` and ``config``: the tuner and the analytic formulas import the
registry without torch; a family's torch side (``<family>/model.py``) is imported on first use.

A family folder holds its config with the transformers mapping (``config.py``), its record (``__init__.py``: plan
rows, pipeline layout, transformers names, FLOPs and activation-memory terms; ``ds_megatron.model.family.Family``)
and its single-device model with transformers' parameter names and initialiser (``model.py``).  A new family is a
new folder plus one line below.
"""

from __future__ import annotations

from typing import Any

from ds_megatron.model import gpt2, llama
from ds_megatron.model.family import Family
from ds_megatron.model.gpt2.config import GPTConfig
from ds_megatron.model.llama.config import LlamaConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY)}
DEFAULT_FAMILY = gpt2.FAMILY.name  # a shape without a family is a GPT

ModelConfig = GPTConfig | LlamaConfig


def family(name: str) -> Family:
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


__all__ = ["DEFAULT_FAMILY", "FAMILIES", "Family", "GPTConfig", "LlamaConfig", "ModelConfig", "build_model"]
__all__ += ["family", "family_of", "model_config"]
