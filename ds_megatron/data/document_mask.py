"""Packed windows without cross-document attention: per-token document ids and positions, from the token ids alone.

A packed window is documents laid end to end with EOS *after* each one (``corpus.pack``, ``prepared`` shards), so EOS
*ends* a document: it is the last token of the document it closes, and the token after it starts the next one.  A
token's document id is the number of EOS tokens strictly before it in the window (the window's first, usually
partial, document is 0); ids never decrease along the sequence.  A query attends a key only when both have the same
id and the key is not in its future (``model.layers.blocked_by_document``): so EOS still sees its own document,
and the first token of a document sees only itself.

Positions (rotary or learned) are a stated choice, ``ds_megatron.data.document_positions``:
  ``restart``  each document counts from 0 (the position of a token inside its document; Llama 3's choice), so a
               document trained inside a pack looks as it would alone;
  ``global``   the token's index in the window, as without document masking.

Everything here is a function of the token ids, so every pipeline stage and CP rank can rebuild it locally from
the window (or be handed the two fixed-shape int tensors); no [s, s] mask is ever built here or sent anywhere.
Torch only, no torch.distributed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ds_megatron.config.schema import DOCUMENT_POSITIONS


class DocumentLayout(NamedTuple):
    doc_ids: Tensor  # [b, s] int64, non-decreasing along s
    positions: Tensor  # [b, s] int64, the rotary / learned position of each token


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """[b, s] token ids -> [b, s] int64 document ids: the number of EOS strictly before each token (EOS closes its
    document, so it keeps the id of the tokens before it)."""
    is_eos = (tokens == eos_id).long()
    return torch.cumsum(is_eos, dim=-1) - is_eos


def document_positions(doc_ids: Tensor, positions: str = "restart") -> Tensor:
    """[b, s] document ids -> [b, s] int64 positions: ``restart`` the offset of each token from its document's
    first token in the window, ``global`` the index in the window."""
    if positions not in DOCUMENT_POSITIONS:
        raise ValueError(f"document positions must be one of {DOCUMENT_POSITIONS} (got {positions!r})")
    b, s = doc_ids.shape
    index = torch.arange(s, device=doc_ids.device).expand(b, s)
    if positions == "global":
        return index.clone()
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values  # its document's start
    return index - first


def document_layout(tokens: Tensor, eos_id: int, positions: str = "restart") -> DocumentLayout:
    """The document ids and positions of a packed window's input tokens [b, s] (the window without its last token:
    the inputs, not the labels).  Call it on the whole sequence, before any CP split: a rank's ids and positions
    depend on the EOS tokens of chunks other ranks hold; slice both with ``cp.slice_for_rank(x, 1, rank, cp)``."""
    doc_ids = document_ids(tokens, eos_id)
    return DocumentLayout(doc_ids, document_positions(doc_ids, positions))
