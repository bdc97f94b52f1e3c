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
The rules that refuse a layout live in ``config/context_parallel.py`` (plain integers, before any process group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


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


def position_ranges(seq_length: int, cp_rank: int, cp: int) -> tuple[tuple[int, int], ...]:
    """This rank's global positions as [start, stop) ranges, in local order (hashable: rotary tables are cached on
    it).  ``token_indices`` is their concatenation; cp 1 gives ``((0, s),)``."""
    if cp == 1:
        return ((0, seq_length),)
    c = seq_length // (2 * cp)
    return tuple((k * c, (k + 1) * c) for k in chunk_ids(cp_rank, cp))


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
