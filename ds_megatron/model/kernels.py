"""The memory-bound pieces of a block, and where they are compiled: RMSNorm, rotary embedding and SwiGLU.

Each piece is a ``torch.autograd.Function`` whose forward and backward bodies are plain functions of tensors: the
Function decides what is saved for backward (RMSNorm: its input and one fp32 number per token; SwiGLU: gate and up;
rotary: nothing but the tables), the bodies do the arithmetic.  The bodies run op by op (:data:`EAGER`) or as
inductor kernels (:func:`compiled_kernels`: ``torch.compile`` of each body, C++ on CPU, Triton on GPU), fused into
one or two passes over memory where eager makes several.  The bodies run without autograd (inside the Function), so
each compiles once per shape and dtype and never again: the same graph serves forward, the recompute of a
checkpointed block (``ds_megatron.recompute``) and backward, with gradients on or off.

What stays outside compiled code, and why:
- dropout: masks must come from the generator state the RNG tracker (``ds_megatron.random``) selects and replay bit
  for bit in a recompute; inductor draws its own random numbers (Philox on GPU), a different mask than eager's
  from the same state, and the tracker's fork is a Python switch of generator states;
- the TP/SP collectives and the linears around them (``tensor_parallel.layers``): hand-written autograd Functions
  that overlap collectives with matmuls; a matmul is not memory-bound;
- recompute (``recompute.checkpoint``, ``discard_output``): Python control over autograd and saved-tensor hooks;
- GPT-2's LayerNorm and GELU: ``F.layer_norm`` and ``F.gelu`` are already one aten kernel forward and one backward
  each, on CPU and CUDA (compiling GELU gains nothing: benchmarks/results/compiled_pieces.md), so a GPT-2 block
  has nothing here to compile;
- the residual adds: one pass each, next to a Function boundary or a collective, nothing to fuse them with here.
Torch only."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (bf16/fp16 upcast; fp32 and fp64 kept)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = weight * (x / rms(x)) with the normalisation in fp32 and the result cast back before the weight (the
    rounding order of transformers' LlamaRMSNorm); also the fp32 1/rms per token [..., 1]."""
    xf = upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx and dweight of :func:`rms_norm_forward` from x and the saved 1/rms."""
    normed = upcast(x) * rstd  # [..., h], fp32 (or wider)
    g = upcast(grad)
    grad_weight = (g * upcast(normed.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    gn = g * upcast(weight)
    grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate pairs (x_i, x_{i + d/2}) of q and k [s, b, heads, d] by each position's angle (cos, sin broadcast
    against them: [s, 1, 1, d] or [s, b, 1, d], each the same on both halves)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's transpose, the rotation by minus the angle: dx = dy cos - rotate_half(dy) sin (rotate_half is
    antisymmetric and sin equal on both halves)."""
    return grad_q * cos - _rotate_half(grad_q) * sin, grad_k * cos - _rotate_half(grad_k) * sin


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In the inputs' dtype: torch's bf16/fp16 ``silu`` and ``silu_backward`` compute in fp32 per element and round
    once, so fp32 copies of gate, up and the gradient buy no accuracy the bf16 outputs keep, and each copy is one
    more pass over the [s, b, F] tensors."""
    # silu_backward(dy', g) = dy' * sigmoid(g) * (1 + g * (1 - sigmoid(g))), the derivative of silu
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class Kernels(NamedTuple):
    """The bodies the block's Functions run: eager or compiled."""

    compiled: bool
    rms_norm_forward: Callable
    rms_norm_backward: Callable
    rotary_forward: Callable
    rotary_backward: Callable
    swiglu_forward: Callable
    swiglu_backward: Callable


EAGER = Kernels(
    False,
    rms_norm_forward,
    rms_norm_backward,
    rotary_forward,
    rotary_backward,
    swiglu_forward,
    swiglu_backward,
)


@functools.cache
def compiled_kernels() -> Kernels:
    """:data:`EAGER`'s bodies through ``torch.compile`` (inductor), each one graph (``fullgraph``) for fixed shapes
    (``dynamic=False``: a training run's shapes never change, so a shape guard never fails after the first step).
    Made once per process, so every block shares the compiled graphs: a stack of identical blocks compiles each
    body once per shape and dtype (rotary turns q and k in one call, so grouped-query attention's narrower k needs
    no graph of its own)."""

    def compile_(fn: Callable) -> Callable:
        graph = torch.compile(fn, dynamic=False, fullgraph=True)

        def call(*args):
            if is_in_torch_dispatch_mode():
                # Under a TorchDispatchMode (op counting, fake or meta tensors) dynamo runs no compiled frame; the
                # eager body computes the same values.
                return fn(*args)
            # Dynamo's guards check each tensor's requires_grad and strides.  The bodies run without autograd, so
            # the flag is dropped (a view); a gradient's layout depends on the path upstream (the rotary's arrive
            # permuted, in another order under recompute), so tensors are made contiguous (a no-op for the rest):
            # one graph then serves forward, recompute and backward on every path.
            return graph(*(a.detach().contiguous() if isinstance(a, torch.Tensor) else a for a in args))

        return call

    return Kernels(True, *(compile_(fn) for fn in EAGER[1:]))


def use_kernels(module: nn.Module, kernels: Kernels) -> nn.Module:
    """Make every submodule of ``module`` that runs a memory-bound piece (a ``kernels`` attribute: RMSNorm, Llama's
    attention and MLP) run it with ``kernels``."""
    for sub in module.modules():
        if isinstance(getattr(type(sub), "kernels", None), Kernels) and sub.kernels is not kernels:
            sub.kernels = kernels
    return module


def compile_report() -> str | None:
    """One line: how many graphs inductor compiled in this process and the time it took (dynamo's own counters);
    None when nothing was compiled."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    graphs = counters["stats"]["unique_graphs"]
    if not graphs:
        return None
    seconds = sum(sum(times) for name, times in compilation_time_metrics.items() if name.endswith("compile_inner"))
    return f"torch.compile: {graphs} graphs of the block's memory-bound pieces compiled in {seconds:.1f} s"
