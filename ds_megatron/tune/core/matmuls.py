"""The matmuls one GPU runs for one block and one micro-batch, and how fast each runs: a smooth roofline, each matmul
taking (FLOPs / peak + bytes / HBM bandwidth) / ceiling, i.e. ceiling x I / (I + peak / bandwidth) of the peak at
arithmetic intensity I.  The shapes per family and kernel, and how the ceiling was fitted, are in docs/tuner.md,
"Time model".  Pure Python."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.model import family_of
from ds_megatron.tune.core.memory_model import ACT_BYTES, padded_vocab_size, routed_terms
from ds_megatron.tune.core.spec import Candidate, Cluster


@dataclass(frozen=True)
class Matmul:
    """One matmul kind of a block's forward on one GPU: its FLOPs and HBM bytes (all ``count`` instances)."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def gemm(name: str, m: int, k: int, n: int, count: int = 1) -> Matmul:
    """``count`` GEMMs of an m x k by k x n product, bf16 operands and result."""
    return Matmul(name, 2.0 * m * k * n * count, float(ACT_BYTES * (m * k + k * n + m * n) * count))


# A search evaluates thousands of candidates that share a few (tokens, t, ep) shapes, some several times (each
# uneven layout's stages): the matmuls and their times are made once per shape (a cache bounded like the search).
CACHED_SHAPES = 4096


def block_matmuls(
    model: ModelShape, cand: Candidate, ep: int | None = None, dense: bool = False, expert_tp: int = 1
) -> tuple[Matmul, ...]:  # fmt: skip
    """The weight matmuls of one block's forward for one micro-batch, per GPU (the TP-split dimension divided by t;
    the shapes are the family's ``tuner.block_gemms``).  ``ep`` (a routed family in training): its experts as one
    GEMM per expert on the rank at ep, each at its share of the tokens (``expert_tp`` at ep > 1: t where each
    expert is split over TP); None: one GEMM over every routed row.  ``dense``: a routed family's dense block (its
    SwiGLU of the dense width)."""
    tokens = model.seq_length // cand.cp * cand.micro_batch_size
    return _block_matmuls(model, tokens, cand.tp, ep, dense, expert_tp)


@functools.lru_cache(maxsize=CACHED_SHAPES)
def _block_matmuls(
    model: ModelShape, tokens: int, t: int, ep: int | None, dense: bool = False, expert_tp: int = 1
) -> tuple[Matmul, ...]:  # fmt: skip
    """``block_matmuls`` for ``tokens`` tokens of this CP rank at tp ``t``, once per shape."""
    h = model.hidden_size
    kv = h // model.num_heads * model.num_kv_heads
    routed = routed_terms(model)
    per_expert = {"ep": ep, **({"expert_tp": expert_tp} if expert_tp > 1 else {})} if routed and ep is not None else {}
    if routed and dense:
        per_expert = {"dense": True}
    shapes = family_of(model).tuner.block_gemms(tokens, h, kv, model.intermediate_size, t, **routed, **per_expert)
    return tuple(gemm(name, m, k, n, count=count) for name, m, k, n, count in shapes)


def core_attention_matmuls(model: ModelShape, cand: Candidate) -> tuple[Matmul, ...]:
    """The core attention's forward (Q K^T and x V) for one micro-batch, per GPU, as the candidate's kernel runs it.
    With cp > 1 each rank's s / cp query rows meet all s keys (the ring: the K/V of every rank in turn; the a2a:
    a / cp heads of the whole sequence, the same work): the whole sequence's square counted once over the ranks,
    as at cp 1 (neither counts the causal half a kernel skips)."""
    return _core_attention_matmuls(model, cand.cp, cand.micro_batch_size, cand.tp, cand.attention)


@functools.lru_cache(maxsize=CACHED_SHAPES)
def _core_attention_matmuls(model: ModelShape, cp: int, b: int, t: int, attention: str) -> tuple[Matmul, ...]:
    s = model.seq_length
    rows = s // cp  # query rows per CP rank
    d = model.head_dim
    kv_heads = model.num_kv_heads // t  # KV heads on this rank
    g = model.num_heads // model.num_kv_heads  # query heads per KV head
    if attention == "sdpa":
        heads = model.num_heads // t
        flops = 4.0 * b * heads * rows * s * d
        moved = ACT_BYTES * b * rows * d * (2 * heads + 2 * kv_heads)  # q, o and k, v
        return (Matmul("fused attention", flops, float(moved)),)
    return (
        gemm("scores Q K^T", g * rows, d, s, count=b * kv_heads),
        gemm("probabilities x V", g * rows, s, d, count=b * kv_heads),
    )


def logits_matmul(model: ModelShape, cand: Candidate) -> Matmul:
    """The output layer's forward for one micro-batch, per GPU (the vocabulary padded as ``parallelize`` pads it)."""
    return _logits_matmul(model, cand.cp, cand.micro_batch_size, cand.tp)


@functools.lru_cache(maxsize=CACHED_SHAPES)
def _logits_matmul(model: ModelShape, cp: int, b: int, t: int) -> Matmul:
    n = b * (model.seq_length // cp)
    return gemm("logits", n, model.hidden_size, padded_vocab_size(model.vocab_size, t) // t)


def ridge_point(cluster: Cluster) -> float:
    """FLOPs per byte at which the GPU's peak compute and its HBM bandwidth take the same time."""
    return cluster.peak_flops / (cluster.memory_gbps * 1e9)


def matmul_efficiency(intensity: float, cluster: Cluster) -> float:
    """Fraction of the peak a matmul of this intensity reaches: ceiling x I / (I + ridge point)."""
    return cluster.efficiency * intensity / (intensity + ridge_point(cluster))


@functools.lru_cache(maxsize=CACHED_SHAPES)
def matmul_s(ops: tuple[Matmul, ...], cluster: Cluster) -> float:
    """Time of ``ops`` on one GPU: (FLOPs / peak + bytes / HBM bandwidth) / ceiling each."""
    return sum(op.flops / cluster.peak_flops + op.bytes / (cluster.memory_gbps * 1e9) for op in ops) / (
        cluster.efficiency
    )
