"""L3: the one place that knows the parallel plan.  It turns single-device GPT modules into TP/SP ones by module swap.

The plan (Megatron; Shoeybi et al. 2019, Korthikanti et al. 2022) is data, ``GPT2_PLAN`` below: one row per module,
its parallel style and the shard rule of its weight.  The module swap (``parallelize_block`` / ``parallelize_gpt``),
the shard rules of checkpoints (``shard_rule``: export, resharding, HF import) and the tests read that table; a new
model family adds a table.  What the table does not hold is behaviour, not layout: the core attention's RNG state
(tensor-parallel once heads are split), selective recompute around it, and dropout on sequence shards under SP
drawing a different mask on each TP rank.

Order inside a block: swap the modules of the plan, set the core attention's RNG state, wrap it for selective
recompute, swap the dropouts.  Full recompute (chunks of blocks) is applied by the pipeline module's forward.
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

COLUMN, ROW, VOCAB, POSITION, NORM = "column", "row", "vocab", "position", "norm"


@dataclass(frozen=True)
class PlanRow:
    """One module of a model family's plan.  ``path``: the module inside a block (``attn.c_attn``) or the model
    (``transformer.wte``).  ``style``:
      column   ColumnParallelLinear: weight and bias split on the output dim (``fused`` blocks, e.g. q|k|v, by heads)
      row      RowParallelLinear: weight split on the input dim, bias replicated (summed over TP under SP)
      vocab    VocabParallelEmbedding: rows split in vocabulary blocks, padded to vocab_multiple x tp; tied output
      position learned position table, replicated; each rank looks up its own sequence chunk under SP
      norm     LayerNorm, replicated; sees a sequence shard under SP (gradients summed over TP)"""

    path: str
    style: str
    fused: int = 1


GPT2_PLAN: tuple[PlanRow, ...] = (
    PlanRow("attn.c_attn", COLUMN, fused=3),
    PlanRow("attn.c_proj", ROW),
    PlanRow("mlp.c_fc", COLUMN),
    PlanRow("mlp.c_proj", ROW),
    PlanRow("ln_1", NORM),
    PlanRow("ln_2", NORM),
    PlanRow("transformer.wte", VOCAB),
    PlanRow("transformer.wpe", POSITION),
    PlanRow("transformer.ln_f", NORM),
)
_BLOCK_ROWS = tuple(r for r in GPT2_PLAN if not r.path.startswith("transformer."))
_BY_PATH = {r.path: r for r in GPT2_PLAN}


def plan_row(name: str) -> PlanRow | None:
    """The plan row of a full GPT parameter name (``transformer.h.3.attn.c_attn.weight`` -> ``attn.c_attn``)."""
    module = name.rsplit(".", 1)[0]
    if module.startswith("transformer.h."):
        module = module.split(".", 3)[3]
    return _BY_PATH.get(module)


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
    """The shard rule of one full GPT parameter (HF GPT-2 name), read off the plan table; used by the layers'
    construction, checkpoints (export, resharding, HF import) and tests."""
    row = plan_row(name)
    if row is None:
        return REPLICATED
    if row.style == COLUMN:
        return ShardRule(dim=0, fused=row.fused)
    if row.style == ROW and name.endswith(".weight"):
        return ShardRule(dim=1)
    if row.style == VOCAB:
        return ShardRule(dim=0, padded_size=plan.padded_vocab_size)
    return REPLICATED


def _column(linear: nn.Linear, rule: ShardRule, plan: ParallelPlan) -> ColumnParallelLinear:
    return ColumnParallelLinear.from_dense(linear, rule, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp)


def _row(linear: nn.Linear, plan: ParallelPlan) -> RowParallelLinear:
    return RowParallelLinear.from_dense(linear, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp)


def _sp_dropout(drop: nn.Dropout, plan: ParallelPlan) -> nn.Module:
    """Dropout on sequence shards must draw different masks on each TP rank; replicated regions keep the default."""
    return ForkedDropout(drop.p, plan.tp_fork()) if plan.sp else drop


def _swap(root: nn.Module, path: str, build) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, build(getattr(parent, attr)))


def _builder(row: PlanRow, plan: ParallelPlan):
    """The module swap of one plan row: full single-device module in, this rank's parallel module out."""
    if row.style == COLUMN:
        return lambda m: _column(m, ShardRule(dim=0, fused=row.fused), plan)
    if row.style == ROW:
        return lambda m: _row(m, plan)
    if row.style == VOCAB:
        return lambda m: parallelize_word_embedding(m, plan)
    if row.style == POSITION:
        return lambda m: parallelize_position_embedding(m, plan)
    return lambda m: parallelize_norm(m, plan)


def parallelize_module(path: str, module: nn.Module, plan: ParallelPlan) -> nn.Module:
    """The parallel form of the model-level module at ``path`` of the plan (``transformer.wte``, ``.wpe``, ...)."""
    return _builder(_BY_PATH[path], plan)(module)


def parallelize_block(block: GPTBlock, plan: ParallelPlan) -> GPTBlock:
    """Apply the plan to one transformer block in place (full weights in, this rank's shards out)."""
    for row in _BLOCK_ROWS:
        _swap(block, row.path, _builder(row, plan))
    attn, mlp = block.attn, block.mlp
    if plan.tp_size > 1:
        attn.core_attention.rng_fork = plan.tp_fork()
    if plan.recompute.policy == "selective":
        attn.core_attention = RecomputedCoreAttention(attn.core_attention, plan.rng)
    attn.resid_dropout = _sp_dropout(attn.resid_dropout, plan)
    mlp.dropout = _sp_dropout(mlp.dropout, plan)
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
    for row in GPT2_PLAN:
        if row.path.startswith("transformer."):
            _swap(model, row.path, _builder(row, plan))
    model.transformer.drop = _sp_dropout(model.transformer.drop, plan)
    for block in model.transformer.h:
        parallelize_block(block, plan)
    return model
