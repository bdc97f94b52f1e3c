"""Per-GPU memory of a candidate on the first and the last pipeline stage: model states of DeepSpeed's BF16 optimizer,
parameters per family, activations under 1F1B (Korthikanti et al. 2022, sec. 4), and a margin.  The formulas and
their derivation are in docs/tuner.md, "Memory model".  Pure Python."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from ds_megatron.config import ModelShape
from ds_megatron.config.ep_rules import token_ranks
from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE, padded_vocab_size, pipeline_schedule
from ds_megatron.config.shape import layers_per_stage
from ds_megatron.memory import (
    activation_bytes_per_layer,
    cp_transient_bytes,
    deferred_weight_grad_bytes_per_layer,
    rotary_table_bytes,
)
from ds_megatron.model import family_of, model_config
from ds_megatron.model.family import RoutedShape
from ds_megatron.pipeline_parallel.schedules import ActivationTerms
from ds_megatron.tune.core.spec import Candidate

GIB = 2**30
WEIGHT_BYTES = 2  # bf16 weights
GRAD_BYTES = 2 + 4  # bf16 gradients + the fp32 accumulation buffer ("grad_accum_dtype": "fp32")
OPTIMIZER_BYTES = 4 + 8  # fp32 master weights + Adam m and v; ZeRO-1 divides these by dp
ACT_BYTES = 2  # bf16 activations (the paper's 2-byte activations)
MASK_BYTES = 1  # the GPU dropout kernel's 1-byte masks
LOGITS_BYTES = 2 + 4  # bf16 logits and the fp32 copy the cross entropy computes on
# Workspace and fragmentation the analytic terms do not see (cuBLAS/NCCL workspaces, the CUDA context, gradient
# buckets, allocator fragmentation): 10% of the predicted bytes plus a fixed 2 GiB.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 2 * GIB


def attention_dropout(model: ModelShape) -> float | None:
    """The activation formula's attention dropout: None for a GPT (every dropout counted, as in the paper's table),
    the model's dropout for a Llama (its only one)."""
    return model.dropout if family_of(model).tuner.attention_dropout_only else None


def has_attention_dropout(model: ModelShape) -> bool:
    p = attention_dropout(model)
    return p is None or p > 0


@functools.lru_cache(maxsize=64)
def routed_shape(model: ModelShape) -> RoutedShape | None:
    """``RoutedShape.of(model)``, once per model (a search asks for it hundreds of thousands of times)."""
    return RoutedShape.of(model)


def routed_terms(model: ModelShape) -> dict:
    """The ``routed`` keyword a routed family's terms take (head width, experts); empty for a dense model."""
    routed = routed_shape(model)
    return {} if routed is None else {"routed": routed}


def block_param_count(model: ModelShape, tp: int = 1, ep: int = 1, expert_tp: int = 1) -> int:
    """Parameters of one block per TP rank: a GPT's (12 h^2 + 7 h) / t + 6 h, a Llama's
    (2 h^2 + 2 h kv + 3 h F) / t + 2 h (the replicated part: row-parallel biases and norms), a routed block's
    (2 h a d + 2 h k d + 3 E h F) / t + E h + 2 h (+ 2 d for Qwen3's q/k norms): every expert stored; at ep > 1
    its E / ep whole experts, 3 E h F / ep in place of 3 E h F / t, or split over TP too (``expert_tp`` = t),
    3 E h F / (ep t)."""
    h = model.hidden_size
    kv_size = h // model.num_heads * model.num_kv_heads  # type: ignore[operator]
    params = family_of(model).tuner.block_params
    split = {"ep": ep, "expert_tp": expert_tp} if ep > 1 else {}  # a dense family has no ep (the search gives none)
    return params(h, kv_size, model.intermediate_size, tp, **routed_terms(model), **split)  # type: ignore[arg-type]


