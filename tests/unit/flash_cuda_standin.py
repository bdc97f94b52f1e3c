"""A CPU stand-in for torch's CUDA flash attention ops, so the CUDA branch of ``cp_kernels`` runs its own argument
construction on CPU.

``cuda_flash_on_cpu()`` registers CPU kernels for ``aten::_scaled_dot_product_flash_attention`` and its backward
(ops torch ships for CUDA only; the calls go through the real dispatcher and schema) and points
``cp_kernels.on_cuda`` at them.  Each kernel first checks what the CUDA one (flash-attention's ``mha_fwd`` /
``mha_bwd`` behind torch's ``_scaled_dot_product_flash_attention[_backward]_cuda``) requires, raising its message,
then computes with torch's CPU flash kernel:
  - cum_seq_q / cum_seq_k undefined (None): the dense kernel.  A defined tensor takes the variable-length path,
    which needs int32 cumulative lengths ("cu_seqlens_q must have dtype int32"); the dense path is all this stand-in
    computes.
  - q, k, v (and out, dout in backward) fp16 or bf16, one dtype, last dim of stride 1 (other strides are read);
    head dim a multiple of 8 and at most 256; query heads a multiple of KV heads; out and dout shaped like q.
  - the philox seed and offset are read only with dropout.
  - softmax_lse fp32 [b, n, sq], read by its data pointer as a contiguous tensor: the stand-in reads it the same
    way (``as_strided`` from its storage offset), so a strided lse gives the wrong rows' values here as on a GPU.
The forward returns what the CUDA op does: out [b, n, sq, d] as a view of a [b, sq, n, d] tensor, lse fp32
[b, n, sq] contiguous, undefined cumulative lengths, the max lengths, an rng state and empty tensors.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor

from ds_megatron.context_parallel import kernels as cp_kernels

CALLS: Counter[str] = Counter()  # stand-in calls, so a test can check the CUDA branch ran


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_operands(q: Tensor, k: Tensor, v: Tensor, extra: dict[str, Tensor]) -> None:
    _check(q.dim() == k.dim() == v.dim() == 4, "q, k, v must be [b, n, s, d]")
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    for name, t in {"key": k, "value": v, **extra}.items():
        _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
    for name, t in {"q": q, "k": k, "v": v, **extra}.items():
        _check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
    b, n, _, d = q.shape
    _check(b > 0, "batch size must be positive")
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    _check(d <= 256, "FlashAttention only supports head dimension at most 256")
    _check(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d, "k, v must be [b, n_kv, sk, d] like q")
    _check(n % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    for name, t in extra.items():
        _check(t.shape == q.shape, f"{name} must be shaped like q")


def _forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
    return_debug_mask: bool = False, *, scale: float | None = None,
) -> tuple:  # fmt: skip
    CALLS["forward"] += 1
    _check_operands(q, k, v, {})
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the CUDA op's layout: [b, sq, n, d] memory
    rng_state, unused = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse.contiguous(), None, None, q.shape[2], k.shape[2], rng_state, unused, q.new_empty(0)


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cum_seq_q: Tensor | None,
    cum_seq_k: Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
    philox_seed: Tensor | None, philox_offset: Tensor | None, *, scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    CALLS["backward"] += 1
    for name, cum in (("cu_seqlens_q", cum_seq_q), ("cu_seqlens_k", cum_seq_k)):
        if cum is not None:  # torch picks the variable-length kernel from a defined cum_seq_q
            _check(cum.dtype == torch.int32, f"{name} must have dtype int32")
            raise NotImplementedError("the stand-in computes the dense kernel only (undefined cum_seq_q/k)")
    _check(dropout_p == 0.0 or philox_seed is not None, "dropout reads the philox seed and offset")
    _check_operands(q, k, v, {"out": out, "dout": dout})
    b, n, sq, _ = q.shape
    _check(lse.dtype == torch.float32, "softmax_lse must be fp32")
    _check(tuple(lse.shape) == (b, n, sq), "softmax_lse must be [b, n, sq]")
    # Read as the kernel reads it: b n sq floats from its data pointer, row-major.
    raw = lse.as_strided((b, n, sq), (n * sq, sq, 1), lse.storage_offset())
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, raw, dropout_p, is_causal, scale=scale
    )


@contextlib.contextmanager
def cuda_flash_on_cpu() -> Iterator[None]:
    """Inside: ``cp_kernels``' sdpa kernel takes its CUDA branch on CPU tensors, against the stand-in ops."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", _forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", _backward, "CPU")
    real = cp_kernels.on_cuda
    cp_kernels.on_cuda = lambda x: True
    try:
        yield
    finally:
        cp_kernels.on_cuda = real
        lib._destroy()
