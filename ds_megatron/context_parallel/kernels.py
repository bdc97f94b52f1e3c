"""Attention of one (query rows, key block) pair that also returns its log-sum-exp, and the exact backward of such a
block inside a larger softmax: the two primitives that context-parallel attention merges and differentiates.

Shapes: q [b, n, sq, d], k and v [b, n_kv, sk, d] (grouped-query attention when n_kv < n: query head i attends
with KV head i // (n / n_kv), and K/V are never expanded to n heads on the eager path or the CPU kernel);
out [b, n, sq, d] in q's dtype; lse [b, n, sq] fp32 (float64 for float64 inputs), the natural log of each row's
sum of exp(scores).  ``causal`` means a square diagonal block (sq == sk) masked above its diagonal; other blocks
are full.

Backward contract: :func:`block_backward` is given the *final* output and log-sum-exp of the query rows (the merge
over every key block), not the block's own.  With P = exp(S - lse_final) the block's share of the row's softmax,
dV = P^T dO, dS = P * (dO V^T - D) with D = rowsum(dO * O_final), dQ = scale * dS K, dK = scale * dS^T Q: exactly
the rows and columns of the whole-sequence softmax backward that belong to this block.  Both kernels compute it by
recomputing P from saved q, k, v and lse (nothing of size s x s is kept between forward and backward).

Kernels: ``eager`` materialises the block's scores and computes the softmax with its log-sum-exp itself; ``sdpa`` is
torch's fused flash kernel, which returns the log-sum-exp and takes it back in its backward: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, native GQA), on CUDA
``aten._scaled_dot_product_flash_attention`` (fp16/bf16 only, head dim a multiple of 8 up to 256, native GQA;
:func:`on_cuda` picks the branch).  The CUDA backward takes q, k, v, out and dout through their strides (last dim
stride 1) and the lse as a contiguous fp32 [b, n, sq].

Document masking (``docs``: the query rows' and the keys' document ids, [b, sq] and [b, sk]): a query attends only
keys of its own document (and not its future on a causal block), by ``model.layers.blocked_by_document``.  The flash
kernels take no mask, so a masked block runs the eager computation with either kernel name: its [b, n, sq, sk]
scores are materialised (in the lse dtype) for the block in hand, forward and again in backward.  A masked block may
hold rows with no visible key (a row of a later document than every key): their lse is -inf and their output 0,
which the log-sum-exp merge adds as nothing; the final lse of every row is finite, since a token sees itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ds_megatron.model.layers import blocked_by_document

KERNELS = ("eager", "sdpa")


class Block(NamedTuple):
    out: Tensor  # [b, n, sq, d], q's dtype
    lse: Tensor  # [b, n, sq], fp32 (float64 for float64 inputs)


def _lse_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fold(q: Tensor, n_kv: int) -> Tensor:
    """[b, n, sq, d] -> [b, n_kv, g * sq, d]: each KV head's group of query heads folded into rows, so the
    matmuls use K and V at KV size."""
    b, n, sq, d = q.shape
    return q.reshape(b, n_kv, (n // n_kv) * sq, d)


Docs = tuple[Tensor, Tensor]  # (query rows' document ids [b, sq], keys' document ids [b, sk])


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, docs: Docs | None = None) -> Tensor:
    """Scaled scores [b, n, sq, sk] in the lse dtype, -inf above the diagonal of a causal block and, with ``docs``,
    across documents."""
    b, n, sq, _ = q.shape
    sk = k.shape[2]
    scores = torch.matmul(_fold(q * scale, k.shape[1]), k.transpose(-1, -2)).to(_lse_dtype(q)).view(b, n, sq, sk)
    if docs is not None:
        return scores.masked_fill(blocked_by_document(*docs, causal), float("-inf"))
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _eager_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, docs: Docs | None = None) -> Block:
    b, n, sq, d = q.shape
    scores = _scores(q, k, causal, scale, docs)
    row_max = scores.amax(-1, keepdim=True)  # finite unless docs leave a row no key (then -inf)
    if docs is not None:
        row_max = row_max.clamp_min(torch.finfo(row_max.dtype).min)  # exp(-inf - finite) = 0, never nan
    lse = (row_max + torch.log(torch.exp(scores - row_max).sum(-1, keepdim=True))).squeeze(-1)  # -inf: no key
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(lse.dtype).min)).to(v.dtype)
    out = torch.matmul(probs.view(b, k.shape[1], -1, k.shape[2]), v).view(b, n, sq, d)
    return Block(out, lse)


def _eager_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    docs: Docs | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    b, n, sq, d = q.shape
    n_kv, sk = k.shape[1], k.shape[2]
    probs = torch.exp(_scores(q, k, causal, scale, docs) - lse.unsqueeze(-1))  # the block's share of the final softmax
    delta = (dout.to(probs.dtype) * out.to(probs.dtype)).sum(-1, keepdim=True)  # D = rowsum(dO * O_final)
    dout_f = _fold(dout, n_kv)
    dv = torch.matmul(probs.to(v.dtype).view(b, n_kv, -1, sk).transpose(-1, -2), dout_f)
    dprobs = torch.matmul(dout_f, v.transpose(-1, -2)).view(b, n, sq, sk)
    dscores = (probs * (dprobs.to(probs.dtype) - delta)).to(q.dtype).view(b, n_kv, -1, sk)
    dq = (torch.matmul(dscores, k) * scale).view(b, n, sq, d)
    dk = torch.matmul(dscores.transpose(-1, -2), _fold(q, n_kv)) * scale
    return dq, dk, dv


def on_cuda(x: Tensor) -> bool:
    """Whether the ``sdpa`` kernel runs torch's CUDA flash ops on ``x`` (else the CPU flash kernel): the one place
    the choice is made, so a test can run the CUDA branch's own argument construction against a CPU stand-in of
    those ops."""
    return x.is_cuda


def _flash_cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Block:
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        raise ValueError(
            f"cp attention sdpa on CUDA runs flash attention, which needs fp16 or bf16 and a head dim that is a "
            f"multiple of 8 and at most 256 (got {q.dtype}, head dim {d}); train in bf16 with such a head dim or use "
            'attention "eager"'
        )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return Block(out, lse)


def _last_dim_dense(x: Tensor) -> Tensor:
    """``x`` itself when its last dim has stride 1 (all flash's CUDA kernels ask of q, k, v, out and dout: rows
    and heads are read through their strides), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _flash_cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    sq, sk = q.shape[2], k.shape[2]
    dout, q, k, v, out = (_last_dim_dense(t) for t in (dout, q, k, v, out))
    # The kernel reads softmax_lse by its data pointer as a contiguous fp32 [b, n, sq]: a query-row slice of the
    # merged lse (the ring's second-chunk rows) is strided, and read raw it gives every head after the first the
    # wrong rows' lse, so wrong dq, dk, dv without an error.  A copy only when strided ([b, n, rows] fp32: small).
    lse = lse.contiguous()
    # Undefined cumulative lengths (None) select the dense kernel: any defined tensor there, even an empty one,
    # takes the variable-length path, which refuses it ("cu_seqlens_q must have dtype int32").  The philox seed and
    # offset are read only with dropout (none here): undefined as well.
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, None, None, scale=scale
    )
    return grads[0], grads[1], grads[2]