def dense_block_param_count(model: ModelShape, tp: int = 1) -> int:
    """Parameters of one dense block of a routed family per TP rank (a layer of ``mlp_only_layers`` or off
    ``decoder_sparse_step``: the routed block's attention and a SwiGLU of the dense width, 3 h F / t); a dense
    family's block (``block_param_count``)."""
    if routed_shape(model) is None:
        return block_param_count(model, tp)
    h = model.hidden_size
    kv_size = h // model.num_heads * model.num_kv_heads  # type: ignore[operator]
    params = family_of(model).tuner.block_params
    return params(h, kv_size, model.intermediate_size, tp, **routed_terms(model), dense=True)  # type: ignore[arg-type]


def blocks_param_count(model: ModelShape, tp: int, ep: int, blocks: int, dense: int, expert_tp: int = 1) -> int:
    """Parameters of ``blocks`` blocks per TP rank, ``dense`` of them a routed family's dense ones."""
    block = block_param_count(model, tp, ep, expert_tp)
    return blocks * block + (dense * (dense_block_param_count(model, tp) - block) if dense else 0)


@functools.lru_cache(maxsize=64)
def dense_layers(model: ModelShape) -> frozenset[int]:
    """The layers of a routed family with a dense SwiGLU instead of experts (the family config's rule,
    ``is_sparse``: ``mlp_only_layers`` and ``decoder_sparse_step``); none for a dense family."""
    if routed_shape(model) is None:
        return frozenset()
    config = model_config(model)
    return frozenset(i for i in range(model.num_layers) if not config.is_sparse(i))


def dense_in(model: ModelShape, stages: tuple[tuple[int, int], ...]) -> int:
    """Dense layers (``dense_layers``) among the layers [start, stop) of ``stages``."""
    dense = dense_layers(model)
    return sum(1 for start, stop in stages for i in range(start, stop) if i in dense) if dense else 0


def rank_dense_blocks(model: ModelShape, cand: Candidate) -> tuple[int, int]:
    """(first, last) pipeline rank's dense blocks (``dense_layers``) under the candidate's schedule and layout: the
    layers of the stages each rank builds (``Schedule.stages_of``), stage s holding [s c, (s + 1) c) of the L
    layers at c = ceil(L / (v p)), or an uneven layout's own; (0, 0) for a model whose layers are all routed or all
    dense."""
    if not dense_layers(model):
        return 0, 0
    return tuple(sum(chunks) for chunks in _rank_stage_dense(model, cand))  # type: ignore[return-value]


def _rank_stage_dense(model: ModelShape, cand: Candidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dense blocks of each stage the first and the last pipeline rank hold (``rank_dense_blocks``)."""
    schedule = pipeline_schedule(cand.schedule)
    per_rank, num_layers = schedule.per_rank(cand), model.num_layers
    if cand.pipeline_layout is not None:
        starts = [sum(cand.pipeline_layout[:s]) for s in range(len(cand.pipeline_layout) + 1)]
        bounds = [(starts[s], starts[s + 1]) for s in range(len(cand.pipeline_layout))]
    else:
        chunk = layers_per_stage(num_layers, per_rank * cand.pp)
        bounds = [(min(s * chunk, num_layers), min((s + 1) * chunk, num_layers)) for s in range(per_rank * cand.pp)]
    first, last = (
        tuple(dense_in(model, (bounds[stage],)) for stage in schedule.stages_of(rank, cand.pp, per_rank))
        for rank in (0, cand.pp - 1)
    )
    return first, last


def block_expert_param_count(model: ModelShape, cand: Candidate) -> int:
    """One block's expert parameters on a rank at ep > 1 (3 E h F / ep, or 3 E h F / (ep t) split over TP, held in
    optimizer groups of their own, partitioned over the expert-DP group); 0 at ep 1, where they are the block's
    other parameters' kin (split over TP, partitioned over dp x cp like them) or for a dense model."""
    routed = routed_shape(model)
    if cand.ep_size == 1 or routed is None:
        return 0
    return routed.expert_params(model.hidden_size) // (cand.ep_size * expert_split(cand))


