"""L3: analytic activation memory (Korthikanti et al. 2022, sec. 4), for both model families.  Pure Python.

Per transformer layer, in bytes, for s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.  The
paper counts 2-byte activations and 1-byte dropout masks; ``act_bytes`` and ``mask_bytes`` generalise that so a
measurement in another dtype (fp32 on CPU: 4 and 4) can be compared term by term.  ``family`` picks the block
("gpt2", the paper's; "llama", below); the attention kernels and the recompute policies are shared by both.

GPT terms (``family="gpt2"``), in units of s*b*h elements (from the paper's sec. 4.1), with the eager attention
kernel (the paper's setting):
- replicated under TP, split by SP ("10" in the paper): two LayerNorm inputs (2), QKV and fc1 inputs (2) in
  activation bytes, and the attention-output and MLP dropout masks (2) in mask bytes;
- split by TP ("24"): Q, K, V (3), projection input (1), GELU input (4), fc2 input (4) in activation bytes;
- the s^2 terms (5 a s / h), split by TP: softmax output and dropout output (2 a s / h) in activation bytes and the
  softmax dropout mask (a s / h) in mask bytes.  Selective recompute drops them; full recompute keeps only the
  layer input (1 in activation bytes, split by SP).

Llama terms (``family="llama"``: RMSNorm, rotary embedding, grouped-query attention with k KV heads of d = h / a,
SwiGLU of width F, no biases), per token (units of s*b elements), the paper's sec. 4.1 bookkeeping applied to the
tensors this block saves for backward:
- replicated under TP, split by SP: the two RMSNorm inputs (2 h) and their fp32 1/rms (one 4-byte number per token
  each: 8 bytes), the input shared by q/k/v (h) and the input shared by gate/up (h): 4 h in activation bytes
  + 8 bytes.  Under SP the column-parallel projections keep only the sequence shard of their input.
- split by TP: Q after the rotary embedding, as scaled for the scores (h), K after it and V (k d each: grouped-query
  attention folds each KV head's group of query heads into the rows of the matmul, so K and V are stored at KV size,
  never expanded to a heads), the o_proj input (h), SwiGLU's gate and up (2 F: silu(gate) * up is one autograd
  function that keeps only its two inputs) and the down_proj input (F): 2 h + 2 k d + 3 F in activation bytes.
- the s^2 terms, split by TP: the softmax output (a s, activation bytes); with an attention dropout p > 0 (Llama's
  only dropout; 0 in the published recipes) also its output (a s, activation bytes) and mask (a s, mask bytes), with
  p = 0 nothing (dropout returns its input).  There is no residual or embedding dropout.  The rotary cos/sin tables
  are buffers shared by every block (2 s d elements per process, not per layer), so they are not counted.
- eager, p = 0, no recompute: 4 h act + 8 bytes split by SP, (2 h + 2 k d + 3 F) act + a s act split by TP.
Selective recompute drops the s^2 terms; full recompute keeps the block input (h act, split by SP), as for GPT.

With ``attention="sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) what is stored depends on the path
torch takes, so ``sdpa_path`` names it (the same for both families):
- ``"fused"`` (the default; CUDA's flash and memory-efficient kernels, and the CPU flash kernel, which torch uses
  when the attention dropout is 0, grouped-query attention included): no s^2 term at all.  The kernel saves Q, K, V
  (at KV size under grouped-query attention; already counted), its output (the projection input, already counted:
  the output is laid out [b, s, a, d] in memory, so the [s, b, h] projection input is a view of it) and the
  log-sum-exp of each score row, fp32 [b, a/t, s]: 4 a s b / t bytes = 4 a / (h t) in units of s*b*h bytes, split by
  TP (heads) and unchanged by SP.  The memory-efficient kernel pads that row to a multiple of 32 (the same for s
  divisible by 32); flash's dropout keeps only an RNG seed and offset (two scalars, not counted).
- ``"math"`` (torch's reference path, which the CPU takes whenever the attention dropout is non-zero, and CUDA only
  when no fused kernel accepts the inputs): the s^2 terms of the eager kernel come back, and everything the path
  saves is in ``math_act_bytes`` (it upcasts bf16 and fp16 to fp32: 4) with ``math_mask_bytes`` dropout masks (the
  mask torch keeps for an fp32 dropout: 4 on CPU, 1 on CUDA): scaled copies of Q, K and V (3 h elements per token,
  replacing the Q, K, V counted in activation bytes; the path repeats K and V to all a query heads first, so they
  are h each even under grouped-query attention, as measured on CPU), softmax and dropout outputs (a s each in
  ``math_act_bytes``) and the mask (a s in ``math_mask_bytes``; the dropout terms only when there is a dropout).
  The projection input is a copy in activation bytes (1, unchanged); no log-sum-exp is kept.
Selective recompute takes ``modules``: ``core_attn`` (the default, the paper's selective recompute) drops the s^2
terms and is refused with sdpa (the config loader refuses it too: the fused kernels never store the s x s core);
``mlp_act`` drops the MLP activation's output (the second linear's input: 4h per token for GPT, F for Llama, split by
TP) and ``layernorm`` the two norm outputs (the first linears' inputs: 2h, split by SP), with any kernel.  Full
recompute keeps the block input whatever the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from ds_megatron.config.schema import (
    ATTENTION_KERNELS,
    DEFAULT_SELECTIVE_MODULES,
    RECOMPUTE_MODULES,
    RECOMPUTE_POLICIES,
)

MODES = RECOMPUTE_POLICIES  # "none", "selective", "full"
KERNELS = ATTENTION_KERNELS  # "eager", "sdpa"
SDPA_PATHS = ("fused", "math")
LSE_BYTES = 4  # the fused sdpa kernels keep each score row's log-sum-exp in fp32, whatever the activation dtype
RSTD_BYTES = 4  # RMSNorm keeps one fp32 1/rms per token for its backward, whatever the activation dtype


class BlockTerms(NamedTuple):
    """One block's stored tensors outside the attention core's s^2 terms, in units of s*b*h."""

    replicated: float  # bytes replicated under TP, split by SP, in activation dtype (plus fp32 norm statistics)
    replicated_masks: int  # dropout masks, placed like the above (mask_bytes each)
    split: float  # bytes split by TP, in activation dtype
    qkv: float  # Q, K and V in units of h elements (what the sdpa math path saves again in its own dtype)
    attention_dropout: bool  # the core has a dropout (its output and mask are s^2 terms)
    mlp_act: float  # the MLP activation's output (the second linear's input), units of h; "mlp_act" drops it


def _gpt2_terms(
    h: int, a: int, num_kv_heads: int | None, intermediate_size: int | None, attention_dropout: float | None, act: int
) -> BlockTerms:
    """The paper's GPT block (the GPT terms above; fewer KV heads or another MLP width scale their terms).  Its
    dropouts are always counted: the paper's table is for a GPT trained with dropout."""
    if attention_dropout is not None:
        raise ValueError("attention_dropout applies to the llama family; the GPT formula counts its dropouts as on")
    kv = 1.0 if num_kv_heads is None else num_kv_heads / a  # k d / h
    ffn = 4.0 if intermediate_size is None else intermediate_size / h  # F / h
    # paper: 10 = 4 activations + 2 masks (in its bytes: 2 x 4 + 2); 24 = Q, projection input, K, V, GELU and fc2
    # inputs (2 x 12)
    return BlockTerms(4 * act, 2, (2 + 2 * kv + 2 * ffn) * act, 1 + 2 * kv, True, ffn)


