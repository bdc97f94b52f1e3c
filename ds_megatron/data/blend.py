"""Weighted blends of several sample sources, deterministic from the seed and readable at any sample index.

The global sample sequence is cut into blocks of ``BLOCK`` samples.  Every block holds the same number of samples of
each source, ``counts`` (the weights times ``BLOCK``, rounded by largest remainder so that they sum to ``BLOCK``), in
an order drawn from (seed, block).  Sample ``k`` therefore comes from source ``d = order(k // BLOCK)[k % BLOCK]`` and is
that source's sample ``(k // BLOCK) * counts[d] + (rank of k among the block's positions of d)``; each source walks
through its own samples in order (its epochs shuffled by ``PackedSamples``).  Nothing depends on the samples read
before, so a resumed run reads the exact same samples from the step on, and the realised proportion of every source
is within 1 / BLOCK of its weight after every whole block.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 4096
_STREAM = 0xB1E4D  # keeps the block orders apart from the per-epoch permutations drawn from the same seed


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Samples of each source per block: ``weights`` normalised, times ``block``, rounded by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative, finite and not all zero (got {list(weights)})")
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    short = block - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")  # largest remainders first, ties to the earlier source
    counts[order[:short]] += 1
    return counts


class BlendedSamples:
    """Samples drawn from ``members`` (each with ``num_samples`` and ``[k]``, e.g. ``PackedSamples``) in proportion
    to ``weights``; the same interface, so ``MicroBatchStream`` reads it unchanged."""

    def __init__(self, members: list, weights: list[float], seed: int, block: int = BLOCK):
        self.members, self.seed, self.block = members, seed, block
        self.counts = block_counts(weights, block)
        self.num_samples = sum(m.num_samples for m, c in zip(members, self.counts) if c > 0)
        self._cached = -1
        self._source = self._rank = None

    def _order(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """For block ``b``: the source of each position and its rank among that source's positions in the block."""
        if b != self._cached:
            base = np.repeat(np.arange(len(self.counts)), self.counts)
            source = np.random.default_rng([self.seed, _STREAM, b]).permutation(base)
            rank = np.empty(self.block, dtype=np.int64)
            for d, count in enumerate(self.counts):
                rank[source == d] = np.arange(count)
            self._cached, self._source, self._rank = b, source, rank
        return self._source, self._rank

    def locate(self, k: int) -> tuple[int, int]:
        """(source, that source's sample index) of global sample ``k``."""
        b, i = divmod(k, self.block)
        source, rank = self._order(b)
        d = int(source[i])
        return d, b * int(self.counts[d]) + int(rank[i])

    def __getitem__(self, k: int) -> torch.Tensor:
        d, j = self.locate(k)
        return self.members[d][j]

    def realised(self, n: int) -> np.ndarray:
        """How many of the first ``n`` samples each source gives."""
        whole, rest = divmod(n, self.block)
        counts = whole * self.counts
        if rest:
            counts = counts + np.bincount(self._order(whole)[0][:rest], minlength=len(self.counts))
        return counts
