"""The single-device Mixtral: the MoE decoder of ``model/qwen3_moe/model.py`` built from a ``MixtralConfig`` (no
q/k norm, every layer routed, top-k always renormalised).  Torch only."""

from __future__ import annotations

from ds_megatron.model.qwen3_moe.model import MODELING

__all__ = ["MODELING"]
