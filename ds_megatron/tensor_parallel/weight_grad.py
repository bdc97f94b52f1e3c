"""Deferred weight gradients: the W passes of zero-bubble pipeline schedules (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", sec. 2).

A backward pass splits into B (input gradients, which the previous pipeline stage waits for, plus the TP/SP
collectives they need) and W (weight gradients, which nobody waits for until the optimizer step).  With a
:class:`WeightGradQueue` attached (:func:`defer_weight_grads`), the column/row-parallel linears and the vocabulary
embedding compute only B in autograd and queue a closure per weight that computes its gradient from the saved input
and the output gradient; the closures of one backward pass form one W pass, run later by :meth:`run_next` (where the
pipeline would idle) or :meth:`flush` (before the gradient reduction and the optimizer step).

What a queued W keeps alive until it runs: per linear, its input (under SP the all-gathered input [s, b, in], t times
the shard that the non-deferred backward keeps, because gathering it again in W would put a TP collective there)
and its output gradient [s, b, out/t]; per embedding, the ids and the output gradient [s, b, h].

Gradients reach ``param.grad`` through the parameter's own autograd accumulation node, exactly as in the
non-deferred backward: the same sums in the same order (a parameter used twice in one backward, the tied embedding
on one stage, gets its two terms summed before they are accumulated, as autograd does), and any gradient hook
(DeepSpeed's) fires as usual.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import nn

WeightGrads = Callable[[], Sequence[torch.Tensor | None]]


class WeightGradQueue:
    """This stage's deferred weight gradients, grouped by the backward pass that queued them (oldest first)."""

    def __init__(self) -> None:
        self._open: list[tuple[tuple[torch.Tensor | None, ...], WeightGrads]] = []
        self._sealed: deque[list] = deque()

    def defer(self, params: Sequence[torch.Tensor | None], compute: WeightGrads) -> None:
        """Queue ``compute()`` (one gradient per entry of ``params``; None entries are skipped) in the current pass."""
        self._open.append((tuple(params), compute))

    def seal(self) -> None:
        """End the current backward pass: what it queued becomes one W pass."""
        if self._open:
            self._sealed.append(self._open)
            self._open = []

    @property
    def sealed(self) -> int:
        """Sealed W passes waiting to run."""
        return len(self._sealed)

    def __len__(self) -> int:
        """W passes not yet run (the current, unsealed one included)."""
        return len(self._sealed) + (1 if self._open else 0)

    def run_next(self) -> bool:
        """Run the oldest sealed W pass; False when there is none."""
        if not self._sealed:
            return False
        _accumulate(self._sealed.popleft())
        return True

    def flush(self) -> int:
        """Run every queued W pass, oldest first (the current one included); returns how many ran."""
        self.seal()
        ran = 0
        while self.run_next():
            ran += 1
        return ran


def _accumulate(work: list) -> None:
    """Compute one W pass's gradients and add them to ``.grad`` through one autograd call rooted at the parameters
    themselves, so accumulation (and every gradient hook) happens as in the backward pass that deferred them: a
    parameter named twice (the tied embedding on one stage) gets its terms summed before they are accumulated."""
    params, grads = [], []
    with torch.enable_grad():
        for owners, compute in work:
            for p, g in zip(owners, compute()):
                if p is not None and g is not None:
                    params.append(p)
                    grads.append(g)
    if params:
        torch.autograd.backward(params, grads)


class DeferrableWeightGrads:
    """Mixin of the layers whose weight gradients can be deferred: ``weight_grad_queue`` None (the default) keeps
    the plain backward; :func:`defer_weight_grads` sets it."""

    weight_grad_queue: WeightGradQueue | None = None


def defer_weight_grads(module: nn.Module, queue: WeightGradQueue | None) -> int:
    """Attach ``queue`` to every deferrable layer in ``module`` (None: back to the plain backward); returns how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, DeferrableWeightGrads):
            m.weight_grad_queue = queue
            count += 1
    return count
