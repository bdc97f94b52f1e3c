"""L2: activation recomputation with exact RNG replay (Korthikanti et al. 2022, sec. 5).

Policies (``recompute`` in the config):
- ``none``: everything is stored.
- ``selective``: only the core attention (QK^T, scale, mask, softmax, softmax dropout, x V) is recomputed: its
  s x s tensors (5 a s / h of the 34 + 5 a s / h bytes per token and hidden unit) are never stored.
- ``full`` with ``num_layers`` k: ``uniform`` splits each stage's blocks into chunks of k and keeps only each chunk's
  input; ``block`` recomputes the first k blocks of each stage (each keeps only its input) and stores the rest.

The checkpoint is a reentrant autograd Function: forward runs without a graph and saves only the inputs (so memory
accounting with saved-tensor hooks sees exactly what is kept); backward restores every RNG state captured before
the forward (default and tensor-parallel), recomputes, and backpropagates.  Dropout masks are therefore replayed
bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ds_megatron.random import RNGTracker


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_fn, rng, *inputs):
        ctx.run_fn, ctx.rng = run_fn, rng
        ctx.rng_states = rng.get_states() if rng is not None else {"cpu": torch.get_rng_state()}
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run_fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        rng = ctx.rng
        current = rng.get_states() if rng is not None else {"cpu": torch.get_rng_state()}
        _restore(rng, ctx.rng_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_fn(*inputs)
        finally:
            _restore(rng, current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


def _restore(rng: RNGTracker | None, states: dict) -> None:
    if rng is not None:
        rng.set_states(states)
    else:
        torch.set_rng_state(states["cpu"])


def checkpoint(run_fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, rng: RNGTracker | None) -> torch.Tensor:
    """Run ``run_fn(*inputs)`` keeping only ``inputs``; recompute it in backward with the same RNG states."""
    if not torch.is_grad_enabled():
        return run_fn(*inputs)
    return _Recompute.apply(run_fn, rng, *inputs)


class RecomputedCoreAttention(nn.Module):
    """Selective recompute: wraps a core-attention module (no parameters) so its s x s tensors are recomputed."""

    def __init__(self, core: nn.Module, rng: RNGTracker | None):
        super().__init__()
        self.core = core
        self.rng = rng

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.core, q, k, v, rng=self.rng)


@dataclass(frozen=True)
class RecomputePlan:
    """Which blocks of a stage are recomputed and in which chunks."""

    policy: str = "none"  # none | selective | full
    num_layers: int = 1
    method: str = "uniform"  # uniform | block

    def chunks(self, num_blocks: int) -> list[tuple[int, int, bool]]:
        """Cover local blocks [0, num_blocks) with (start, end, recomputed) ranges, in order."""
        if self.policy != "full" or num_blocks == 0:
            return [(0, num_blocks, False)] if num_blocks else []
        k = self.num_layers
        if self.method == "uniform":
            return [(s, min(s + k, num_blocks), True) for s in range(0, num_blocks, k)]
        recomputed = [(i, i + 1, True) for i in range(min(k, num_blocks))]
        rest = [(k, num_blocks, False)] if k < num_blocks else []
        return recomputed + rest
