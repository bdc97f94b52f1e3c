"""The output layer and the vocabulary-parallel cross entropy in one pass over chunks of tokens: the logits
[N, V_pad/t] are never held whole, in any dtype.

For each chunk of ``c`` tokens: logits = h_c W^T in the hidden states' dtype, then (in fp32, chunk-sized) each
token's log-sum-exp over the whole vocabulary and its target logit, and at once the gradient of the mean loss,
D = (softmax - one_hot) / N, cast to the hidden states' dtype; dh_c = D W and dW += D^T h_c (accumulated in fp32
over the chunks).  The forward pass thus does the backward's work; backward only scales the stored dh and dW by the
incoming gradient of the mean (1 in plain training, 1/gradient-accumulation under DeepSpeed), which is exact
because the loss is a scalar.  Padding columns (past the real vocabulary) are -inf: they never win the softmax and
get zero gradient, so padding rows of W are never trained.

Collectives over the TP group, per micro-batch (t > 1):
  forward   under SP one all-gather of the hidden states [s/t, b, h] -> [s, b, h] (as the unfused output layer);
            per chunk one all-gather of a [3, c] fp32 triple (local max, sum of exp relative to it, target logit or
            0), merged by log-sum-exp: one small collective per chunk instead of the unfused loss's two all-reduces
            per sequence; then one reduce-scatter (SP) or all-reduce (no SP) of dh [s, b, h].
  backward  none (the unfused path all-gathers the sequence again under SP and reduce-scatters / all-reduces dh).

Chunk size: :data:`CHUNK_LOGIT_BYTES` of fp32 logits per chunk (:func:`chunk_tokens`).  Stored for backward: dh
[N/t (SP), h] and dW [V_pad/t, h], both in the hidden states' dtype (fp32 for fp16, see the forward); the unfused
path keeps the fp32 softmax [N, V_pad/t] and the output layer's input.  Transient: about 2 x CHUNK_LOGIT_BYTES for
the chunk's logits and gradient, dh [N, h] before its reduction, one chunk's product D^T h_c [V_pad/t, h] in the
hidden dtype (CPU torch has no matmul with an fp32 output from bf16 inputs), the fp32 accumulator of dW and, on
CPU, a column-major copy of W for dh = D W (:func:`dh_operand`).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ds_megatron.tensor_parallel.mappings import _all_gather_dim0, _all_reduce, _reduce_scatter_dim0, group_size
from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue

# fp32 logits per chunk: at V_pad/t = 64,128 about 523 tokens per chunk (a GEMM with M = 523 still runs near peak on
# a GPU), at V 8,192 on CPU 4,096 tokens; the chunk's transients stay near 2x this, far under a block's activations.
CHUNK_LOGIT_BYTES = 128 * 2**20


def chunk_tokens(vocab_local: int, budget: int = CHUNK_LOGIT_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits [c, vocab_local] within ``budget`` bytes."""
    return max(1, budget // (4 * vocab_local))


def dh_operand(weight: torch.Tensor) -> torch.Tensor:
    """W [V_pad/t, h] as the right operand of dh = D W, the same values: on CPU a column-major copy (W^T made
    contiguous, then viewed transposed), because oneDNN's GEMM with a row-major right operand of large inner
    dimension (V_pad/t) and narrow output (h) runs several times slower than with the column-major one (measured in
    benchmarks/results/gemm_floor.md); the copy is one pass over W per micro-batch.  Elsewhere W itself (cuBLAS takes
    either layout at full speed, and the copy would cost V_pad/t x h of memory)."""
    return weight.t().contiguous().t() if weight.device.type == "cpu" else weight


def _lse_and_target(logits: torch.Tensor, local_target: torch.Tensor, in_block: torch.Tensor, group):
    """(log-sum-exp over the whole vocabulary, target logit, exp(logits - local max), local max) of one chunk.

    ``logits`` [c, V_pad/t] fp32 is overwritten with exp(logits - local max).  A block that is all padding has local
    max -inf: its sum is then 0 and it drops out of the merge."""
    local_max = logits.max(dim=-1).values
    shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
    picked = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_block, picked, torch.zeros_like(picked))
    exp = logits.sub_(shift.unsqueeze(-1)).exp_()
    sum_exp = exp.sum(dim=-1)
    if group_size(group) == 1:
        return shift + sum_exp.log(), picked, exp, shift
    stats = _all_gather_dim0(torch.stack([local_max, sum_exp, picked]).unsqueeze(0), group)  # [t, 3, c]
    maxes, sums = stats[:, 0], stats[:, 1]
    top = maxes.max(dim=0).values
    lse = top + (sums * (maxes - top).exp()).sum(dim=0).log()
    return lse, stats[:, 2].sum(dim=0), exp, shift


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean over tokens of cross entropy(h W^T, target), computed chunk by chunk with its gradients (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_start, vocab_size, sp, chunk, need_grad, queue, param):
        ctx.queue, ctx.dtypes = queue, (hidden.dtype, weight.dtype)
        ctx.param = param if queue is not None else None  # W accumulates into it
        full = _all_gather_dim0(hidden, group) if sp and group_size(group) > 1 else hidden
        h2 = full.reshape(-1, full.shape[-1])  # [N, h], N = s b
        t2 = target.reshape(-1)
        num_tokens, vocab_local = h2.shape[0], weight.shape[0]
        if t2.shape[0] != num_tokens:
            raise ValueError(f"{t2.shape[0]} targets for {num_tokens} tokens of hidden states")
        # bf16 and fp32: 1/N is applied to D in fp32 before its cast, where the unfused path applies the incoming
        # gradient.  fp16 has too little range for the gradient of a mean before any loss scale (p / N underflows):
        # D is cast unscaled, the products are scaled by 1/N in fp32 and kept in fp32 until backward's loss scale.
        low_range = h2.dtype == torch.float16
        pre, post = (1.0, 1.0 / num_tokens) if low_range else (1.0 / num_tokens, 1.0)
        pad = torch.arange(vocab_start, vocab_start + vocab_local, device=h2.device) >= vocab_size
        losses = torch.empty(num_tokens, dtype=torch.float32, device=h2.device)
        if need_grad:
            grad_h2 = torch.empty(h2.shape, dtype=torch.float32 if low_range else h2.dtype, device=h2.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            w_for_dh = dh_operand(weight)
        for start in range(0, num_tokens, chunk):
            h_c, tgt = h2[start : start + chunk], t2[start : start + chunk]
            logits = h_c.matmul(weight.t())  # [c, V_pad/t] in the hidden dtype
            if pad.any():
                logits.masked_fill_(pad, float("-inf"))
            logits = logits.float()  # a chunk-sized fp32 copy (the same buffer when already fp32)
            in_block = (tgt >= vocab_start) & (tgt < vocab_start + vocab_local)
            local_target = (tgt - vocab_start).masked_fill(~in_block, 0)
            lse, picked, exp, shift = _lse_and_target(logits, local_target, in_block, group)
            losses[start : start + chunk] = lse - picked
            if not need_grad:
                continue
            # D = (softmax - one_hot) * pre, in place in exp: softmax = exp(logits - shift) * exp(shift - lse)
            grad = exp.mul_(((shift - lse).exp() * pre).unsqueeze(-1))
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_block.unsqueeze(-1).to(grad.dtype) * pre)
            grad = grad.to(h2.dtype)
            if low_range:
                grad_h2[start : start + chunk] = grad.matmul(w_for_dh).float().mul_(post)
            else:
                torch.matmul(grad, w_for_dh, out=grad_h2[start : start + chunk])
            grad_w.add_(grad.t().matmul(h_c))
            del logits, exp, grad  # before the next chunk's logits: one chunk's buffers alive at a time
        if need_grad:
            grad_full = grad_h2.view(full.shape)
            if group_size(group) > 1:
                grad_full = _reduce_scatter_dim0(grad_full, group) if sp else _all_reduce(grad_full, group)
            ctx.save_for_backward(grad_full, grad_w.mul_(post) if low_range else grad_w.to(weight.dtype))
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors  # fp32 for fp16 models, else in the model's dtype
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = grad_hidden.mul(grad_loss.to(grad_hidden.dtype)).to(hidden_dtype)
        grad_weight = grad_weight.mul(grad_loss.to(grad_weight.dtype)).to(weight_dtype)
        if ctx.queue is not None:  # the weight's gradient is already computed: W only adds it
            ctx.queue.defer((ctx.param,), lambda done=grad_weight: (done,))
            return grad_hidden, None, None, None, None, None, None, None, None, None, None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def fused_vocab_parallel_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    sequence_parallel: bool,
    queue: WeightGradQueue | None = None,
    chunk: int | None = None,
    param: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token loss (fp32 scalar) of the output layer ``weight`` (this rank's rows [V_pad/t, h], starting at
    vocabulary id ``vocab_start``; ids >= ``vocab_size`` are padding) on ``hidden`` [s, b, h] (under SP the
    sequence shard [s/t, b, h]) against ``target`` [s, b].  ``chunk``: tokens per chunk (default
    :func:`chunk_tokens`).  With a ``queue`` (deferred weight gradients) the weight's gradient reaches ``param`` (the
    parameter itself when ``weight`` is a view of it; default ``weight``) in W."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(
        hidden,
        weight,
        target,
        group,
        vocab_start,
        vocab_size,
        sequence_parallel,
        chunk,
        need_grad,
        queue,
        weight if param is None else param,
    )
