"""L3: analytic FLOPs (Narayanan et al. 2021; Korthikanti et al. 2022).  Pure Python.

Matmul FLOPs only (2 per multiply-add); backward costs twice the forward.  Per layer forward:
QKV 6bsh^2 + QK^T 2bs^2h + xV 2bs^2h + projection 2bsh^2 + MLP 16bsh^2 = 24bsh^2 + 4bs^2h.
"""

from __future__ import annotations


def layer_forward_flops(b: int, s: int, h: int) -> float:
    return 24.0 * b * s * h * h + 4.0 * b * s * s * h


def core_attention_forward_flops(b: int, s: int, h: int) -> float:
    """QK^T and x V: what selective recompute runs again."""
    return 4.0 * b * s * s * h


def logits_forward_flops(b: int, s: int, h: int, vocab: int) -> float:
    return 2.0 * b * s * h * vocab


def model_flops_per_step(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """72 B s L h^2 (1 + s/(6h) + V/(12 h L)) for a global batch of B sequences (no recompute counted)."""
    return 3.0 * (layers * layer_forward_flops(batch, s, h) + logits_forward_flops(batch, s, h, vocab))


def executed_flops_per_step(
    batch: int, s: int, layers: int, h: int, vocab: int, recompute: str = "none", recomputed_layers: int | None = None
) -> float:
    """Model FLOPs plus recomputation: full re-runs the forward of ``recomputed_layers`` layers (all by default),
    selective re-runs the core attention of every layer."""
    flops = model_flops_per_step(batch, s, layers, h, vocab)
    if recompute == "full":
        n = layers if recomputed_layers is None else recomputed_layers
        flops += n * layer_forward_flops(batch, s, h)
    elif recompute == "selective":
        flops += layers * core_attention_forward_flops(batch, s, h)
    elif recompute != "none":
        raise ValueError(f"unknown recompute policy {recompute!r}")
    return flops
