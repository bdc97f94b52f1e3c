"""L3: the one place that knows the parallel plan.  It turns single-device GPT modules into TP/SP ones by module swap.

The plan (Megatron; Shoeybi et al. 2019, Korthikanti et al. 2022) is data: one table per model family
(``GPT2_PLAN``, ``LLAMA_PLAN`` below), one row per module, its parallel style and the shard rule of its weight, plus
where the family keeps its blocks, attention and sequence-region dropouts (``FamilyPlan``).  The module swap
(``parallelize_block`` / ``parallelize_model``), the shard rules of checkpoints (``shard_rule``: export, resharding,
HF import) and the tests read those tables.  What a table does not hold is behaviour, not layout: the core
attention's RNG state (tensor-parallel once heads are split), selective recompute around it, and dropout on sequence
shards under SP drawing a different mask on each TP rank.

Order inside a block: swap the modules of the plan, set the core attention's RNG state, apply selective recompute
(the core attention wrapped; norm and activation outputs recomputed instead of stored), swap the dropouts.  Full
recompute (chunks of blocks) is applied by the pipeline module's forward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE
from ds_megatron.model import ModelConfig
from ds_megatron.model.llama import RMSNorm, rms_norm
from ds_megatron.random import TENSOR_PARALLEL, RNGTracker
from ds_megatron.recompute import RecomputedCoreAttention, RecomputePlan, discard_output
from ds_megatron.tensor_parallel import (
    REPLICATED,
    ColumnParallelLinear,
    ForkedDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceShardedPositionEmbedding,
    ShardRule,
    VocabParallelEmbedding,
    VocabParallelOutput,
    grouped_column_linear,
    mark_sp_replicated,
    padded_vocab_size,
    sync_grads,
)

COLUMN, ROW, VOCAB, OUTPUT, POSITION, NORM = "column", "row", "vocab", "output", "position", "norm"


@dataclass(frozen=True)
class PlanRow:
    """One module of a model family's plan.  ``path``: the module inside a block (``attn.c_attn``) or the model
    (``transformer.wte``).  ``style``:
      column   ColumnParallelLinear: weight and bias split on the output dim (``fused`` blocks, e.g. q|k|v, by heads)
      row      RowParallelLinear: weight split on the input dim, bias replicated (summed over TP under SP)
      vocab    VocabParallelEmbedding: rows split in vocabulary blocks, padded to vocab_multiple x tp; tied output
      output   VocabParallelOutput: an untied output layer, split and padded like the embedding
      position learned position table, replicated; each rank looks up its own sequence chunk under SP
      norm     LayerNorm or RMSNorm, replicated; sees a sequence shard under SP (gradients summed over TP)
    ``group``: column rows of one module with the same group share their input's collective (one all-gather under
    SP for q, k and v; one for gate and up)."""

    path: str
    style: str
    fused: int = 1
    group: str | None = None


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
# Llama (Touvron et al. 2023; Llama 3): q, k and v column-parallel by heads (KV heads split over TP like query
# heads), o_proj row-parallel, gate and up column-parallel, down row-parallel; vocabulary-parallel embedding and
# output layer (tied or not).  No biases anywhere.
LLAMA_PLAN: tuple[PlanRow, ...] = (
    PlanRow("self_attn.q_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.k_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.v_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.o_proj", ROW),
    PlanRow("mlp.gate_proj", COLUMN, group="gate_up"),
    PlanRow("mlp.up_proj", COLUMN, group="gate_up"),
    PlanRow("mlp.down_proj", ROW),
    PlanRow("input_layernorm", NORM),
    PlanRow("post_attention_layernorm", NORM),
    PlanRow("model.embed_tokens", VOCAB),
    PlanRow("model.norm", NORM),
    PlanRow("lm_head", OUTPUT),
)


@dataclass(frozen=True)
class FamilyPlan:
    """A family's plan table and where its modules live.  ``block_prefix``: full names of block i start with
    ``block_prefix + "i."``; ``model_rows``: rows outside the blocks (paths from the model root); ``attention``:
    the block's attention module (holding ``core_attention``); ``sp_dropouts``: dropouts inside a block and
    ``model_sp_dropouts`` outside it that act on the sequence-sharded residual stream under SP."""

    rows: tuple[PlanRow, ...]
    block_prefix: str
    attention: str
    sp_dropouts: tuple[str, ...] = ()
    model_sp_dropouts: tuple[str, ...] = ()

    @property
    def block_rows(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if not self.is_model_row(r))

    @property
    def model_rows(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.rows if self.is_model_row(r))

    def is_model_row(self, row: PlanRow) -> bool:
        root = self.block_prefix.split(".")[0] + "."
        return row.path.startswith(root) or row.style in (OUTPUT, VOCAB)

    def row(self, name: str) -> PlanRow | None:
        """The row of a full parameter name (``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj``)."""
        module = name.rsplit(".", 1)[0]
        if module.startswith(self.block_prefix):
            module = module[len(self.block_prefix) :].split(".", 1)[-1]
        return next((r for r in self.rows if r.path == module), None)


PLANS: dict[str, FamilyPlan] = {
    "gpt2": FamilyPlan(
        GPT2_PLAN,
        "transformer.h.",
        attention="attn",
        sp_dropouts=("attn.resid_dropout", "mlp.dropout"),
        model_sp_dropouts=("transformer.drop",),
    ),
    "llama": FamilyPlan(LLAMA_PLAN, "model.layers.", attention="self_attn"),
}


def plan_row(name: str, family: str = "gpt2") -> PlanRow | None:
    """The plan row of a full parameter name of ``family`` (``transformer.h.3.attn.c_attn.weight`` ->
    ``attn.c_attn``)."""
    return PLANS[family].row(name)


@dataclass
class ParallelPlan:
    """What ``parallelize_*`` needs: the TP group and the choices that apply to every module."""

    config: ModelConfig
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
    def family(self) -> FamilyPlan:
        return PLANS[self.config.family]

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp_size > 1

    def tp_fork(self):
        """Context-manager factory entering the tensor-parallel RNG state (a no-op without a tracker)."""
        if self.rng is None:
            return contextlib.nullcontext
        return functools.partial(self.rng.fork, TENSOR_PARALLEL)


def shard_rule(name: str, plan: ParallelPlan) -> ShardRule:
    """The shard rule of one full parameter (its Hugging Face name), read off the family's plan table; used by the
    layers' construction, checkpoints (export, resharding, HF import) and tests."""
    row = plan.family.row(name)
    if row is None:
        return REPLICATED
    if row.style == COLUMN:
        return ShardRule(dim=0, fused=row.fused)
    if row.style == ROW and name.endswith(".weight"):
        return ShardRule(dim=1)
    if row.style in (VOCAB, OUTPUT):
        return ShardRule(dim=0, padded_size=plan.padded_vocab_size, unpadded_size=plan.config.vocab_size)
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
    if row.style == OUTPUT:
        return lambda m: VocabParallelOutput.from_dense(
            m, plan.padded_vocab_size, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp
        )
    if row.style == POSITION:
        return lambda m: parallelize_position_embedding(m, plan)
    return lambda m: parallelize_norm(m, plan)


