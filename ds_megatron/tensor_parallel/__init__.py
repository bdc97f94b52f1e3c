"""L2: Megatron tensor/sequence-parallel collectives, layers, shard rules and vocab-parallel cross entropy.

Process groups are always passed in; nothing here keeps global state.
"""

from ds_megatron.config.schema import padded_vocab_size
from ds_megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ds_megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    ForkedDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    SequenceShardedPositionEmbedding,
    SPReplicatedGrads,
    VocabParallelEmbedding,
    VocabParallelOutput,
    column_linear,
    defer_sp_grad_sync,
    grouped_column_linear,
    is_tp_sharded,
    mark_sp_replicated,
    mark_tp_sharded,
)
from ds_megatron.tensor_parallel.mappings import (
    copy_to_tp,
    gather_last_dim,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_seq,
    sum_sp_replicated_grads,
    sync_grads,
)
from ds_megatron.tensor_parallel.sharding import REPLICATED, ShardRule, shard, unshard

__all__ = [
    "REPLICATED",
    "ColumnParallelLinear",
    "ForkedDropout",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "SequenceShardedPositionEmbedding",
    "SPReplicatedGrads",
    "column_linear",
    "ShardRule",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "grouped_column_linear",
    "copy_to_tp",
    "defer_sp_grad_sync",
    "gather_last_dim",
    "gather_seq",
    "is_tp_sharded",
    "mark_sp_replicated",
    "mark_tp_sharded",
    "padded_vocab_size",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "scatter_seq",
    "shard",
    "sum_sp_replicated_grads",
    "sync_grads",
    "unshard",
    "vocab_parallel_cross_entropy",
]