def expert_split(cand: Candidate) -> int:
    """What the parameter, GEMM and activation terms take as ``expert_tp`` at ep > 1: t where each expert is split
    over TP, 1 for whole experts (at ep 1 every expert is split over TP whatever this says)."""
    return cand.expert_tp_size if cand.experts_split_at_ep else 1


def stage_param_counts(
    model: ModelShape, tp: int, pp: int, vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE, ep: int = 1, expert_tp: int = 1
) -> tuple[int, int]:
    """(first stage, last stage) parameters per TP rank: the embedding (and a GPT's position table) and ceil(L/p)
    blocks; the blocks, the final norm and the output layer (a tied copy or an untied ``lm_head``).  With p = 1 both
    are the whole model, a tied embedding counted once.  A routed family's dense blocks (``dense_layers``) are
    counted as dense among the layers each stage holds: [0, ceil(L/p)) and [(p - 1) ceil(L/p), L)."""
    h = model.hidden_size
    family = family_of(model)
    embedding = padded_vocab_size(model.vocab_size, tp, vocab_multiple) * h // tp
    positions = model.seq_length * h if family.layout.positions else 0
    final_norm = family.tuner.norm_params * h
    block = block_param_count(model, tp, ep, expert_tp)
    dense = dense_layers(model)
    if pp == 1:
        output = 0 if model.tie_word_embeddings else embedding
        blocks = model.num_layers * block
        if dense:
            blocks = blocks_param_count(model, tp, ep, model.num_layers, len(dense), expert_tp)
        total = embedding + positions + blocks + final_norm + output
        return total, total
    n = layers_per_stage(model.num_layers, pp)
    first = last = n * block
    if dense:
        first, last = (blocks_param_count(model, tp, ep, n, d, expert_tp) for d in _even_dense(model, pp))
    return embedding + positions + first, last + final_norm + embedding


def rank_param_counts(model: ModelShape, cand: Candidate) -> tuple[int, int]:
    """(first, last) pipeline rank's parameters per TP rank under the candidate's schedule (and ep).  DualPipeV:
    rank 0 holds chunks 0 and 2p-1 (the embedding, the final norm and the output layer, a tied one sharing the
    embedding's module), the last rank two chunks of the middle, each chunk ceil(L/(2p)) blocks: the same total as
    1F1B.  A routed family's dense blocks counted as dense where each rank holds them (``rank_dense_blocks``)."""
    ep, tp, etp = cand.ep_size, cand.tp, expert_split(cand)
    if not dense_layers(model):  # every block alike
        block = block_param_count(model, tp, ep, etp)
        if not pipeline_schedule(cand.schedule).loss_on_first_rank:
            first, last = stage_param_counts(model, tp, cand.pp, ep=ep, expert_tp=etp)
            if cand.pipeline_layout is not None:  # the first and last stages' own block counts
                even = layers_per_stage(model.num_layers, cand.pp)
                first += (cand.pipeline_layout[0] - even) * block
                last += (cand.pipeline_layout[-1] - even) * block
            return first, last
        whole = stage_param_counts(model, tp, 1, ep=ep, expert_tp=etp)[0]
        blocks = 2 * layers_per_stage(model.num_layers, 2 * cand.pp) * block
        return whole - model.num_layers * block + blocks, blocks
    first_blocks, last_blocks = rank_block_counts(model, cand)
    first_dense, last_dense = rank_dense_blocks(model, cand)
    if not pipeline_schedule(cand.schedule).loss_on_first_rank:
        first, last = stage_param_counts(model, tp, cand.pp, ep=ep, expert_tp=etp)
        if cand.pp == 1:
            return first, last
        even = layers_per_stage(model.num_layers, cand.pp)  # stage_param_counts' blocks, replaced by the rank's own
        even_first, even_last = (blocks_param_count(model, tp, ep, even, d, etp) for d in _even_dense(model, cand.pp))
        first += blocks_param_count(model, tp, ep, first_blocks, first_dense, etp) - even_first
        last += blocks_param_count(model, tp, ep, last_blocks, last_dense, etp) - even_last
        return first, last
    whole = stage_param_counts(model, tp, 1, ep=ep, expert_tp=etp)[0]
    all_blocks = blocks_param_count(model, tp, ep, model.num_layers, len(dense_layers(model)), etp)
    blocks = blocks_param_count(model, tp, ep, first_blocks, first_dense, etp)
    return whole - all_blocks + blocks, blocks_param_count(model, tp, ep, last_blocks, last_dense, etp)