def parallelize_module(path: str, module: nn.Module, plan: ParallelPlan) -> nn.Module:
    """The parallel form of the model-level module at ``path`` of the plan (``transformer.wte``, ``lm_head``...)."""
    row = next(r for r in plan.family.model_rows if r.path == path)
    return _builder(row, plan)(module)


def _grouped_projection(plan: ParallelPlan):
    """A ``project(x, linears)`` for modules whose column rows share a group: one input collective for all."""

    def project(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        return grouped_column_linear(x, tuple(m.weight for m in linears), plan.tp_group, plan.sp)

    return project


def parallelize_block(block: nn.Module, plan: ParallelPlan) -> nn.Module:
    """Apply the family's plan to one transformer block in place (full weights in, this rank's shards out)."""
    family = plan.family
    for row in family.block_rows:
        _swap(block, row.path, _builder(row, plan))
    if plan.tp_size > 1:
        for parent in {r.path.rpartition(".")[0] for r in family.block_rows if r.group}:
            block.get_submodule(parent).project = _grouped_projection(plan)
    attn = block.get_submodule(family.attention)
    if plan.tp_size > 1:
        attn.core_attention.rng_fork = plan.tp_fork()
    modules = plan.recompute.selective_modules
    if "core_attn" in modules:
        attn.core_attention = RecomputedCoreAttention(attn.core_attention, plan.rng)
    if "layernorm" in modules:
        block.around_norm = discard_output
    if "mlp_act" in modules:
        block.mlp.around_act = discard_output
    for path in family.sp_dropouts:
        _swap(block, path, lambda drop: _sp_dropout(drop, plan))
    return block


def parallelize_word_embedding(wte: nn.Embedding, plan: ParallelPlan) -> VocabParallelEmbedding:
    return VocabParallelEmbedding.from_dense(
        wte, plan.padded_vocab_size, plan.tp_group, plan.tp_rank, plan.tp_size, plan.sp
    )


def parallelize_position_embedding(wpe: nn.Embedding, plan: ParallelPlan) -> nn.Module:
    if not plan.sp:
        return wpe
    return SequenceShardedPositionEmbedding(wpe.weight.data, plan.tp_group, plan.tp_rank, plan.tp_size)


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard [s/t, b, h]; its weight gradient is summed over the TP group."""

    def __init__(self, norm: RMSNorm, tp_group: ProcessGroup | None):
        super().__init__(norm.weight.shape[0], norm.eps)
        with torch.no_grad():
            self.weight.data = norm.weight.data.clone()
        mark_sp_replicated(self.weight)
        self.tp_group = tp_group
        # True: the gradient is summed over the TP group in autograd, per micro-batch (correct on its own).  The
        # engine sets False when it sums every SP-replicated gradient once per optimizer step instead
        # (``tensor_parallel.sum_sp_replicated_grads``).
        self.sync_grads_in_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sync_grads(self.tp_group, self.weight)[0] if self.sync_grads_in_backward else self.weight
        return rms_norm(x, weight, self.eps)


def parallelize_norm(norm: nn.Module, plan: ParallelPlan) -> nn.Module:
    """Under SP a norm sees a sequence shard: its gradients are summed over TP."""
    if not plan.sp:
        return norm
    if isinstance(norm, RMSNorm):
        return SequenceParallelRMSNorm(norm, plan.tp_group)
    return SequenceParallelLayerNorm(norm, plan.tp_group)


def parallelize_model(model: nn.Module, plan: ParallelPlan) -> nn.Module:
    """Apply the family's plan to a whole single-device model in place.  Its forward then returns this rank's
    vocabulary block of logits ([b, s, V_pad/t]; use vocab-parallel cross entropy).  Under SP the plain forward stays
    correct because the embedding reduce-scatters along the sequence (and GPT-2's position lookup keeps this rank's
    rows)."""
    family = plan.family
    for row in family.model_rows:
        if row.style == OUTPUT and not hasattr(model, row.path):
            continue  # tied: the embedding is the output layer
        _swap(model, row.path, _builder(row, plan))
    for path in family.model_sp_dropouts:
        _swap(model, path, lambda drop: _sp_dropout(drop, plan))
    for block in model.get_submodule(family.block_prefix.rstrip(".")):
        parallelize_block(block, plan)
    return model


parallelize_gpt = parallelize_model  # the GPT-2 family's name for it
