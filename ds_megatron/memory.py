"""L3: analytic activation memory (Korthikanti et al. 2022, sec. 4), for every model family.  Pure Python.

Per transformer layer, in bytes, for s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.  The
paper counts 2-byte activations and 1-byte dropout masks; ``act_bytes`` and ``mask_bytes`` generalise that so a
measurement in another dtype (fp32 on CPU: 4 and 4) can be compared term by term.  ``family`` picks the block's
terms (``Family.block_terms`` in ``ds_megatron/model/<family>/``; GPT's are the paper's sec. 4.1 table, eager
attention); the attention kernels and the recompute policies are shared by all.  Selective recompute drops the s^2
terms; full recompute keeps only the block input (h in activation bytes, split by SP).

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

from ds_megatron.config.schema import (
    ATTENTION_KERNELS,
    DEFAULT_SELECTIVE_MODULES,
    RECOMPUTE_MODULES,
    RECOMPUTE_POLICIES,
    PipelineSchedule,
)
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES

MODES = RECOMPUTE_POLICIES  # "none", "selective", "full"
KERNELS = ATTENTION_KERNELS  # "eager", "sdpa"
SDPA_PATHS = ("fused", "math")
LSE_BYTES = 4  # the fused sdpa kernels keep each score row's log-sum-exp in fp32, whatever the activation dtype


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
    family: str = DEFAULT_FAMILY,
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
    A family without GPT's defaults (Llama) needs ``num_kv_heads`` and ``intermediate_size``; ``attention_dropout``
    is Llama's only dropout (default 0; the GPT formula always counts dropout, the paper's setting)."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if attention not in KERNELS:
        raise ValueError(f"attention must be one of {KERNELS}, got {attention!r}")
    if sdpa_path not in SDPA_PATHS:
        raise ValueError(f"sdpa_path must be one of {SDPA_PATHS}, got {sdpa_path!r}")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    if modules and recompute != "selective":
        raise ValueError(f"modules apply to selective recompute only, got recompute={recompute!r}")
    modules = (tuple(modules) or DEFAULT_SELECTIVE_MODULES) if recompute == "selective" else ()
    if set(modules) - set(RECOMPUTE_MODULES):
        raise ValueError(f"modules must be among {RECOMPUTE_MODULES}, got {modules}")
    if attention == "sdpa" and "core_attn" in modules:
        raise ValueError("selective recompute of core_attn checkpoints the s x s core, which sdpa never stores")
    terms = FAMILIES[family].block_terms(h, a, num_kv_heads, intermediate_size, attention_dropout, act_bytes)
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


def stage_activations_in_flight(schedule: PipelineSchedule, pp: int, rank: int, num_micro_batches: int) -> float:
    """The most micro-batches' activations pipeline rank ``rank`` holds at once, in units of one micro-batch's
    activations of a 1F1B stage (L/p blocks), as counted off DeepSpeed's schedules (forward passes not yet
    backward): 1F1B holds min(p - rank, m) on rank ``rank``; DualPipeV (m >= 2p) holds 2p + 1 micro-batches of a
    half stage (L/2p blocks) on every rank, p + 1/2 stages' worth: half a stage more than 1F1B's rank 0, and p - 1/2
    more on the last rank.  Weights: every rank holds L/p blocks under both; DualPipeV's rank 0 holds the embedding
    and the output layer (two vocabulary matrices when untied), 1F1B splits them between the first and last rank."""
    if schedule.stages_per_rank == 1:
        return float(min(pp - rank, num_micro_batches))
    return (2 * pp + 1) / schedule.stages_per_rank
