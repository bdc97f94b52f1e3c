"""The context-parallel (CP) rules that refuse a layout before any process group exists: plain integers in, one
``ConfigError`` line out.  The load-balanced layout they protect (rank i holds chunks i and 2 cp - 1 - i of 2 cp) is
``ds_megatron.context_parallel.layout``, which re-exports these.  Standard library only, so the loader calls them."""

from __future__ import annotations

import math

from ds_megatron.config.errors import ConfigError

CP_COMMS = ("ring", "a2a")  # K/V around the CP ring (point-to-point), or Ulysses all-to-all over heads


def check_cp_comm(cp_comm: str) -> None:
    """Refuse an exchange that is not one of ``CP_COMMS``."""
    if cp_comm not in CP_COMMS:
        raise ConfigError(
            "ds_megatron.parallel.cp_comm", "unknown exchange", f"got {cp_comm!r}", f"use one of {CP_COMMS}"
        )


def _valid_lengths(seq_length: int, unit: int) -> str:
    """The multiples of ``unit`` nearest ``seq_length`` (below and above), for an error's fix."""
    below = max(unit, seq_length // unit * unit)
    return f"{below} or {below + unit} (any multiple of {unit})"


def check_cp_seq_length(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a sequence length the load-balanced layout cannot cut.  The layout needs ``2 * cp`` equal chunks
    (ring and a2a alike: one layout for both); under sequence parallelism each rank's ``s / cp`` tokens are further
    split over the TP group, so ``s / cp`` must divide by ``tp`` as well.  Raises ConfigError in one line."""
    if cp == 1:
        return
    unit = 2 * cp
    need = f"seq_length divisible by 2 x cp = {unit}"
    if sequence_parallel and tp > 1:
        unit = math.lcm(2 * cp, cp * tp)
        need = f"seq_length divisible by 2 x cp = {2 * cp} and by cp x tp = {cp * tp} (sequence parallel)"
    if seq_length % unit != 0:
        values = f"seq_length={seq_length}, cp={cp}" + (f", tp={tp}" if sequence_parallel and tp > 1 else "")
        raise ConfigError(
            "ds_megatron.parallel.cp",
            f"{need}: rank i holds chunks i and 2 x cp - 1 - i",
            values,
            f"use seq_length {_valid_lengths(seq_length, unit)} or another cp",
        )


def check_cp_heads(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> None:
    """Refuse an a2a (Ulysses) layout whose heads per TP rank do not split over CP: the all-to-all gives each CP rank
    ``n / (tp * cp)`` query heads and ``n_kv / (tp * cp)`` KV heads of the whole sequence."""
    if cp == 1:
        return
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        per_tp = n // tp  # the loader has refused heads that tp does not divide
        if per_tp % cp != 0:
            raise ConfigError(
                "ds_megatron.parallel.cp_comm",
                f"a2a needs the {name} per TP rank divisible by cp (it splits heads over CP)",
                f"{name}={n}, tp={tp}, {name}/tp={per_tp}, cp={cp}",
                f'use cp in {[d for d in range(1, per_tp + 1) if per_tp % d == 0]} or cp_comm "ring"',
            )


def check_cp_attention_dropout(cp: int, attn_pdrop: float) -> None:
    """Refuse attention dropout with cp > 1: the cp 1 run draws one mask over the [s, s] probabilities in one
    generator call, and no chunk-wise draw reproduces that mask, so the cp > 1 run would train a different model."""
    if cp > 1 and attn_pdrop > 0:
        raise ConfigError(
            "ds_megatron.parallel.cp",
            "attention dropout cannot run with cp > 1 (the cp 1 mask over [s, s] cannot be drawn chunk by chunk)",
            f"cp={cp}, attn_pdrop={attn_pdrop}",
            "set ds_megatron.model.dropout (which sets the attention dropout) to 0, or cp to 1",
        )
