"""Deterministic, resumable micro-batches for the pipeline engine.

The token stream is cut into samples of s + 1 tokens with stride s (consecutive samples share one token, so every
token is a target exactly once).  Each epoch visits the samples in a permutation drawn from (seed, epoch).  Global
sample ``k`` of the run is therefore fixed by the seed alone; micro-batch ``j`` of optimizer step ``t`` on DP rank
``r`` takes samples [(t dp + r) gas + j] * b ... + b, so DP ranks read disjoint data and a resumed run
(``start_step``) continues at the exact sample.

Under context parallelism the cp ranks of one replica read the same samples (the same DP rank) and each keeps its
chunks of every window (``parallel.cp.split_window``: labels shifted over the whole sequence before the split), so
the data position counts sequences whatever cp is, and a run saved at cp 2 resumes at cp 1 at the same sample.

With packed documents (``data.document_mask``) each micro-batch's inputs are (input_ids, doc_ids, positions):
``document_mask.document_layout`` of the whole window's inputs, then this rank's chunks of each, like the tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from ds_megatron.context_parallel.layout import slice_for_rank, split_window
from ds_megatron.data.document_mask import document_layout


class DocumentMasking(NamedTuple):
    """Packed documents kept apart (``data.document_mask``): the EOS id that ends a document (the tokenizer's) and
    ``data.document_positions``."""

    eos_id: int
    positions: str


def split_batch(windows: torch.Tensor, cp_rank: int, cp: int, documents: DocumentMasking | None = None):
    """Windows [b, s + 1] -> (inputs, labels [b, s / cp]) of this CP rank.  ``inputs``: the input ids [b, s / cp]
    (``documents`` None: exactly what the pipeline took before packed documents), or (input_ids, doc_ids, positions),
    the ids and positions computed over the whole window before the split (they depend on EOS tokens in other
    ranks' chunks), then sliced like the ids."""
    ids, labels = split_window(windows, cp_rank, cp)
    if documents is None:
        return ids.contiguous(), labels.contiguous()
    layout = document_layout(windows[:, :-1], documents.eos_id, documents.positions)
    doc_ids, positions = (slice_for_rank(t, 1, cp_rank, cp).contiguous() for t in layout)
    return (ids.contiguous(), doc_ids, positions), labels.contiguous()


def split_train_valid(tokens, valid_fraction: float = 0.05):
    """Hold out the last ``valid_fraction`` of the token stream for validation."""
    cut = int(len(tokens) * (1.0 - valid_fraction))
    return tokens[:cut], tokens[cut:]


class PackedSamples:
    """Samples of ``seq_length + 1`` tokens from a flat token array (numpy memmap or tensor), shuffled per epoch."""

    def __init__(self, tokens, seq_length: int, seed: int):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(
                f"error: ds_megatron.data: {len(tokens)} tokens cannot fill one sample of seq_length + 1 = "
                f"{seq_length + 1}; use more text or a shorter seq_length"
            )
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm

    def __getitem__(self, k: int) -> torch.Tensor:
        epoch, i = divmod(k, self.num_samples)
        start = int(self._permutation(epoch)[i]) * self.seq_length
        window = np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)
        return torch.from_numpy(window)


class MicroBatchStream:
    """Yields (input_ids [b, s], labels [b, s]) for one DP rank, as ``engine.train_batch`` pulls them."""

    def __init__(
        self,
        samples: PackedSamples,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
        cp_rank: int = 0,
        cp: int = 1,
        documents: DocumentMasking | None = None,
    ):
        self.samples = samples
        self.micro, self.gas = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp = cp_rank, cp
        self.documents = documents
        self.step, self.accum = start_step, 0

    def micro_batch(self, index: int):
        """(input_ids, labels), each [b, s / cp]: this CP rank's chunks of the micro-batch's windows; with packed
        documents ((input_ids, doc_ids, positions), labels) (``split_batch``)."""
        windows = torch.stack([self.samples[index * self.micro + i] for i in range(self.micro)])
        return split_batch(windows, self.cp_rank, self.cp, self.documents)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self):
        index = (self.step * self.dp_size + self.dp_rank) * self.gas + self.accum
        self.accum += 1
        if self.accum == self.gas:
            self.accum, self.step = 0, self.step + 1
        return self.micro_batch(index)
