"""L3: the one place that knows the parallel plan.  It turns single-device GPT modules into TP/SP ones by module swap.

The plan (Megatron; Shoeybi et al. 2019, Korthikanti et al. 2022):

    attn.c_attn  -> ColumnParallelLinear, split by heads (fused q|k|v)
    attn.c_proj  -> RowParallelLinear
    mlp.c_fc     -> ColumnParallelLinear
    mlp.c_proj   -> RowParallelLinear
    wte          -> VocabParallelEmbedding (vocabulary padded to a multiple of vocab_multiple * tp), tied output layer
    wpe          -> sequence-sharded position lookup under SP
    ln_*, biases of row-parallel layers -> replicated (SP: sequence-sharded input, gradients summed over TP)
    core attention dropout -> tensor-parallel RNG state; residual/embedding dropout -> tensor-parallel state under SP

Order inside a block: swap the linears, set the core attention's RNG state, wrap it for selective recompute, swap
the dropouts, then the LayerNorms.  Full recompute (chunks of blocks) is applied by the pipeline module's forward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup

from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE
from ds_megatron.model import GPT, GPTBlock, GPTConfig
from ds_megatron.random import TENSOR_PARALLEL, RNGTracker
from ds_megatron.recompute import RecomputedCoreAttention, RecomputePlan
from ds_megatron.tensor_parallel import (
    REPLICATED,
    ColumnParallelLinear,
    ForkedDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceShardedPositionEmbedding,
    ShardRule,
    VocabParallelEmbedding,
    padded_vocab_size,
)


@dataclass
class ParallelPlan:
    """What ``parallelize_*`` needs: the TP group and the choices that apply to every module."""

    config: GPTConfig
    tp_group: ProcessGroup | None
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    rng: RNGTracker | None
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE
    recompute: RecomputePlan = RecomputePlan()

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.config.vocab_size, self.tp_size, self.vocab_multiple)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp_size > 1

    def tp_fork(self):
        """Context-manager factory entering the tensor-parallel RNG state (a no-op without a tracker)."""
        if self.rng is None:
            return contextlib.nullcontext
        return functools.partial(self.rng.fork, TENSOR_PARALLEL)


def shard_rule(name: str, plan: ParallelPlan) -> ShardRule:
    """The shard rule of one full GPT parameter (HF GPT-2 name), used by layers, checkpoints and tests."""
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return ShardRule(dim=0, fused=3)
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return ShardRule(dim=0)
    if name.endswith("c_proj.weight"):
        return ShardRule(dim=1)
    if name.endswith("wte.weight"):
        return ShardRule(dim=0, padded_size=plan.padded_vocab_size)
    return REPLICATED


def _column(linear: nn.Linear, rule: ShardRule, plan: ParallelPlan) -> ColumnParallelLinear:
    return ColumnParallelLinear.from_dense(linear, rule, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp)


def _row(linear: nn.Linear, plan: ParallelPlan) -> RowParallelLinear:
    return RowParallelLinear.from_dense(linear, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp)


def _sp_dropout(drop: nn.Dropout, plan: ParallelPlan) -> nn.Module:
    """Dropout on sequence shards must draw different masks on each TP rank; replicated regions keep the default."""
    return ForkedDropout(drop.p, plan.tp_fork()) if plan.sp else drop


def parallelize_block(block: GPTBlock, plan: ParallelPlan) -> GPTBlock:
    """Apply the plan to one transformer block in place (full weights in, this rank's shards out)."""
    attn, mlp = block.attn, block.mlp
    attn.c_attn = _column(attn.c_attn, ShardRule(dim=0, fused=3), plan)
    attn.c_proj = _row(attn.c_proj, plan)
    mlp.c_fc = _column(mlp.c_fc, ShardRule(dim=0), plan)
    mlp.c_proj = _row(mlp.c_proj, plan)
    if plan.tp_size > 1:
        attn.core_attention.rng_fork = plan.tp_fork()
    if plan.recompute.policy == "selective":
        attn.core_attention = RecomputedCoreAttention(attn.core_attention, plan.rng)
    attn.resid_dropout = _sp_dropout(attn.resid_dropout, plan)
    mlp.dropout = _sp_dropout(mlp.dropout, plan)
    block.ln_1 = parallelize_norm(block.ln_1, plan)
    block.ln_2 = parallelize_norm(block.ln_2, plan)
    return block


def parallelize_word_embedding(wte: nn.Embedding, plan: ParallelPlan) -> VocabParallelEmbedding:
    return VocabParallelEmbedding.from_dense(
        wte, plan.padded_vocab_size, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp
    )


def parallelize_position_embedding(wpe: nn.Embedding, plan: ParallelPlan) -> nn.Module:
    if not plan.sp:
        return wpe
    return SequenceShardedPositionEmbedding(wpe.weight.data, plan.tp_group, plan.tp_rank, plan.tp_size)


def parallelize_norm(ln: nn.LayerNorm, plan: ParallelPlan) -> nn.LayerNorm:
    """Under SP a LayerNorm sees a sequence shard: its gradients are summed over TP."""
    return SequenceParallelLayerNorm(ln, plan.tp_group) if plan.sp else ln


def parallelize_gpt(model: GPT, plan: ParallelPlan) -> GPT:
    """Apply the plan to a whole single-device GPT in place.  Its forward then returns this rank's vocabulary block
    of logits ([b, s, V_pad/t]; use vocab-parallel cross entropy).  Under SP the plain forward stays correct because
    the embedding reduce-scatters along the sequence and the position lookup keeps this rank's rows."""
    t = model.transformer
    t.wte = parallelize_word_embedding(t.wte, plan)
    t.wpe = parallelize_position_embedding(t.wpe, plan)
    t.drop = _sp_dropout(t.drop, plan)
    for block in t.h:
        parallelize_block(block, plan)
    t.ln_f = parallelize_norm(t.ln_f, plan)
    return model
