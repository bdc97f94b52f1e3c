"""The single-device Qwen2-MoE: the MoE decoder of ``model/qwen3_moe/model.py`` built from a ``Qwen2MoeConfig`` (q,
k and v with biases, no q/k norm, a shared expert in every routed layer).  Torch only."""

from __future__ import annotations

from ds_megatron.model.qwen3_moe.model import MODELING

__all__ = ["MODELING"]