def block_forward(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, docs: Docs | None = None
) -> Block:
    """Attention of query rows q over the key block (k, v), with its log-sum-exp; with ``docs`` (document ids of
    the rows and of the keys) only within each document, by the eager computation whatever the kernel."""
    if kernel == "eager" or docs is not None:
        return _eager_forward(q, k, v, causal, scale, docs)
    if on_cuda(q):
        return _flash_cuda_forward(q, k, v, causal, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return Block(out, lse)


def block_backward(
    kernel: str,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    docs: Docs | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this block's part of a softmax whose final output and log-sum-exp over every key block are
    ``out`` [b, n, sq, d] (q's dtype) and ``lse`` [b, n, sq]; dk and dv at KV-head size.  ``docs`` as in
    :func:`block_forward` (the same ids as its forward)."""
    if kernel == "sdpa" and docs is None and not on_cuda(q):
        # The CPU kernel reads every operand through its strides (a query-row slice of a [b, n, s, d] tensor, the
        # [s, b, n, d] memory of a block's projections) with the same result bit for bit: no copies (each
        # .contiguous() here was a [b, n, rows, d] copy per operand per ring step).
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kernel == "sdpa" and docs is None:
        return _flash_cuda_backward(dout, q, k, v, out, lse, causal, scale)
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    return _eager_backward(dout, q, k, v, out, lse, causal, scale, docs)