def _llama_terms(
    h: int, a: int, num_kv_heads: int | None, intermediate_size: int | None, attention_dropout: float | None, act: int
) -> BlockTerms:
    """The Llama block (the Llama terms above)."""
    if num_kv_heads is None or intermediate_size is None:
        raise ValueError("the llama family needs num_kv_heads and intermediate_size")
    kv = num_kv_heads / a  # k d / h
    ffn = intermediate_size / h  # F / h
    replicated = 4 * act + 2 * RSTD_BYTES / h  # two norm inputs, the q/k/v and gate/up inputs; two fp32 1/rms
    split = (2 + 2 * kv + 3 * ffn) * act  # Q, o_proj input, K, V, gate, up, down_proj input
    return BlockTerms(replicated, 0, split, 1 + 2 * kv, bool(attention_dropout), ffn)


# One row per model family: its block's terms (the attention kernels and recompute policies are shared).
BLOCKS = {"gpt2": _gpt2_terms, "llama": _llama_terms}


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    mask_bytes: int = 1,
    attention: str = "eager",
    sdpa_path: str = "fused",
    math_act_bytes: int = 4,
    math_mask_bytes: int = 4,
    *,
    family: str = "gpt2",
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    attention_dropout: float | None = None,
    modules: tuple[str, ...] = (),
) -> float:
    """Bytes of activations one transformer layer keeps for backward, per TP rank.

    ``modules`` (selective recompute only; empty means ``("core_attn",)``): ``core_attn`` drops the s^2 terms,
    ``mlp_act`` the MLP activation's output (GELU's 4h, SwiGLU's F per token, split by TP), ``layernorm`` the two
    norm outputs (2h per token, split by SP): each is recomputed from what its function keeps anyway.

    ``attention`` "eager" is the paper's table; "sdpa" with ``sdpa_path`` "fused" drops the s^2 terms and adds
    the fp32 log-sum-exp, 4 a s b / t bytes; "math" is the reference path described in the module docstring.
    ``family`` "llama" needs ``num_kv_heads`` and ``intermediate_size``; its ``attention_dropout`` defaults to 0
    (the GPT formula always counts dropout, the paper's setting)."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if attention not in KERNELS:
        raise ValueError(f"attention must be one of {KERNELS}, got {attention!r}")
    if sdpa_path not in SDPA_PATHS:
        raise ValueError(f"sdpa_path must be one of {SDPA_PATHS}, got {sdpa_path!r}")
    if family not in BLOCKS:
        raise ValueError(f"family must be one of {tuple(BLOCKS)}, got {family!r}")
    if modules and recompute != "selective":
        raise ValueError(f"modules apply to selective recompute only, got recompute={recompute!r}")
    modules = (tuple(modules) or DEFAULT_SELECTIVE_MODULES) if recompute == "selective" else ()
    if set(modules) - set(RECOMPUTE_MODULES):
        raise ValueError(f"modules must be among {RECOMPUTE_MODULES}, got {modules}")
    if attention == "sdpa" and "core_attn" in modules:
        raise ValueError("selective recompute of core_attn checkpoints the s x s core, which sdpa never stores")
    terms = BLOCKS[family](h, a, num_kv_heads, intermediate_size, attention_dropout, act_bytes)
    sp = sequence_parallel and t > 1
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (t if sp else 1)
    replicated = terms.replicated + terms.replicated_masks * mask_bytes
    split = terms.split
    if "layernorm" in modules:
        replicated -= 2 * act_bytes  # the q/k/v (c_attn) input and the fc1 (gate/up) input
    if "mlp_act" in modules:
        split -= terms.mlp_act * act_bytes
    if "core_attn" in modules:
        quadratic = 0.0
    elif attention == "sdpa" and sdpa_path == "fused":
        quadratic = LSE_BYTES * a / h  # the log-sum-exp in place of the s^2 terms; split by TP like them
    elif attention == "sdpa":
        split += 3 * math_act_bytes - terms.qkv * act_bytes  # Q, K, V saved as the path's own (upcast, expanded) copies
        quadratic = (math_act_bytes + (math_act_bytes + math_mask_bytes if terms.attention_dropout else 0)) * a * s / h
    else:  # softmax output, and the dropout's output and mask (paper: 5 a s / h)
        quadratic = (act_bytes + (act_bytes + mask_bytes if terms.attention_dropout else 0)) * a * s / h
    if sp:
        return sbh * (replicated + split + quadratic) / t
    return sbh * (replicated + (split + quadratic) / t)


def lse_bytes_per_layer(s: int, b: int, a: int, t: int = 1) -> float:
    """The fused sdpa kernels' log-sum-exp per layer and TP rank: fp32 [b, a/t, s]."""
    return LSE_BYTES * a * s * b / t


def paper_units(s: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """The paper's per-layer activation memory in units of s*b*h bytes (2-byte activations, 1-byte masks)."""
    return activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel, recompute) / (s * h)