def _even_dense(model: ModelShape, pp: int) -> tuple[int, int]:
    """``stage_param_counts``' dense blocks of its first and last stage (pp > 1)."""
    if not dense_layers(model):
        return 0, 0
    n, num_layers = layers_per_stage(model.num_layers, pp), model.num_layers
    return dense_in(model, ((0, n),)), dense_in(model, ((min((pp - 1) * n, num_layers), num_layers),))


def rank_block_counts(model: ModelShape, cand: Candidate) -> tuple[int, int]:
    """(first, last) pipeline rank's blocks under the candidate's schedule and layout (``rank_param_counts``'
    blocks)."""
    if pipeline_schedule(cand.schedule).loss_on_first_rank:
        blocks = 2 * layers_per_stage(model.num_layers, 2 * cand.pp)
        return blocks, blocks
    if cand.pp == 1:
        return model.num_layers, model.num_layers
    if cand.pipeline_layout is not None:
        return cand.pipeline_layout[0], cand.pipeline_layout[-1]
    even = layers_per_stage(model.num_layers, cand.pp)
    return even, even


def chunk_dense_blocks(model: ModelShape, cand: Candidate) -> tuple[int, int]:
    """(first, last) pipeline rank's dense blocks per chunk (stage) it holds: the fewest of its chunks (the whole
    rank's under one stage per rank)."""
    dense = rank_dense_blocks(model, cand)
    per_rank = pipeline_schedule(cand.schedule).per_rank(cand)
    if per_rank == 1 or dense == (0, 0):
        return dense
    return tuple(min(chunk) for chunk in _rank_stage_dense(model, cand))  # type: ignore[return-value]


def rank_routed_blocks(model: ModelShape, cand: Candidate) -> tuple[int, int]:
    """(first, last) pipeline rank's routed blocks: its blocks (``rank_block_counts``) less its dense ones."""
    if not dense_layers(model):
        return rank_block_counts(model, cand)
    return tuple(b - d for b, d in zip(rank_block_counts(model, cand), rank_dense_blocks(model, cand)))  # type: ignore[return-value]


def total_param_count(model: ModelShape, vocab_multiple: int = 1) -> int:
    """All parameters of the single-device model (``vocab_multiple=1``: the unpadded vocabulary)."""
    return stage_param_counts(model, 1, 1, vocab_multiple)[0]


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes on one GPU of a pipeline stage."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    activation_bytes_per_layer: float  # one block, one micro-batch, under the candidate's policy (full: its input)

    @property
    def predicted_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def required_bytes(self) -> float:
        """Predicted bytes plus the stated margin: what must fit on the device."""
        return self.predicted_bytes * (1.0 + MARGIN_FRACTION) + MARGIN_BYTES

    def as_dict(self) -> dict:
        return {**asdict(self), "predicted_bytes": self.predicted_bytes, "required_bytes": self.required_bytes}


