"""L3: analytic activation memory (Korthikanti et al. 2022, sec. 4).  Pure Python.

Per transformer layer, in bytes, for s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.  The
paper counts 2-byte activations and 1-byte dropout masks; ``act_bytes`` and ``mask_bytes`` generalise that so a
measurement in another dtype (fp32 on CPU: 4 and 4) can be compared term by term.

Terms, in units of s*b*h elements (from the paper's sec. 4.1), with the eager attention kernel (the paper's setting):
- replicated under TP, split by SP ("10" in the paper): two LayerNorm inputs (2), QKV and fc1 inputs (2) in
  activation bytes, and the attention-output and MLP dropout masks (2) in mask bytes;
- split by TP ("24"): Q, K, V (3), projection input (1), GELU input (4), fc2 input (4) in activation bytes;
- the s^2 terms (5 a s / h), split by TP: softmax output and dropout output (2 a s / h) in activation bytes and the
  softmax dropout mask (a s / h) in mask bytes.  Selective recompute drops them; full recompute keeps only the
  layer input (1 in activation bytes, split by SP).

With ``attention="sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) what is stored depends on the path
torch takes, so ``sdpa_path`` names it:
- ``"fused"`` (the default; CUDA's flash and memory-efficient kernels, and the CPU flash kernel, which torch uses
  when the attention dropout is 0): no s^2 term at all.  The kernel saves Q, K, V (views of the QKV output, already
  counted), its output (the projection input, already counted: the output is laid out [b, s, a, d] in memory, so
  the [s, b, h] projection input is a view of it) and the log-sum-exp of each score row, fp32 [b, a/t, s]:
  4 a s b / t bytes = 4 a / (h t) in units of s*b*h bytes, split by TP (heads) and unchanged by SP.  The
  memory-efficient kernel pads that row to a multiple of 32 (the same for s divisible by 32); flash's dropout
  keeps only an RNG seed and offset (two scalars, not counted).
- ``"math"`` (torch's reference path, which the CPU takes whenever the attention dropout is non-zero, and CUDA only
  when no fused kernel accepts the inputs): the s^2 terms of the eager kernel come back, and everything the path
  saves is in ``math_act_bytes`` (it upcasts bf16 and fp16 to fp32: 4) with ``math_mask_bytes`` dropout masks (the
  mask torch keeps for an fp32 dropout: 4 on CPU, 1 on CUDA): scaled copies of Q, K and V (3 a_m, replacing the
  three in activation bytes), softmax and dropout outputs (2 a_m a s / h) and the mask (m_m a s / h).  The
  projection input is a copy in activation bytes (1, unchanged); no log-sum-exp is kept.
Selective recompute with sdpa is refused (the config loader refuses it too: it checkpoints the s x s core that the
fused kernels never store).  Full recompute keeps the block input whatever the kernel.
"""

from __future__ import annotations

from ds_megatron.config.schema import ATTENTION_KERNELS, RECOMPUTE_POLICIES

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
) -> float:
    """Bytes of activations one transformer layer keeps for backward, per TP rank.

    ``attention`` "eager" is the paper's table; "sdpa" with ``sdpa_path`` "fused" drops the 5 a s / h terms and adds
    the fp32 log-sum-exp, 4 a s b / t bytes; "math" is the reference path described in the module docstring."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if attention not in KERNELS:
        raise ValueError(f"attention must be one of {KERNELS}, got {attention!r}")
    if sdpa_path not in SDPA_PATHS:
        raise ValueError(f"sdpa_path must be one of {SDPA_PATHS}, got {sdpa_path!r}")
    if attention == "sdpa" and recompute == "selective":
        raise ValueError("selective recompute checkpoints the s x s core, which sdpa never stores: use eager with it")
    sp = sequence_parallel and t > 1
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (t if sp else 1)
    replicated = 4 * act_bytes + 2 * mask_bytes  # paper: 10
    split = 12 * act_bytes  # paper: 24
    quadratic = (2 * act_bytes + mask_bytes) * a * s / h  # paper: 5 a s / h
    if recompute == "selective":
        quadratic = 0.0
    elif attention == "sdpa" and sdpa_path == "fused":
        quadratic = LSE_BYTES * a / h  # the log-sum-exp in place of the s^2 terms; split by TP like them
    elif attention == "sdpa":
        split += 3 * (math_act_bytes - act_bytes)  # Q, K, V saved as the path's own (upcast) copies
        quadratic = (2 * math_act_bytes + math_mask_bytes) * a * s / h
    if sp:
        return sbh * (replicated + split + quadratic) / t
    return sbh * (replicated + (split + quadratic) / t)


def lse_bytes_per_layer(s: int, b: int, a: int, t: int = 1) -> float:
    """The fused sdpa kernels' log-sum-exp per layer and TP rank: fp32 [b, a/t, s]."""
    return LSE_BYTES * a * s * b / t


def paper_units(s: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """The paper's per-layer activation memory in units of s*b*h bytes (2-byte activations, 1-byte masks)."""
    return activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel, recompute) / (s * h)
