"""L3: analytic activation memory (Korthikanti et al. 2022, sec. 4).  Pure Python.

Per transformer layer, in bytes, for s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.  The
paper counts 2-byte activations and 1-byte dropout masks; ``act_bytes`` and ``mask_bytes`` generalise that so a
measurement in another dtype (fp32 on CPU: 4 and 4) can be compared term by term.

Terms, in units of s*b*h elements (from the paper's sec. 4.1):
- replicated under TP, split by SP ("10" in the paper): two LayerNorm inputs (2), QKV and fc1 inputs (2) in
  activation bytes, and the attention-output and MLP dropout masks (2) in mask bytes;
- split by TP ("24"): Q, K, V (3), projection input (1), GELU input (4), fc2 input (4) in activation bytes;
- the s^2 terms (5 a s / h), split by TP: softmax output and dropout output (2 a s / h) in activation bytes and the
  softmax dropout mask (a s / h) in mask bytes.  Selective recompute drops them; full recompute keeps only the
  layer input (1 in activation bytes, split by SP).
"""

from __future__ import annotations

from ds_megatron.config.schema import RECOMPUTE_POLICIES

MODES = RECOMPUTE_POLICIES  # "none", "selective", "full"


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
) -> float:
    """Bytes of activations one transformer layer keeps for backward, per TP rank."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    sp = sequence_parallel and t > 1
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (t if sp else 1)
    replicated = 4 * act_bytes + 2 * mask_bytes  # paper: 10
    split = 12 * act_bytes  # paper: 24
    quadratic = (2 * act_bytes + mask_bytes) * a * s / h  # paper: 5 a s / h
    if recompute == "selective":
        quadratic = 0.0
    if sp:
        return sbh * (replicated + split + quadratic) / t
    return sbh * (replicated + (split + quadratic) / t)


def paper_units(s: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """The paper's per-layer activation memory in units of s*b*h bytes (2-byte activations, 1-byte masks)."""
    return activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel, recompute) / (s * h)