def layer_activation_bytes(
    model: ModelShape, cand: Candidate, recompute: str, act_bytes: int = ACT_BYTES, mask_bytes: int = MASK_BYTES,
    dense: bool = False,
) -> float:  # fmt: skip
    """One block's activations for one micro-batch per TP rank under ``recompute``, with the candidate's kernel and
    (selective) modules; ``dense``: a routed family's dense block."""
    modules = cand.recompute_modules if recompute == "selective" else ()
    layout = (cand.micro_batch_size, cand.tp, cand.sequence_parallel, cand.attention, modules, cand.cp, cand.cp_comm,
              cand.ep_size, expert_split(cand))  # fmt: skip
    return _layer_activation_bytes(model, layout, recompute, act_bytes, mask_bytes, dense)


@functools.lru_cache(maxsize=4096)  # a search asks for each (b, tp, SP, kernel, cp, ep, expert_tp) a few times
def _layer_activation_bytes(
    model: ModelShape, layout: tuple, recompute: str, act_bytes: int, mask_bytes: int, dense: bool = False
) -> float:
    b, tp, sp, attention, modules, cp, cp_comm, ep, expert_tp = layout
    return activation_bytes_per_layer(
        model.seq_length,
        b,
        model.hidden_size,
        model.num_heads,
        tp,
        sp,
        recompute,
        act_bytes,
        mask_bytes,
        attention=attention,
        family=model.family,
        num_kv_heads=model.num_kv_heads,
        intermediate_size=model.intermediate_size,
        attention_dropout=attention_dropout(model),
        modules=modules,
        cp=cp,
        cp_comm=cp_comm,
        **routed_terms(model),
        **({"ep": ep} if ep > 1 else {}),
        **({"expert_tp": expert_tp} if expert_tp > 1 else {}),
        **({"dense_layer": True} if dense else {}),
    )


def stored_activation_bytes(model: ModelShape, cand: Candidate, num_blocks: int, dense: int = 0) -> float:
    """What ``num_blocks`` blocks keep for one micro-batch until its backward, ``dense`` of them a routed family's
    dense ones.  Full recompute: ``uniform`` keeps one input per chunk of k blocks, ``block`` the inputs of the
    first k blocks and everything of the other n - k (counted routed: an upper bound)."""
    if cand.recompute != "full":
        stored = num_blocks * layer_activation_bytes(model, cand, cand.recompute)
        if dense:
            stored += dense * (
                layer_activation_bytes(model, cand, cand.recompute, dense=True)
                - layer_activation_bytes(model, cand, cand.recompute)
            )
        return stored
    block_input = layer_activation_bytes(model, cand, "full")
    k = min(cand.recompute_layers, num_blocks)
    if cand.recompute_method == "uniform":
        return math.ceil(num_blocks / k) * block_input
    return k * block_input + (num_blocks - k) * layer_activation_bytes(model, cand, "none")


def recompute_transient_bytes(model: ModelShape, cand: Candidate, num_blocks: int) -> float:
    """Activations re-created for one micro-batch while its backward runs: selective's modules of one block, one block
    (full, block method) or one chunk of k blocks (full, uniform)."""
    whole = layer_activation_bytes(model, cand, "none")
    exchange = cp_exchange_bytes(model, cand) + ep_dispatch_bytes(model, cand)
    if cand.recompute == "selective":
        return whole - layer_activation_bytes(model, cand, "selective") + exchange
    if cand.recompute == "full":
        return whole * (min(cand.recompute_layers, num_blocks) if cand.recompute_method == "uniform" else 1) + exchange
    return exchange


def cp_exchange_bytes(model: ModelShape, cand: Candidate) -> float:
    """What one layer's CP exchange holds while it runs (its K/V and dK/dV buffers, the eager kernel's score
    block; ``memory.cp_transient_bytes``): one layer at a time, so once per stage; 0 at cp 1."""
    if cand.cp == 1:
        return 0.0
    return cp_transient_bytes(
        model.seq_length,
        cand.micro_batch_size,
        model.hidden_size,
        model.num_heads,
        cand.tp,
        cand.cp,
        cand.cp_comm,
        cand.attention,
        num_kv_heads=model.num_kv_heads,
        act_bytes=ACT_BYTES,
        head_dim=model.head_dim,
    )


