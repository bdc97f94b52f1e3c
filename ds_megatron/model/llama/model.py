"""The single-device Llama-style decoder (Llama 3, and the models that share its layout).  Torch only.

RMSNorm, rotary position embedding (optionally Llama 3's ``llama3`` frequency scaling), grouped-query attention, a
SwiGLU MLP, no biases, tied or untied output layer.  Parameter names are exactly transformers' ``LlamaForCausalLM``
names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), and linear weights are ``nn.Linear``'s
[out, in] as there, so the HF key map is the identity.

Activations inside the stack are ``[s, b, h]`` (sequence first, as in ``gpt2/model.py``).  Three autograd functions
keep what backward needs at its smallest: ``model.layers.RMSNormFunction`` stores the input and one fp32 number per
token, :class:`SwiGLUFunction` the gate and up projections only (not the SiLU output as well), and
:class:`RotaryFunction` only the tables; their arithmetic runs eager or compiled (``ds_megatron.model.kernels``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ds_megatron.model.kernels import EAGER, Kernels
from ds_megatron.model.layers import (
    SINGLE_DEVICE,
    BlockHooks,
    CoreAttention,
    Modeling,
    RMSNorm,
    Slices,
    TensorCache,
    TiedEmbedding,
    init_by_name,
    positions_tensor,
    whole,
)
from ds_megatron.model.llama import FAMILY, LlamaConfig

# ---------------------------------------------------------------------------------------------------------------
# Rotary position embedding (Su et al. 2021), with Llama 3's frequency scaling.


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None) -> torch.Tensor:
    """[d/2] fp32 rotation frequencies theta^(-2i/d).  Llama 3 scaling (factor f over an original context C):
    wavelengths shorter than C / high_freq_factor keep their frequency, those longer than C / low_freq_factor are
    slowed by f, and the band between is interpolated linearly in C / wavelength."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv
    cfg = dict(scaling)
    factor, low, high = float(cfg["factor"]), float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    context = float(cfg["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    smooth = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed by f, 1: kept
    return (1 - smooth) * inv / factor + smooth * inv


@functools.lru_cache(maxsize=8)
def rotary_tables(
    positions: tuple[tuple[int, int], ...],
    head_dim: int,
    theta: float,
    scaling: tuple | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, 1, 1, d] for the positions of ``positions`` ([start, stop) ranges, in order; ``((0, s),)`` on
    one device), computed in fp32, then cast like the activations.  Cached: every block of a process shares one pair
    of tables instead of holding its own."""
    inv = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(positions_tensor(positions).to(torch.float32), inv)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=8)
def _frequencies_on(head_dim: int, theta: float, scaling: tuple | None, device: torch.device) -> torch.Tensor:
    """``inverse_frequencies`` on ``device``, made once (not copied to the device on every layer call)."""
    return inverse_frequencies(head_dim, theta, scaling).to(device)


def rotary_rows(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, b, 1, d] for per-token positions [b, s] (packed documents: each row has its own positions, so
    one [s] table cannot serve the batch).  The same fp32 angles as ``rotary_tables``, then cast like the
    activations; made once per positions tensor (a micro-batch's, which every block of a stage receives) and shared
    by the blocks, as ``rotary_tables`` is."""
    return _ROTARY_ROWS.get(
        positions, lambda: _rotary_rows(positions, head_dim, theta, scaling, dtype), head_dim, theta, scaling, dtype
    )


_ROTARY_ROWS = TensorCache()


def _rotary_rows(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = _frequencies_on(head_dim, theta, scaling, positions.device)
    angles = positions.t().to(torch.float32)[:, :, None] * inv  # [s, b, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RotaryFunction(torch.autograd.Function):
    """Rotate pairs (x_i, x_{i + d/2}) of q and k [s, b, heads, d] by the angle of each position
    (``kernels.rotary_forward``).  Positions are global: under sequence parallelism q and k hold the full sequence
    (after the column-parallel all-gather), never a shard; under context parallelism the tables are those of the
    rank's chunks (``BlockHooks.positions``).  The rotation is linear, so only the tables are saved: backward
    rotates the gradients by minus the angle."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: Kernels):
        ctx.kernels = kernels
        ctx.save_for_backward(cos, sin)
        return kernels.rotary_forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return *ctx.kernels.rotary_backward(grad_q, grad_k, cos, sin), None, None, None


# ---------------------------------------------------------------------------------------------------------------
# SwiGLU with lean saved tensors.


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up.  Saves gate and up only; backward recomputes silu(gate) (elementwise, cheap), in the inputs'
    dtype (``kernels.swiglu_backward``).  ``kernels``: eager or compiled bodies."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        ctx.kernels = kernels
        ctx.save_for_backward(gate, up)
        return kernels.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return *ctx.kernels.swiglu_backward(grad, gate, up), None


# ---------------------------------------------------------------------------------------------------------------
# The model.


class LlamaAttention(nn.Module):
    """Llama's attention; with a config whose ``qk_norm`` is set (Qwen3's), a per-head RMSNorm of q and of k before
    the rotation (``q_norm``, ``k_norm``, transformers' names); with one whose ``qkv_bias`` is set (Qwen2's),
    biases on q, k and v."""

    kernels: Kernels = EAGER  # the rotation's bodies (``kernels.use_kernels`` sets the compiled ones)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.config = config
        self.head_dim = d
        bias = bool(getattr(config, "qkv_bias", False))  # Qwen2's q, k and v have biases
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.qk_norm = bool(getattr(config, "qk_norm", False))
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.core_attention = CoreAttention(config)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        hooks: BlockHooks,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [s(/t), b, h] -> [s(/t), b, h].  After TP the local head counts are read off the projections' widths.
        Packed documents: ``doc_ids`` and ``positions`` [b, s] (s the whole sequence q sees, after SP's all-gather;
        under CP this rank's tokens): attention inside each document, rotary angles per token."""
        q, k, v = hooks.project(x, (self.q_proj, self.k_proj, self.v_proj))  # each [s, b, heads_local * d]
        s, b, _ = q.shape
        d, c = self.head_dim, self.config
        if positions is None:
            cos, sin = rotary_tables(hooks.positions(s), d, c.rope_theta, c.rope_scaling, q.device, q.dtype)
        else:
            cos, sin = rotary_rows(positions, d, c.rope_theta, c.rope_scaling, q.dtype)
        q, k = q.view(s, b, -1, d), k.view(s, b, -1, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryFunction.apply(q, k, cos, sin, self.kernels)
        q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)  # [b, n_local, s, d], [b, kv_local, s, d]
        v = v.view(s, b, -1, d).permute(1, 2, 0, 3)
        ctx = hooks.core_attention(self.core_attention, q, k, v, doc_ids)  # [b, n_local, s, d]
        return self.o_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))


