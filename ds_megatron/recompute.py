"""L2.5: activation recomputation with exact RNG replay (Korthikanti et al. 2022, sec. 5).

Policies (``recompute`` in the config):
- ``none``: everything is stored.
- ``selective``: the chosen ``modules`` are recomputed, by default only the core attention:
  ``core_attn``  QK^T, scale, mask, softmax, softmax dropout, x V: its s x s tensors (5 a s / h of the 34 + 5 a s / h
                 bytes per token and hidden unit) are never stored (a checkpoint of the core, with RNG replay);
  ``mlp_act``    the MLP activation's output (GELU's, SwiGLU's) is not stored for the second linear: backward
                 recomputes it from the activation's input, which the activation keeps anyway (4h per token in a
                 GPT, F in a Llama);
  ``layernorm``  the two norms' outputs are not stored for the linears that read them: backward recomputes them from
                 the norm inputs, which the norms keep anyway (2h per token, split by SP).
  ``moe``        a routed layer's expert activations (the routed copies of the tokens, gate and up, SwiGLU's output,
                 the expert outputs): a checkpoint of the local expert computation, keeping its gathered inputs
                 (tokens and routing weights), so the TP collectives around it are not run again
                 (``tensor_parallel.experts``); at ep > 1 of the local experts on the dispatched rows, kept, so the
                 all-to-alls are not run again (``expert_parallel.layer``); mixture-of-experts families only.
  ``mlp_act``, ``layernorm`` and ``moe`` involve no randomness and work with every attention kernel.
- ``full`` with ``num_layers`` k: ``uniform`` splits each stage's blocks into chunks of k and keeps only each chunk's
  input; ``block`` recomputes the first k blocks of each stage (each keeps only its input) and stores the rest
  (``config.RecomputeSection.chunks``).

The checkpoint is a reentrant autograd Function: forward runs without a graph and saves only the inputs (so memory
accounting with saved-tensor hooks sees exactly what is kept); backward restores every RNG state captured before
the forward (default and tensor-parallel; without a tracker the CPU's and the current CUDA device's generators),
recomputes, and backpropagates.  Dropout masks are therefore replayed bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_megatron.random import RNGTracker, global_rng_states, set_global_rng_states


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_fn, rng, *inputs):
        ctx.run_fn, ctx.rng = run_fn, rng
        ctx.rng_states = rng.get_states() if rng is not None else global_rng_states()
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run_fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        # Integer inputs (packed documents' ids and positions) carry no graph and stay the same objects, so what was
        # derived from them once per micro-batch (attention plans, rotary rows) serves the recompute too.
        inputs = [x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in ctx.saved_tensors]
        rng = ctx.rng
        current = rng.get_states() if rng is not None else global_rng_states()
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
        set_global_rng_states(states)


def checkpoint(run_fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, rng: RNGTracker | None) -> torch.Tensor:
    """Run ``run_fn(*inputs)`` keeping only ``inputs``; recompute it in backward with the same RNG states."""
    if not torch.is_grad_enabled():
        return run_fn(*inputs)
    return _Recompute.apply(run_fn, rng, *inputs)


class _Recipe:
    """A saved tensor replaced by the function and inputs that recompute it, and the view of the function's output
    it was (linears save a flattened [tokens, features] view of their input)."""

    __slots__ = ("fn", "inputs", "view")

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], view: tuple):
        self.fn, self.inputs, self.view = fn, inputs, view

    def recompute(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.fn(*self.inputs)
        size, stride, offset = self.view
        return out.as_strided(size, stride, out.storage_offset() + offset)


def discard_output(fn: Callable, inputs: tuple[torch.Tensor, ...], consumer: Callable) -> torch.Tensor:
    """``consumer(fn(*inputs))`` where every tensor the consumer saves for backward that *is* ``fn``'s output (same
    storage, shape and strides) is replaced by a recipe that recomputes it from ``inputs`` when backward needs it.
    Only worth it where ``fn``'s own backward keeps ``inputs`` anyway (norms, activations): then the output is
    simply never stored.  ``fn`` must be deterministic (no dropout).  Saved-tensor hooks already active around the
    call (memory accounting, offloading) still see every other saved tensor: they are chained, not replaced."""
    out = fn(*inputs)
    if not torch.is_grad_enabled():
        return consumer(out)
    storage, base = out.untyped_storage().data_ptr(), out.storage_offset()
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.dtype == out.dtype:  # the output or a view of it
            return _Recipe(fn, inputs, (t.shape, t.stride(), t.storage_offset() - base))
        return outer_pack(t) if outer_pack is not None else t

    def unpack(saved):
        if isinstance(saved, _Recipe):
            return saved.recompute()
        return outer_unpack(saved) if outer_unpack is not None else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(out)
