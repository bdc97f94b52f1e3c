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
"""

from __future__ import annotations

from ds_megatron.config.schema import DEFAULT_SELECTIVE_MODULES, RECOMPUTE_MODULES
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES


def _dense_per_h2(
    h: int, family: str, num_heads: int | None, num_kv_heads: int | None, intermediate_size: int | None
) -> float:
    """A layer's weight-matmul FLOPs per b s h^2 (24 for GPT: q, k, v, output projection and the MLP)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    fam = FAMILIES[family]
    if not fam.fixed_kv_and_width and (num_heads is None or num_kv_heads is None or intermediate_size is None):
        raise ValueError(f"the {family} family needs num_heads, num_kv_heads and intermediate_size")
    if num_kv_heads is not None and num_heads is None:
        raise ValueError("num_kv_heads needs num_heads (the KV width is num_kv_heads x h / num_heads)")
    kv = h if num_kv_heads is None else h // num_heads * num_kv_heads  # type: ignore[operator]
    ffn = 4 * h if intermediate_size is None else intermediate_size
    return 2 * (2 * h + 2 * kv + fam.mlp_matrices * ffn) / h


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
) -> float:
    """GPT: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) for a global batch of B sequences (no recompute counted);
    Llama: 3 (L layer + logits) with its layer.  The numerator of MFU."""
    block = dict(family=family, num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)
    return 3.0 * (layers * layer_forward_flops(batch, s, h, **block) + logits_forward_flops(batch, s, h, vocab))


def recomputed_module_forward_flops(module: str, b: int, s: int, h: int) -> float:
    """Matmul FLOPs one block spends re-running one selective-recompute module (``config.RECOMPUTE_MODULES``):
    ``core_attn`` its QK^T and x V; ``mlp_act`` (GELU or SwiGLU's gate) and ``layernorm`` (the norms) are elementwise,
    a few FLOPs per element (about b s F and b s h), no matmul: 0 here, as the model FLOPs leave them out too."""
    if module == "core_attn":
        return core_attention_forward_flops(b, s, h)
    if module in ("mlp_act", "layernorm"):
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
) -> float:
    """Model FLOPs plus recomputation: full re-runs the forward of ``recomputed_layers`` layers (all by default),
    selective re-runs the ``recompute_modules`` of every layer (empty: ``DEFAULT_SELECTIVE_MODULES``, the core
    attention), each at its own matmul FLOPs (``recomputed_module_forward_flops``).  The numerator of HFU."""
    block = dict(family=family, num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size)
    flops = model_flops_per_step(batch, s, layers, h, vocab, **block)
    if recompute == "full":
        n = layers if recomputed_layers is None else recomputed_layers
        flops += n * layer_forward_flops(batch, s, h, **block)
    elif recompute == "selective":
        modules = tuple(recompute_modules) or DEFAULT_SELECTIVE_MODULES
        flops += layers * sum(recomputed_module_forward_flops(m, batch, s, h) for m in modules)
    elif recompute != "none":
        raise ValueError(f"unknown recompute policy {recompute!r}")
    return flops


def block_fields(shape: object) -> dict:
    """The keyword arguments above from any shape with ``family``, ``num_heads``, ``num_kv_heads`` and
    ``intermediate_size`` attributes (``ds_megatron.config.ModelShape``)."""
    return {
        "family": getattr(shape, "family", DEFAULT_FAMILY),
        "num_heads": getattr(shape, "num_heads", None),
        "num_kv_heads": getattr(shape, "num_kv_heads", None),
        "intermediate_size": getattr(shape, "intermediate_size", None),
    }