class LlamaMLP(nn.Module):
    kernels: Kernels = EAGER  # SwiGLU's bodies (``kernels.use_kernels`` sets the compiled ones)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, hooks: BlockHooks) -> torch.Tensor:
        gate, up = hooks.project(x, (self.gate_proj, self.up_proj))
        swiglu = lambda g, u: SwiGLUFunction.apply(g, u, self.kernels)  # noqa: E731
        return hooks.around_act(swiglu, (gate, up), self.down_proj)


class LlamaBlock(nn.Module):
    """Pre-norm decoder block.  ``hooks``: what TP, SP and recompute change in its forward (the default is the
    single-device block; ``ds_megatron.parallelize.parallelize_block`` sets the parallel ones)."""

    def __init__(self, config: LlamaConfig, hooks: BlockHooks = SINGLE_DEVICE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.hooks = hooks

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [s(/t), b, h] -> same: x + attn(norm(x)), then + mlp(norm(.)).  ``doc_ids``, ``positions`` [b, s]:
        packed documents (``LlamaAttention.forward``)."""
        hooks = self.hooks
        attn = lambda y: self.self_attn(y, hooks, doc_ids, positions)  # noqa: E731
        x = x + hooks.around_norm(self.input_layernorm, (x,), attn)
        return x + hooks.around_norm(self.post_attention_layernorm, (x,), lambda y: self.mlp(y, hooks))


class Llama(nn.Module):
    """Llama-style causal LM with transformers' ``LlamaForCausalLM`` parameter names."""

    def __init__(self, config: LlamaConfig, seed: int = 1234):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=TiedEmbedding(config.vocab_size, config.hidden_size),
                layers=nn.ModuleList(LlamaBlock(config) for _ in range(config.num_layers)),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            )
        )
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_llama_module(self, config, seed)

    def forward(
        self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V].  Packed documents (``data.document_mask``): ``doc_ids`` and
        ``positions`` [b, s] (``data.document_mask.document_layout``)."""
        m = self.model
        x = m.embed_tokens(input_ids.t())  # [s, b, h]
        for block in m.layers:
            x = block(x, doc_ids, positions)
        x = m.norm(x)
        logits = m.embed_tokens.logits(x) if self.config.tie_word_embeddings else self.lm_head(x)
        return logits.transpose(0, 1)


def init_llama_module(
    module: nn.Module, config: LlamaConfig, seed: int, prefix: str = "", slices: Slices | None = None
) -> None:
    """Initialise every parameter of ``module`` by its full name ``prefix + local name``: N(0, std) for every linear
    and embedding weight, std / sqrt(2 L) for the two residual projections (o_proj, down_proj; GPT-2's depth
    scaling), ones for the RMSNorm weights (``slices``: the part of each full parameter the module holds,
    ``model.layers.Slices``; None: all)."""

    def std_of(name: str) -> float | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return config.initializer_range / math.sqrt(2 * config.num_layers)
        return config.initializer_range

    init_by_name(module, prefix, seed, std_of, slices or whole(FAMILY))


MODELING = Modeling(Llama, LlamaBlock, lambda c: RMSNorm(c.hidden_size, c.rms_norm_eps), init_llama_module)
