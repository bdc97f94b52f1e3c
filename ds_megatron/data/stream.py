"""Deterministic micro-batch streams for the pipeline engine.

Micro-batch ``k`` of the whole run (counted over all DP ranks in the order step, dp rank, accumulation step) is a
set of random windows drawn from a generator seeded by (seed, k): any rank can produce any micro-batch, so DP ranks
see disjoint data and a resumed run continues at the exact position (``start_step``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def split_train_valid(tokens: torch.Tensor, valid_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out the last ``valid_fraction`` of the token stream for validation."""
    cut = int(len(tokens) * (1.0 - valid_fraction))
    return tokens[:cut], tokens[cut:]


class MicroBatchStream:
    """Yields (input_ids [b, s], labels [b, s]) for one DP rank, as ``engine.train_batch`` pulls them."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_length: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
    ):
        if len(tokens) <= seq_length + 1:
            raise ValueError(f"token stream of {len(tokens)} tokens is shorter than seq_length + 1 = {seq_length + 1}")
        self.tokens, self.seq_length = tokens, seq_length
        self.micro, self.gas = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.step, self.accum = start_step, 0

    def micro_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.tokens) - self.seq_length - 1, (self.micro,), generator=gen)
        windows = torch.stack([self.tokens[s : s + self.seq_length + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = (self.step * self.dp_size + self.dp_rank) * self.gas + self.accum
        self.accum += 1
        if self.accum == self.gas:
            self.accum, self.step = 0, self.step + 1
        return self.micro_batch(index)
