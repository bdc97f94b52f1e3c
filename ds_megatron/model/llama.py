"""The single-device Llama-style decoder (Llama 3, and the models that share its layout).  Torch only.

RMSNorm, rotary position embedding (optionally Llama 3's ``llama3`` frequency scaling), grouped-query attention, a
SwiGLU MLP, no biases, tied or untied output layer.  Parameter names are exactly transformers' ``LlamaForCausalLM``
names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), and linear weights are ``nn.Linear``'s
[out, in] as there, so the HF key map is the identity.

Activations inside the stack are ``[s, b, h]`` (sequence first, as in ``gpt.py``).  Two autograd functions keep what
backward needs at its smallest: :class:`RMSNormFunction` stores the input and one fp32 number per token, and
:class:`SwiGLUFunction` stores the gate and up projections only (not the SiLU output as well).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_megatron.model.gpt import CoreAttention, TiedEmbedding, compose, seeded_normal_


@dataclass(frozen=True)
class LlamaConfig:
    """Llama architecture, convertible to and from ``transformers.LlamaConfig``."""

    vocab_size: int = 32000  # real vocabulary (V); TP padding is applied by parallelize, never here
    hidden_size: int = 4096  # h
    num_layers: int = 32  # L
    num_heads: int = 32  # a
    num_kv_heads: int = 8  # grouped-query attention's KV heads (divides num_heads)
    intermediate_size: int = 14336  # SwiGLU width (F)
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3 scaling as sorted (key, value) pairs
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0  # dropout on attention probabilities (Llama's only dropout)
    initializer_range: float = 0.02
    attention: str = "eager"  # "eager" or "sdpa"

    family = "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def attn_pdrop(self) -> float:
        return self.attention_dropout

    @property
    def n_layer(self) -> int:
        return self.num_layers

    @property
    def n_embd(self) -> int:
        return self.hidden_size

    def to_hf(self) -> Any:
        """The equivalent ``transformers.LlamaConfig`` (imported lazily)."""
        from transformers import LlamaConfig as HFLlamaConfig

        return HFLlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, **dict(self.rope_scaling or ())},
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=self.attention_dropout,
            attn_implementation=self.attention,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @classmethod
    def from_shape(cls, m: Any) -> LlamaConfig:
        """From a resolved model shape (``ds_megatron.config.ModelShape``, read by attribute)."""
        return cls(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_theta,
            rope_scaling=m.rope_scaling,
            rms_norm_eps=m.layer_norm_epsilon,
            tie_word_embeddings=m.tie_word_embeddings,
            attention_dropout=m.dropout,
            initializer_range=m.init_std,
            attention=m.attention,
        )

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> LlamaConfig:
        """Build from a ``transformers.LlamaConfig``; refuses settings this model does not implement."""
        unsupported = []
        if getattr(hf, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf.hidden_act}")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf, flag, False):
                unsupported.append(f"{flag}=True")
        head_dim = getattr(hf, "head_dim", None)
        if head_dim not in (None, hf.hidden_size // hf.num_attention_heads):
            unsupported.append(f"head_dim={head_dim} (not hidden_size / num_attention_heads)")
        if getattr(hf, "pretraining_tp", 1) not in (None, 1):
            unsupported.append(f"pretraining_tp={hf.pretraining_tp}")
        scaling = getattr(hf, "rope_scaling", None)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3"):
            unsupported.append(f"rope_scaling.rope_type={kind}")
        if unsupported:
            raise ValueError(
                f"error: LlamaConfig: unsupported settings ({', '.join(unsupported)}); use a standard Llama config"
            )
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        pairs = None
        if kind == "llama3":
            pairs = tuple(sorted([("rope_type", "llama3"), *((k, scaling[k]) for k in keys)]))
        theta = getattr(hf, "rope_theta", None) or (getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            max_position_embeddings=hf.max_position_embeddings,
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=pairs,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
            initializer_range=hf.initializer_range,
            attention=attention,
        )


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
    seq_len: int, head_dim: int, theta: float, scaling: tuple | None, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, 1, 1, d] for positions 0..s-1 (computed in fp32, then cast like the activations).  Cached: every
    block of a process shares one pair of tables instead of holding its own."""
    inv = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + d/2}) of x [s, b, n, d] by the angle of each position.  Positions are global: under
    sequence parallelism x is the full sequence (after the column-parallel all-gather), never a shard."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm and SwiGLU with lean saved tensors.


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (bf16/fp16 upcast; fp32 and fp64 kept)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNormFunction(torch.autograd.Function):
    """y = weight * (x / rms(x)) with the normalisation in fp32 and the result cast back before the weight (the
    rounding order of transformers' LlamaRMSNorm).  Saves x and the fp32 1/rms per token only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _upcast(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = _upcast(x) * rstd  # [..., h], fp32 (or wider)
        g = _upcast(grad)
        grad_weight = (g * _upcast(normed.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = g * _upcast(weight)
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up.  Saves gate and up only; backward recomputes sigmoid(gate) (elementwise, cheap)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        g, u, dy = _upcast(gate), _upcast(up), _upcast(grad)
        sig = torch.sigmoid(g)
        silu = g * sig
        grad_gate = dy * u * sig * (1 + g * (1 - sig))
        return grad_gate.to(gate.dtype), (dy * silu).to(up.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The model.

# How a module projects one input with several linear layers (q|k|v, gate|up).  The plain model calls each in turn;
# the parallel plan replaces it with one that gathers a sequence-parallel input once for all of them.
Projection = Callable[[torch.Tensor, tuple[nn.Module, ...]], tuple[torch.Tensor, ...]]


def project_each(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(linear(x) for linear in linears)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.config = config
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.core_attention = CoreAttention(config)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.project: Projection = project_each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s(/t), b, h] -> [s(/t), b, h].  After TP the local head counts are read off the projections' widths."""
        q, k, v = self.project(x, (self.q_proj, self.k_proj, self.v_proj))  # each [s, b, heads_local * d]
        s, b, _ = q.shape
        d, c = self.head_dim, self.config
        cos, sin = rotary_tables(s, d, c.rope_theta, c.rope_scaling, q.device, q.dtype)
        q = apply_rotary(q.view(s, b, -1, d), cos, sin).permute(1, 2, 0, 3)  # [b, n_local, s, d]
        k = apply_rotary(k.view(s, b, -1, d), cos, sin).permute(1, 2, 0, 3)  # [b, kv_local, s, d]
        v = v.view(s, b, -1, d).permute(1, 2, 0, 3)
        ctx = self.core_attention(q, k, v)  # [b, n_local, s, d]
        return self.o_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.project: Projection = project_each
        self.around_act = compose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, (self.gate_proj, self.up_proj))
        return self.around_act(SwiGLUFunction.apply, (gate, up), self.down_proj)


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.around_norm = compose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.around_norm(self.input_layernorm, (x,), self.self_attn)
        return x + self.around_norm(self.post_attention_layernorm, (x,), self.mlp)


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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V]."""
        m = self.model
        x = m.embed_tokens(input_ids.t())  # [s, b, h]
        for block in m.layers:
            x = block(x)
        x = m.norm(x)
        logits = m.embed_tokens.logits(x) if self.config.tie_word_embeddings else self.lm_head(x)
        return logits.transpose(0, 1)


def llama_init_std(name: str, config: LlamaConfig) -> float | None:
    """N(0, std) for every linear and embedding weight, std / sqrt(2 L) for the two residual projections (o_proj,
    down_proj; GPT-2's depth scaling); None (ones) for the RMSNorm weights."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return config.initializer_range / math.sqrt(2 * config.num_layers)
    return config.initializer_range


def init_llama_module(module: nn.Module, config: LlamaConfig, seed: int, prefix: str = "") -> None:
    """Initialise every parameter of ``module`` whose full Llama name is ``prefix + local name`` (values depend on
    the name and the seed only, never on the stage or rank that builds it)."""
    with torch.no_grad():
        for local_name, param in module.named_parameters():
            name = prefix + local_name
            std = llama_init_std(name, config)
            if std is None:
                param.fill_(1.0)
            else:
                seeded_normal_(param, name, std, seed)