def ep_dispatch_bytes(model: ModelShape, cand: Candidate) -> float:
    """What one routed layer's all-to-all holds while it runs at ep > 1 (``expert_parallel.dispatch``): the rows it
    sends and the rows it receives, [tokens k, h] each in activation bytes for the tokens this rank dispatches
    (``ep_tokens``), the dispatch's in the forward and the combine's gradient in the backward: one layer at a time,
    so once per stage; 0 at ep 1 and for a dense model."""
    routed = routed_shape(model)
    if cand.ep_size == 1 or routed is None:
        return 0.0
    tokens = ep_tokens(model, cand)
    return 2 * tokens * routed.top_k * model.hidden_size * ACT_BYTES


def expert_dp_size(cand: Candidate) -> int:
    """Ranks of a stage holding the same experts at ep > 1, the expert-DP group (``expert_parallel.layout``): the
    stage's token ranks (``config.ep_rules.token_ranks``) over ep.  They share the experts' optimizer state under
    ZeRO-1 (DeepSpeed's BF16 optimizer partitions an expert group over it) and reduce the experts' gradients: tp x
    cp x dp / ep under SP with whole experts (cp x dp / ep at tp 1), cp x dp / ep with experts split over TP."""
    return token_ranks(cand.tp, cand.cp, cand.dp, cand.sequence_parallel, expert_split(cand)) // cand.ep_size


def ep_tokens(model: ModelShape, cand: Candidate) -> float:
    """Tokens of one micro-batch each rank dispatches over its EP group at ep > 1: with whole experts its own (its
    sequence shard under SP, s b / (cp t)); with experts split over TP those every TP rank runs after the gather
    (s b / cp, as the dense MLP's)."""
    tokens = model.seq_length // cand.cp * cand.micro_batch_size
    return tokens / (cand.tp if cand.sequence_parallel and not cand.experts_split_at_ep else 1)


def sp_split(cand: Candidate) -> int:
    """What SP and CP divide the sequence-length terms by: tp with SP on (else 1), times cp."""
    return (cand.tp if cand.sequence_parallel and cand.tp > 1 else 1) * cand.cp


def embedding_activation_bytes(model: ModelShape, cand: Candidate) -> float:
    """First stage, per micro-batch: a GPT's embedding dropout mask (1-byte s b h, /t under SP); nothing for a Llama."""
    if not family_of(model).layout.positions:  # the embedding dropout comes with the learned positions
        return 0.0
    return model.seq_length * cand.micro_batch_size * model.hidden_size * MASK_BYTES / sp_split(cand)


def output_activation_bytes(model: ModelShape, cand: Candidate) -> float:
    """Last stage, per micro-batch: final norm input and output-layer input (+ RMSNorm's 1/rms; /t under SP), and the
    logits in bf16 plus their fp32 copy."""
    s, b, h = model.seq_length, cand.micro_batch_size, model.hidden_size
    per_token = 2 * ACT_BYTES * h + family_of(model).tuner.norm_stat_bytes
    logits = LOGITS_BYTES * s // cand.cp * b * padded_vocab_size(model.vocab_size, cand.tp) / cand.tp
    return per_token * s * b / sp_split(cand) + logits


def deferred_weight_grad_bytes(model: ModelShape, cand: Candidate, num_blocks: int, last: bool) -> float:
    """What one queued W pass of a stage keeps (``memory.deferred_weight_grad_bytes_per_layer`` per block), on the
    last stage with the output layer's: its input [s/cp, b, h] (gathered whole under SP) and output gradient
    [s/cp, b, V/t], in activation bytes."""
    m = model
    per_block = deferred_weight_grad_bytes_per_layer(
        m.seq_length,
        cand.micro_batch_size,
        m.hidden_size,
        m.num_heads,
        cand.tp,
        family=m.family,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        cp=cand.cp,
        act_bytes=ACT_BYTES,
        **routed_terms(m),
    )
    tokens = m.seq_length // cand.cp * cand.micro_batch_size
    output = tokens * (m.hidden_size + padded_vocab_size(m.vocab_size, cand.tp) / cand.tp) * ACT_BYTES
    return num_blocks * per_block + (output if last else 0.0)


