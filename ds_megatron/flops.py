"""L3: analytic FLOPs (Narayanan et al. 2021; Korthikanti et al. 2022), for every model family.  Pure Python.

Matmul FLOPs only (2 per multiply-add; norms, rotary embedding, softmax and activation functions are left out, so
recomputing the MLP activation or the norms adds none); backward costs twice the forward.  Per layer forward, with
kv = k d the width of K and V (k KV heads of d = h / a; kv = h without grouped-query attention) and F the MLP width:
- GPT (``family="gpt2"``, kv = h, F = 4h): QKV 6bsh^2 + QK^T 2bs^2h + xV 2bs^2h + projection 2bsh^2 + MLP (fc1 and
  fc2) 16bsh^2 = 24bsh^2 + 4bs^2h (Narayanan et al. 2021, sec. 5.1).
- Llama (``family="llama"``): q 2bsh^2, k and v 2 x 2bsh kv, o_proj 2bsh^2, QK^T and xV 4bs^2h (grouped-query
  attention shares K and V between query heads but still scores every query head), gate, up and down 3 x 2bshF
  = 4bsh^2 + 4bsh kv + 6bshF + 4bs^2h.
Both count the full s x s scores (the causal half is not discounted, as in the paper).  The logits cost 2bshV
whether the output layer is tied to the embedding or not.  A family gives its MLP's h x F matrices (``mlp_matrices``).
- Mixture of experts (``routed``: :class:`RoutedTerms`): attention of a heads of width d (Qwen3's d is not h / a):
  q and o_proj 2 x 2bsh(ad), k and v 2 x 2bsh(kd), QK^T and xV 4bs^2(ad); a dense layer's SwiGLU 6bshF; a routed
  layer's router 2bshE and, per token, its k experts' SwiGLUs 3 x 2bshF_e x k, and a shared expert's SwiGLU
  3 x 2bshF_s with its gate 2bsh (Qwen2-MoE).  Counted on the active parameters (the k experts a token reaches,
  not all E, and the shared expert every token passes through): MFU of a mixture of experts is on active
  parameters, as published.
"""

from __future__ import annotations

from typing import NamedTuple

from ds_megatron.config.schema import DEFAULT_SELECTIVE_MODULES, RECOMPUTE_MODULES
from ds_megatron.model import DEFAULT_FAMILY, family_named, model_config


def _dense_per_h2(
    h: int, family: str, num_heads: int | None, num_kv_heads: int | None, intermediate_size: int | None
) -> float:
    """A layer's weight-matmul FLOPs per b s h^2 (24 for GPT: q, k, v, output projection and the MLP)."""
    fam = family_named(family)
    if not fam.fixed_kv_and_width and (num_heads is None or num_kv_heads is None or intermediate_size is None):
        raise ValueError(f"the {family} family needs num_heads, num_kv_heads and intermediate_size")
    if num_kv_heads is not None and num_heads is None:
        raise ValueError("num_kv_heads needs num_heads (the KV width is num_kv_heads x h / num_heads)")
    kv = h if num_kv_heads is None else h // num_heads * num_kv_heads  # type: ignore[operator]
    ffn = 4 * h if intermediate_size is None else intermediate_size
    return 2 * (2 * h + 2 * kv + fam.mlp_matrices * ffn) / h


class RoutedTerms(NamedTuple):
    """What a mixture-of-experts shape adds to the FLOPs (``block_fields`` of a shape with experts)."""

    head_dim: int  # d (a heads of d: q is h -> a d)
    top_k: int  # experts per token
    expert_width: int  # each expert's SwiGLU width F_e
    num_experts: int  # E (the router's outputs)
    routed_layers: int  # layers with experts (the others have a dense SwiGLU of intermediate_size)
    shared_width: int = 0  # a routed layer's shared expert's SwiGLU width F_s (Qwen2-MoE); 0: none


def routed_layers_forward_flops(
    b: int, s: int, h: int, layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int, r: RoutedTerms
) -> float:
    """All ``layers`` layers' forward of a mixture of experts, on active parameters (module docstring)."""
    ad, kd = num_heads * r.head_dim, num_kv_heads * r.head_dim
    attention = 2 * b * s * h * (2 * ad + 2 * kd) + 4.0 * b * s * s * ad
    dense = 2 * b * s * h * 3 * intermediate_size
    shared = 3 * r.shared_width + 1 if r.shared_width else 0  # the shared expert's SwiGLU and its h -> 1 gate
    routed = 2 * b * s * h * (r.num_experts + 3 * r.expert_width * r.top_k + shared)
    return layers * attention + (layers - r.routed_layers) * dense + r.routed_layers * routed


def experts_forward_flops(b: int, s: int, h: int, r: RoutedTerms) -> float:
    """One routed layer's experts (what selective recompute of ``moe`` runs again): k SwiGLUs of F_e per token."""
    return 2.0 * b * s * h * 3 * r.expert_width * r.top_k


