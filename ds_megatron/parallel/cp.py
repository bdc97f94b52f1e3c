"""The context-parallel (CP) sequence layout and the rules that refuse a layout before any process group exists.

Load-balanced layout (one layout for both ``cp_comm`` choices, ring and a2a): a sequence of length ``s`` is cut into
``2 * cp`` equal chunks of ``c = s / (2 * cp)`` tokens, and CP rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``,
in that order, as one local sequence of ``s / cp`` tokens.  Under causal attention chunk ``k`` attends to ``k + 1``
chunks, so every rank's pair costs ``(i + 1) + (2 * cp - i) = 2 * cp + 1`` chunk blocks: the same work on every rank,
where contiguous shards would give the last rank ``2 * cp - 1`` times the first one's.

A rank's tokens are not contiguous, so everything position-dependent is computed from :func:`token_indices`, the
global index of each local token: rotary and learned positions, and the labels, which are the next tokens over the
whole sequence (the token after a chunk's last one lives in the next chunk, on another rank).

Tensor helpers take the sequence dim explicitly, so they serve [b, s, ...] batches and [s, b, ...] activations.
The rules (:func:`check_cp_seq_length`, :func:`check_cp_heads`, :func:`check_cp_attention_dropout`) use plain
integers only, so a pre-flight check can call them before torch.distributed is touched.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.config.errors import ConfigError

CP_COMMS = ("ring", "a2a")


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
            "set attn_pdrop to 0 or cp to 1",
        )


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) that CP rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def token_indices(seq_length: int, cp_rank: int, cp: int, device: torch.device | None = None) -> Tensor:
    """[s / cp] int64: the global index of each of this rank's tokens, which is also its position for rotary and
    learned position embeddings.  cp 1 gives ``arange(s)``."""
    if cp == 1:
        return torch.arange(seq_length, device=device)
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunk_ids(cp_rank, cp)])


def slice_for_rank(x: Tensor, dim: int, cp_rank: int, cp: int) -> Tensor:
    """This rank's chunks of a full-sequence tensor ``x`` (sequence along ``dim``): [.., s, ..] -> [.., s / cp, ..].
    At cp > 1 a new tensor (the chunks are not adjacent), never a view that would keep the full sequence alive."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[k] for k in chunk_ids(cp_rank, cp)], dim)


def unslice(pieces: list[Tensor], dim: int) -> Tensor:
    """The inverse of :func:`slice_for_rank`: every rank's local tensor, in CP rank order -> the full sequence."""
    cp = len(pieces)
    if cp == 1:
        return pieces[0]
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for rank, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim)
        lo, hi = chunk_ids(rank, cp)
        chunks[lo], chunks[hi] = first, second
    return torch.cat(chunks, dim)  # type: ignore[arg-type]


def gather_for_ranks(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """All-gather every CP rank's local tensor and reassemble the full sequence in order (no autograd: for metrics,
    checks and generation, never inside the trained graph)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return unslice(pieces, dim)


def split_window(window: Tensor, cp_rank: int, cp: int) -> tuple[Tensor, Tensor]:
    """A packed window [b, s + 1] -> this rank's (input_ids, labels), each [b, s / cp].  The labels are shifted over
    the whole sequence before slicing: the label of local token j is window[global index of j + 1], which for a
    chunk's last token is the first token of the next chunk, held by another rank."""
    idx = token_indices(window.shape[1] - 1, cp_rank, cp, window.device)
    return window[:, idx], window[:, idx + 1]


def window_ranges(seq_length: int, cp_rank: int, cp: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a packed window of ``seq_length + 1`` tokens that this rank must read for its
    inputs and labels: each of its chunks plus the one token after it."""
    c = seq_length // (2 * cp)
    return [(k * c, (k + 1) * c + 1) for k in chunk_ids(cp_rank, cp)]
