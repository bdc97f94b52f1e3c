"""Cross entropy over vocabulary-parallel logits: the full logits are never gathered.

Each rank holds logits for its vocabulary block [V_pad/t].  Three all-reduces over the TP group (max, sum of exp,
target logit) give the exact log-softmax loss; the backward needs no communication (softmax - one-hot on the local
block).  Padding columns carry -inf and get probability 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ds_megatron.tensor_parallel.mappings import group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        n = group_size(group)
        logits_max = logits.max(dim=-1).values
        if n > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # the one full-size fp32 buffer this function allocates
        vocab_local = logits.shape[-1]
        in_block = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(~in_block, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(in_block, picked, torch.zeros_like(picked))
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if n > 1:
            both = torch.stack([sum_exp, picked])
            dist.all_reduce(both, group=group)
            sum_exp, picked = both[0], both[1]
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, in_block)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # softmax - one_hot(target), times the incoming gradient, computed in place in the saved softmax buffer
        # (which this function allocated and nothing else reads): no full-size temporaries.  A second backward
        # through the same graph (retain_graph) is therefore not supported.
        softmax, local_target, in_block = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_block.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None, vocab_start: int
) -> torch.Tensor:
    """Per-token loss.  logits [..., V_pad/t] (this rank's block starting at ``vocab_start``), target [...]."""
    if group_size(group) == 1:  # the whole vocabulary is here: torch's fused kernel is faster and equal
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