def layer_forward_flops(
    b: int,
    s: int,
    h: int,
    *,
    family: str = DEFAULT_FAMILY,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
) -> float:
    """One layer's forward.  GPT: 24 b s h^2 + 4 b s^2 h; Llama: (4 h^2 + 4 h kv + 6 h F) b s + 4 b s^2 h."""
    dense = _dense_per_h2(h, family, num_heads, num_kv_heads, intermediate_size)
    return dense * b * s * h * h + 4.0 * b * s * s * h


def core_attention_forward_flops(b: int, s: int, h: int) -> float:
    """QK^T and x V: what selective recompute runs again (the same for grouped-query attention)."""
    return 4.0 * b * s * s * h


def logits_forward_flops(b: int, s: int, h: int, vocab: int) -> float:
    return 2.0 * b * s * h * vocab


def model_flops_per_step(
    batch: int,
    s: int,
    layers: int,
    h: int,
    vocab: int,
    *,
    family: str = DEFAULT_FAMILY,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    routed: RoutedTerms | None = None,
) -> float:
    """GPT: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) for a global batch of B sequences (no recompute counted);
    Llama: 3 (L layer + logits) with its layer; a mixture of experts on active parameters.  The numerator of MFU."""
    block = dict(family=family, num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)
    layers_flops = _layers_forward(batch, s, h, layers, block, routed)
    return 3.0 * (layers_flops + logits_forward_flops(batch, s, h, vocab))


def _layers_forward(b: int, s: int, h: int, layers: int, block: dict, routed: RoutedTerms | None) -> float:
    if routed is None:
        return layers * layer_forward_flops(b, s, h, **block)
    return routed_layers_forward_flops(
        b, s, h, layers, block["num_heads"], block["num_kv_heads"], block["intermediate_size"], routed
    )


def recomputed_module_forward_flops(module: str, b: int, s: int, h: int) -> float:
    """Matmul FLOPs one block spends re-running one selective-recompute module (``config.RECOMPUTE_MODULES``):
    ``core_attn`` its QK^T and x V; ``mlp_act`` (GELU or SwiGLU's gate) and ``layernorm`` (the norms) are elementwise,
    a few FLOPs per element (about b s F and b s h), no matmul: 0 here, as the model FLOPs leave them out too.
    ``moe`` (the experts of a routed layer) is counted by ``executed_flops_per_step`` from the routed terms."""
    if module == "core_attn":
        return core_attention_forward_flops(b, s, h)
    if module in ("mlp_act", "layernorm", "moe"):
        return 0.0
    raise ValueError(f"unknown recompute module {module!r}; use one of {RECOMPUTE_MODULES}")


def executed_flops_per_step(
    batch: int,
    s: int,
    layers: int,
    h: int,
    vocab: int,
    recompute: str = "none",
    recomputed_layers: int | None = None,
    *,
    recompute_modules: tuple[str, ...] = (),
    family: str = DEFAULT_FAMILY,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    routed: RoutedTerms | None = None,
) -> float:
    """Model FLOPs plus recomputation: full re-runs the forward of ``recomputed_layers`` layers (all by default; a
    mixture of experts' average layer), selective re-runs the ``recompute_modules`` of every layer (empty:
    ``DEFAULT_SELECTIVE_MODULES``, the core attention), each at its own matmul FLOPs
    (``recomputed_module_forward_flops``; ``moe`` the experts of each routed layer).  The numerator of HFU."""
    block = dict(family=family, num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)
    flops = model_flops_per_step(batch, s, layers, h, vocab, **block, routed=routed)
    if recompute == "full":
        n = layers if recomputed_layers is None else recomputed_layers
        if routed is None:
            flops += n * layer_forward_flops(batch, s, h, **block)
        else:  # the average layer of a mixture of experts (dense and routed layers differ)
            flops += n / layers * _layers_forward(batch, s, h, layers, block, routed)
    elif recompute == "selective":
        modules = tuple(recompute_modules) or DEFAULT_SELECTIVE_MODULES
        flops += layers * sum(recomputed_module_forward_flops(m, batch, s, h) for m in modules)
        if "moe" in modules and routed is not None:
            flops += routed.routed_layers * experts_forward_flops(batch, s, h, routed)
    elif recompute != "none":
        raise ValueError(f"unknown recompute policy {recompute!r}")
    return flops


def block_fields(shape: object) -> dict:
    """The keyword arguments above from any shape with ``family``, ``num_heads``, ``num_kv_heads`` and
    ``intermediate_size`` attributes (``ds_megatron.config.ModelShape``), and ``routed`` for one with experts."""
    fields = {
        "family": getattr(shape, "family", DEFAULT_FAMILY),
        "num_heads": getattr(shape, "num_heads", None),
        "num_kv_heads": getattr(shape, "num_kv_heads", None),
        "intermediate_size": getattr(shape, "intermediate_size", None),
    }
    if getattr(shape, "num_experts", 0):
        fields["routed"] = routed_terms(shape)
    return fields


def routed_terms(shape: object) -> RoutedTerms:
    """A shape with experts (``ModelShape``); its routed layers by the family config's own rule (``is_sparse``)."""
    config = model_config(shape)
    return RoutedTerms(
        config.head_dim,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        config.num_experts,
        sum(config.is_sparse(i) for i in range(config.num_layers)),
        getattr(config, "shared_expert_intermediate_size", 0),
    )
