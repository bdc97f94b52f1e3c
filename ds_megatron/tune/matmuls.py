"""The matmuls one GPU runs for one block and one micro-batch, and how fast each of them runs.  Pure Python.

Speed (a smooth roofline): a matmul that does F FLOPs and moves B bytes through HBM (its two operands read once, its
result written once, bf16) has the arithmetic intensity I = F / B and takes

    time = (F / peak + B / bandwidth) / ceiling,  i.e. it runs at  efficiency(I) = ceiling x I / (I + peak / bandwidth)

of the peak: its compute and its memory traffic each at the same fraction (the ceiling) of the GPU's figure, not
overlapped.  The efficiency rises with I toward the ceiling and is half of it at the GPU's ridge point,
peak / bandwidth (A100 80GB: 312 TFLOP/s / 2,039 GB/s = 153 FLOP per byte; H100 SXM: 295), so the curve of every GPU
preset follows from its datasheet peak and bandwidth, and the ceiling (``Cluster.efficiency``, ``--efficiency``) is
the only free parameter.  For an M x K by K x N GEMM, I = M N K / (M K + K N + M N) = 1 / (1/M + 1/N + 1/K): its
smallest dimension sets it, so thin TP shards, small micro-batches and a narrow head dimension run further from the
ceiling than the large GEMMs of a large model.  Backward runs two GEMMs of the same three dimensions per forward GEMM
(input and weight gradients), so it runs at the forward's efficiency for twice the FLOPs.

The ceiling is fitted to published step times (``ds_megatron.tune.paper_runs``; the fit and how well it predicts the
rows it was not fitted on are in ``spec.DEFAULT_EFFICIENCY``).  A knee scaled away from the ridge point, fitted as a
second parameter (1.15 x peak / bandwidth), moved no prediction of those rows by more than a point, so it stays at
the ridge point.

The matmuls (FLOPs per GPU, which add up to ``ds_megatron.flops``'s per-layer counts divided by t; tokens n = b s,
the whole sequence even under SP, whose all-gather runs before the column-parallel GEMMs):
- GPT: QKV n x h x 3h/t, attention projection n x h/t x h, fc1 n x h x F/t, fc2 n x F/t x h (F = 4h).
- Llama: q n x h x h/t, k and v n x h x kv/t each (separate linears, each reading the input again), o_proj
  n x h/t x h, gate and up n x h x F/t each, down n x F/t x h.
- Core attention, eager kernel: per micro-batch and KV head on this rank, the scores Q K^T, (g s) x d x s, and the
  probabilities times V, (g s) x s x d, with g = a / k query heads per KV head (the group folded into the rows, as
  the model runs it; g = 1 for a GPT): bounded by the head dimension d, and the s x s result of the first and
  operand of the second are HBM traffic of these GEMMs.
- Core attention, sdpa (fused flash / memory-efficient kernel): the same FLOPs, but the scores stay on chip: it
  moves q, o (a/t heads) and k, v (k/t heads), s x d each, so its intensity is about s / 2.  Flash's recomputation of
  Q K^T in backward is not counted (as in ``ds_megatron.flops``).
- Logits (last stage): n x h x V_pad/t.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.tune.memory_model import ACT_BYTES, padded_vocab_size
from ds_megatron.tune.spec import Candidate, Cluster


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


def block_matmuls(model: ModelShape, cand: Candidate) -> tuple[Matmul, ...]:
    """The weight matmuls of one block's forward for one micro-batch, per GPU (the TP-split dimension divided by t)."""
    s, b, h, t = model.seq_length, cand.micro_batch_size, model.hidden_size, cand.tp
    n, f = b * s, model.intermediate_size
    if model.family == "gpt2":
        return (
            gemm("qkv", n, h, 3 * h // t),
            gemm("attention projection", n, h // t, h),
            gemm("fc1", n, h, f // t),
            gemm("fc2", n, f // t, h),
        )
    kv = h // model.num_heads * model.num_kv_heads
    return (
        gemm("q", n, h, h // t),
        gemm("k, v", n, h, kv // t, count=2),
        gemm("o_proj", n, h // t, h),
        gemm("gate, up", n, h, f // t, count=2),
        gemm("down", n, f // t, h),
    )


def core_attention_matmuls(model: ModelShape, cand: Candidate) -> tuple[Matmul, ...]:
    """The core attention's forward (Q K^T and x V) for one micro-batch, per GPU, as the candidate's kernel runs it."""
    s, b, t = model.seq_length, cand.micro_batch_size, cand.tp
    d = model.hidden_size // model.num_heads
    kv_heads = model.num_kv_heads // t  # KV heads on this rank
    g = model.num_heads // model.num_kv_heads  # query heads per KV head
    if cand.attention == "sdpa":
        heads = model.num_heads // t
        flops = 4.0 * b * heads * s * s * d
        moved = ACT_BYTES * b * s * d * (2 * heads + 2 * kv_heads)  # q, o and k, v
        return (Matmul("fused attention", flops, float(moved)),)
    return (
        gemm("scores Q K^T", g * s, d, s, count=b * kv_heads),
        gemm("probabilities x V", g * s, s, d, count=b * kv_heads),
    )


def logits_matmul(model: ModelShape, cand: Candidate) -> Matmul:
    """The output layer's forward for one micro-batch, per GPU (the vocabulary padded as ``parallelize`` pads it)."""
    n = cand.micro_batch_size * model.seq_length
    return gemm("logits", n, model.hidden_size, padded_vocab_size(model.vocab_size, cand.tp) // cand.tp)


def ridge_point(cluster: Cluster) -> float:
    """FLOPs per byte at which the GPU's peak compute and its HBM bandwidth take the same time."""
    return cluster.peak_flops / (cluster.memory_gbps * 1e9)


def matmul_efficiency(intensity: float, cluster: Cluster) -> float:
    """Fraction of the peak a matmul of this intensity reaches: ceiling x I / (I + ridge point)."""
    return cluster.efficiency * intensity / (intensity + ridge_point(cluster))


def matmul_s(ops: tuple[Matmul, ...], cluster: Cluster) -> float:
    """Time of ``ops`` on one GPU: (FLOPs / peak + bytes / HBM bandwidth) / ceiling each."""
    return sum(op.flops / cluster.peak_flops + op.bytes / (cluster.memory_gbps * 1e9) for op in ops) / (
        cluster.efficiency
    )