def stage_activation_bytes(model: ModelShape, cand: Candidate) -> tuple[float, float]:
    """(first, last) pipeline rank's activation bytes at their peak under the candidate's schedule: one
    micro-batch's terms on a stage (a chunk under two stages per rank), combined by the schedule's record
    (``Schedule.activation_peaks``: 1F1B min(p, m) micro-batches on the first stage, one on the last; the others'
    in their own modules, ``pipeline_parallel/schedules/``)."""
    schedule = pipeline_schedule(cand.schedule).for_settings(cand)  # at the candidate's v stages per rank

    def peaks(n: int, dense: int = 0) -> tuple[float, float]:  # n: a stage's (a chunk's) blocks, dense of them
        terms = ActivationTerms(
            stored_activation_bytes(model, cand, n, dense),
            recompute_transient_bytes(model, cand, n),
            embedding_activation_bytes(model, cand),
            output_activation_bytes(model, cand),
            lambda last: deferred_weight_grad_bytes(model, cand, n, last=last),
        )
        return schedule.activation_peaks(cand.pp, cand.num_micro_batches, terms)

    # A routed family's dense blocks: a chunk counts the fewest of its rank's chunks hold (all of them with one chunk
    # per rank; a dense block stores less than a routed one, so this is the larger peak).
    first_dense, last_dense = chunk_dense_blocks(model, cand)
    if cand.pipeline_layout is None:
        n = layers_per_stage(model.num_layers, schedule.per_rank(cand) * cand.pp)
        if first_dense == last_dense:
            return peaks(n, first_dense)
        return peaks(n, first_dense)[0], peaks(n, last_dense)[1]
    # An uneven layout (one stage per rank, tune.training.layout): the first rank's peak at its blocks, the last's at
    # its own; the layout keeps every middle rank's below the first's (layout.middle_ranks_bounded).
    return peaks(cand.pipeline_layout[0], first_dense)[0], peaks(cand.pipeline_layout[-1], last_dense)[1]


def stage_memory(model: ModelShape, cand: Candidate) -> tuple[StageMemory, StageMemory]:
    """(first stage, last stage) memory per GPU; each rank's activations add the rotary cos/sin tables its blocks
    share (``memory.rotary_table_bytes``, once per process whatever its number of stages or blocks)."""
    per_layer = layer_activation_bytes(model, cand, cand.recompute)
    tables = rotary_table_bytes(
        model.seq_length,
        model.hidden_size,
        model.num_heads,
        cand.cp,
        family=model.family,
        act_bytes=ACT_BYTES,
        head_dim=model.head_dim,
    )
    shard = cand.dp * cand.cp if cand.zero == 1 else 1  # ZeRO-1 partitions over DeepSpeed's data axis, dp x cp
    # at ep > 1 the experts' groups partition over the expert-DP group instead (0 expert parameters at ep 1)
    expert_shard = expert_dp_size(cand) if cand.zero == 1 else 1
    experts = [blocks * block_expert_param_count(model, cand) for blocks in rank_routed_blocks(model, cand)]
    return tuple(  # type: ignore[return-value]
        StageMemory(
            float(WEIGHT_BYTES * n),
            float(GRAD_BYTES * n),
            OPTIMIZER_BYTES * (n - e) / shard + (OPTIMIZER_BYTES * e / expert_shard if e else 0.0),
            act,
            per_layer,
        )
        for n, e, act in zip(
            rank_param_counts(model, cand), experts, (a + tables for a in stage_activation_bytes(model, cand))
        )
    )
