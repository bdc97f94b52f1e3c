"""The single-device GPT.  It knows nothing about parallelism (torch only).

Parameter names follow the Hugging Face GPT-2 keys (``transformer.h.0.attn.c_attn.weight``...).  Linear weights are
stored as ``nn.Linear`` ([out, in]); GPT-2's ``Conv1D`` stores [in, out], so the HF key map transposes them.

Activations inside the transformer stack are laid out ``[s, b, h]`` (sequence first), so a sequence shard is a
contiguous slice of dim 0; ``GPT.forward`` takes ``[b, s]`` ids and returns ``[b, s, V]`` logits like transformers.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ds_megatron.model.config import GPTConfig


class ScaledCausalSoftmax(torch.autograd.Function):
    """softmax(scores with the future masked) along the last dim, stored in the scores' dtype.

    ``F.softmax(x, dtype=float32).to(bf16)`` would keep the fp32 result for backward (4 bytes per score instead of 2:
    +25% of a block's activations at s 512, h 256, a 8) and ``masked_fill`` would keep the [s, s] mask.  Here only
    the output is saved, in the scores' dtype; backward recomputes nothing: dx = y * (dy - sum(dy * y)), which is
    zero at masked positions because y is zero there.  torch's softmax kernels accumulate bf16/fp16 inputs in fp32
    internally, so the scores are never converted as a whole: converting the s x s tensors to fp32 and back (five
    passes per layer) took a third of a bf16 CPU step (measured: 1,282 -> 709 ms/step at s 2048, h 256, tp 2)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        """scores [..., s, s] (already scaled); future [s, s] bool, True where a token must not attend."""
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype), None


def compose(fn: Callable, inputs: tuple[torch.Tensor, ...], consumer: Callable) -> torch.Tensor:
    """``consumer(fn(*inputs))``.  Blocks call their norms and MLP activations through an attribute holding this
    function, so the recompute plan can swap in a version that does not store ``fn``'s output for the consumer's
    backward but recomputes it from ``inputs`` (``ds_megatron.recompute.discard_output``)."""
    return consumer(fn(*inputs))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + causal mask) -> dropout -> x V: the part selective recompute checkpoints.

    ``rng_fork`` returns the context manager the core runs in (its dropout needs the tensor-parallel RNG state once
    heads are split across TP ranks); the plain model runs it in the default state.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kernel = config.attention
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.rng_fork: Callable[[], ContextManager] = contextlib.nullcontext
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _future_mask(self, s: int, device: torch.device) -> torch.Tensor:
        """[s, s] bool, True above the diagonal (positions a token must not attend to); built once per length."""
        key = (s, device)
        if key not in self._masks:
            self._masks[key] = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        return self._masks[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, n_heads, s, d], k and v [b, n_kv, s, d] -> context [b, n_heads, s, d].

        With fewer KV heads than query heads (grouped-query attention), query head i attends with KV head
        i // (n_heads / n_kv).  K and V are never expanded to n_heads: the eager path folds each KV head's group of
        query heads into the row dim ([b, n_kv, g s, d]), so the matmuls store K and V at KV size."""
        with self.rng_fork():
            n, n_kv = q.shape[1], k.shape[1]
            if self.kernel == "sdpa":
                p = self.attn_dropout.p if self.training else 0.0
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p, is_causal=True, scale=self.scale, enable_gqa=n != n_kv
                )
            b, _, s, d = q.shape
            q = q * self.scale  # scaling q is s/d cheaper than scaling the scores
            if n != n_kv:
                q = q.reshape(b, n_kv, (n // n_kv) * s, d)
            scores = torch.matmul(q, k.transpose(-1, -2)).view(b, n, s, s)
            probs = ScaledCausalSoftmax.apply(scores, self._future_mask(s, q.device))
            probs = self.attn_dropout(probs)
            if n == n_kv:
                return torch.matmul(probs, v)
            return torch.matmul(probs.view(b, n_kv, -1, s), v).view(b, n, s, d)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # fused [q | k | v], each head-major
        self.core_attention = CoreAttention(config)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, h] -> [s, b, h].  After TP the local head count is read off c_attn's output width."""
        qkv = self.c_attn(x)  # [s, b, 3 * n_local * d]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each [b, n_local, s, d]
        ctx = self.core_attention(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n_local * d]
        return self.resid_dropout(self.c_proj(ctx))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.resid_pdrop)
        self.around_act = compose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.around_act(gelu_tanh, (self.c_fc(x),), self.c_proj))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.around_norm = compose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.around_norm(self.ln_1, (x,), self.attn)
        return x + self.around_norm(self.ln_2, (x,), self.mlp)


class TiedEmbedding(nn.Embedding):
    """Token embedding that doubles as the output layer (GPT-2's tied ``lm_head``)."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, V]."""
        return F.linear(x, self.weight)


class GPT(nn.Module):
    """GPT-2/GPT-3 language model with tied input/output embedding."""

    def __init__(self, config: GPTConfig, seed: int = 1234):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=TiedEmbedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                drop=nn.Dropout(config.embd_pdrop),
                h=nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        init_module(self, config, seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V]."""
        t = self.transformer
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        x = t.wte(input_ids.t()) + t.wpe(pos).unsqueeze(1)  # [s, b, h]
        x = t.drop(x)
        for block in t.h:
            x = block(x)
        return t.wte.logits(t.ln_f(x)).transpose(0, 1)


def init_std_for(name: str, config: GPTConfig) -> float | None:
    """GPT-2 initialisation: N(0, std) for weights, std / sqrt(2 L) for residual projections; None for ones/zeros."""
    if name.endswith("c_proj.weight"):
        return config.initializer_range / math.sqrt(2 * config.n_layer)
    if name.endswith((".weight",)) and not _is_norm(name):
        return config.initializer_range
    return None


def _is_norm(name: str) -> bool:
    leaf = name.split(".")[-2] if "." in name else name
    return leaf.startswith("ln_")


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, name: str, std: float, seed: int) -> None:
    """Fill ``param`` with N(0, std) from a generator seeded by (seed, its full name): the values depend only on the
    name and the seed, never on which stage or rank builds the module, which is what makes a tp=2, pp=2 model start
    from exactly the weights of the single-device one (for every model family).  Meta tensors (shapes only) are
    left alone."""
    if param.is_meta:
        return
    gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    param.copy_(values)


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, config: GPTConfig, seed: int) -> None:
    """Initialise one full (unsharded) GPT parameter by its GPT-2 name (see :func:`seeded_normal_`)."""
    std = init_std_for(name, config)
    if std is None:
        param.fill_(1.0 if _is_norm(name) and name.endswith(".weight") else 0.0)
        return
    seeded_normal_(param, name, std, seed)


def init_module(module: nn.Module, config: GPTConfig, seed: int, prefix: str = "") -> None:
    """Initialise every parameter of ``module`` whose full GPT name is ``prefix + local name``."""
    for local_name, param in module.named_parameters():
        init_parameter(prefix + local_name, param, config, seed)
