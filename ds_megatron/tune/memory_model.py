"""Per-GPU memory of a candidate on the first and the last pipeline stage.  Pure Python.

Model states (mixed-precision Adam as DeepSpeed's BF16 optimizer keeps them: 2 bytes bf16 weights + 4 fp32 gradients +
12 fp32 master and Adam moments per parameter):
bf16 weights 2 bytes, bf16 gradients 2 + their fp32 accumulation copy 4, fp32 master weights 4 + Adam m and v 8;
ZeRO-1 shards the last 12 over the data-parallel group.

Parameters: per family (``FAMILIES``): a GPT block 12 h^2 + 13 h, a Llama block 2 h^2 + 2 h kv + 3 h F + 2 h
(kv = KV heads x head dim, F the SwiGLU width), the embedding, a GPT's position table, the final norm and the output
layer (tied or not).

Activations (Korthikanti et al. 2022, sec. 4): per layer from :func:`ds_megatron.memory.activation_bytes_per_layer`
for the model's family, with the candidate's attention kernel (eager: the s^2 terms; sdpa: the fused GPU kernels'
fp32 log-sum-exp instead) and, under selective recompute, its modules; a Llama's attention dropout is its shape's
(the tuner models and writes 0, ``spec.LLAMA_DROPOUT``); under the 1F1B schedule the first stage keeps min(p, m)
micro-batches in flight (L layers' worth when m >= p) and the last stage one (sec. 4.2.3).  The first stage adds a
GPT's embedding dropout mask, the last stage the final norm input, the output-layer input and the logits (bf16, plus
the fp32 copy the loss works on) (sec. 4.3).

Conservative choices, stated once: every stage is assumed to hold ceil(L/p) blocks (DeepSpeed balances blocks, so
the real first or last stage may hold one fewer); while a micro-batch's backward runs, the activations being
recomputed for it (one block's recomputed modules, one layer, or one chunk of k layers) are added on top.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ds_megatron.config import ModelShape
from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE, padded_vocab_size
from ds_megatron.config.shape import layers_per_stage
from ds_megatron.memory import RSTD_BYTES, activation_bytes_per_layer
from ds_megatron.tune.spec import Candidate

GIB = 2**30

WEIGHT_BYTES = 2  # bf16 weights
GRAD_BYTES = 2 + 4  # bf16 gradients + the fp32 accumulation buffer ("grad_accum_dtype": "fp32")
OPTIMIZER_BYTES = 4 + 8  # fp32 master weights + Adam m and v; ZeRO-1 divides these by dp

ACT_BYTES = 2  # bf16 activations (the paper's 2-byte activations)
MASK_BYTES = 1  # the GPU dropout kernel's 1-byte masks
LOGITS_BYTES = 2 + 4  # bf16 logits and the fp32 copy the cross entropy computes on

# Workspace and fragmentation the analytic terms do not see: cuBLAS/NCCL workspaces, the CUDA context, gradient
# buckets, allocator fragmentation.  10% of the predicted bytes plus a fixed 2 GiB.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 2 * GIB


@dataclass(frozen=True)
class FamilyLayout:
    """What a model family adds around its blocks, for the parameter and activation counts."""

    learned_positions: bool  # a position table (s x h, replicated) on the first stage; rotary embedding has none
    norm_params: int  # parameters of one norm per h: LayerNorm's weight and bias 2, RMSNorm's weight 1
    embedding_dropout: bool  # a dropout mask after the embedding on the first stage
    norm_stat_bytes: int  # bytes per token a norm keeps besides its input (RMSNorm's fp32 1/rms; LayerNorm's are
    # left out, as the paper leaves them out)


FAMILIES = {"gpt2": FamilyLayout(True, 2, True, 0), "llama": FamilyLayout(False, 1, False, RSTD_BYTES)}


def attention_dropout(model: ModelShape) -> float | None:
    """What the activation formula is told of the attention dropout: None for a GPT (its dropouts always counted,
    as the paper's table counts them), the model's dropout for a Llama (its only dropout)."""
    return None if model.family == "gpt2" else model.dropout


def has_attention_dropout(model: ModelShape) -> bool:
    p = attention_dropout(model)
    return p is None or p > 0


def block_param_count(model: ModelShape, tp: int = 1) -> int:
    """Parameters of one block of ``model`` per TP rank.

    GPT, unsharded: 12 h^2 + 13 h (QKV 3h^2 + 3h, projection h^2 + h, fc1 4h^2 + 4h, fc2 4h^2 + h, two LayerNorms
    4h), the per-layer part of N = 12 L h^2 (1 + 13/(12h) + ...) (Narayanan et al. 2021, sec. 5.1).  TP splits the
    four weight matrices and the column-parallel biases (QKV, fc1); the row-parallel biases and LayerNorms (6h) are
    replicated.  Llama: q and o_proj 2 h^2, k and v 2 h kv (kv = KV heads x head dim), gate, up and down 3 h F, all
    split by TP (no biases); the two RMSNorm weights (2h) are replicated.
    """
    h = model.hidden_size
    if model.family == "gpt2":
        return (12 * h * h + 7 * h) // tp + 6 * h
    kv_size = h // model.num_heads * model.num_kv_heads  # type: ignore[operator]
    return (2 * h * h + 2 * h * kv_size + 3 * h * model.intermediate_size) // tp + 2 * h  # type: ignore[operator]


def stage_param_counts(
    model: ModelShape, tp: int, pp: int, vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE
) -> tuple[int, int]:
    """(first stage, last stage) parameters per TP rank.

    First: the vocab-parallel token embedding V_pad h / t, a GPT's replicated position table s h, ceil(L/p) blocks.
    Last: ceil(L/p) blocks, the final norm (LayerNorm 2h, RMSNorm h) and the output layer V_pad h / t: a tied copy of
    the token embedding (kept in sync by DeepSpeed's tied-weight all-reduce) or an untied Llama's own ``lm_head``.
    With p = 1 both are the whole model, a tied embedding counted once.
    """
    h = model.hidden_size
    layout = FAMILIES[model.family]
    embedding = padded_vocab_size(model.vocab_size, tp, vocab_multiple) * h // tp
    positions = model.seq_length * h if layout.learned_positions else 0
    final_norm = layout.norm_params * h
    block = block_param_count(model, tp)
    if pp == 1:
        output = 0 if model.tie_word_embeddings else embedding
        total = embedding + positions + model.num_layers * block + final_norm + output
        return total, total
    blocks = layers_per_stage(model.num_layers, pp) * block
    return embedding + positions + blocks, blocks + final_norm + embedding


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
        out = asdict(self)
        out["predicted_bytes"] = self.predicted_bytes
        out["required_bytes"] = self.required_bytes
        return out


def layer_activation_bytes(
    model: ModelShape, cand: Candidate, recompute: str, act_bytes: int = ACT_BYTES, mask_bytes: int = MASK_BYTES
) -> float:
    """One block's activations for one micro-batch, per TP rank (sec. 4.1-4.2; Table 2 of the paper, 2-byte
    activations and 1-byte masks by default): ``recompute`` "none" keeps every tensor, "selective" all but the
    candidate's recomputed modules, "full" only the block input; the attention kernel is the candidate's (sdpa:
    CUDA's fused kernels)."""
    return activation_bytes_per_layer(
        model.seq_length,
        cand.micro_batch_size,
        model.hidden_size,
        model.num_heads,
        cand.tp,
        cand.sequence_parallel,
        recompute,
        act_bytes,
        mask_bytes,
        attention=cand.attention,
        family=model.family,
        num_kv_heads=model.num_kv_heads,
        intermediate_size=model.intermediate_size,
        attention_dropout=attention_dropout(model),
        modules=cand.recompute_modules if recompute == "selective" else (),
    )


def stored_activation_bytes(model: ModelShape, cand: Candidate, num_blocks: int) -> float:
    """What ``num_blocks`` blocks keep for one micro-batch until its backward.

    Full recompute (sec. 5): ``uniform`` keeps one input per chunk of k blocks (ceil(n/k) inputs); ``block``
    keeps the input of each of the first k blocks and every activation of the other n - k.
    """
    if cand.recompute != "full":
        return num_blocks * layer_activation_bytes(model, cand, cand.recompute)
    block_input = layer_activation_bytes(model, cand, "full")
    k = min(cand.recompute_layers, num_blocks)
    if cand.recompute_method == "uniform":
        return math.ceil(num_blocks / k) * block_input
    return k * block_input + (num_blocks - k) * layer_activation_bytes(model, cand, "none")


def recompute_transient_bytes(model: ModelShape, cand: Candidate, num_blocks: int) -> float:
    """Activations re-created for one micro-batch while its backward runs: what selective leaves out of one block
    (its recomputed modules), one block (full, block method) or one chunk of k blocks (full, uniform)."""
    whole = layer_activation_bytes(model, cand, "none")
    if cand.recompute == "selective":
        return whole - layer_activation_bytes(model, cand, "selective")
    if cand.recompute == "full":
        return whole * (min(cand.recompute_layers, num_blocks) if cand.recompute_method == "uniform" else 1)
    return 0.0


def embedding_activation_bytes(model: ModelShape, cand: Candidate) -> float:
    """First stage, per micro-batch: a GPT's embedding dropout mask, s b h one-byte elements (/t under SP)
    (sec. 4.3); nothing for a Llama (no embedding dropout)."""
    if not FAMILIES[model.family].embedding_dropout:
        return 0.0
    sp = cand.sequence_parallel and cand.tp > 1
    return model.seq_length * cand.micro_batch_size * model.hidden_size * MASK_BYTES / (cand.tp if sp else 1)


def output_activation_bytes(model: ModelShape, cand: Candidate) -> float:
    """Last stage, per micro-batch (sec. 4.3): final norm input and output-layer input, 2 s b h bytes each
    (+ RMSNorm's fp32 1/rms, 4 s b bytes; all /t under SP), and the logits s b V_pad / t in bf16 plus their fp32
    copy for the loss."""
    s, b, h = model.seq_length, cand.micro_batch_size, model.hidden_size
    sp = cand.sequence_parallel and cand.tp > 1
    per_token = 2 * ACT_BYTES * h + FAMILIES[model.family].norm_stat_bytes
    hidden_terms = per_token * s * b / (cand.tp if sp else 1)
    logits = LOGITS_BYTES * s * b * padded_vocab_size(model.vocab_size, cand.tp) / cand.tp
    return hidden_terms + logits


def stage_activation_bytes(model: ModelShape, cand: Candidate) -> tuple[float, float]:
    """(first stage, last stage) activation bytes at their peak under 1F1B."""
    n = layers_per_stage(model.num_layers, cand.pp)
    stored = stored_activation_bytes(model, cand, n)
    transient = recompute_transient_bytes(model, cand, n)
    in_flight = min(cand.pp, cand.num_micro_batches)  # stage i keeps p - i micro-batches; the first keeps p
    first = in_flight * (stored + embedding_activation_bytes(model, cand)) + transient
    last = stored + output_activation_bytes(model, cand) + transient
    if cand.pp == 1:
        first = last = first + output_activation_bytes(model, cand)
    return first, last


def stage_memory(model: ModelShape, cand: Candidate) -> tuple[StageMemory, StageMemory]:
    """(first stage, last stage) memory per GPU."""
    first_params, last_params = stage_param_counts(model, cand.tp, cand.pp)
    first_act, last_act = stage_activation_bytes(model, cand)
    per_layer = layer_activation_bytes(model, cand, cand.recompute)
    shard = cand.dp if cand.zero == 1 else 1

    def one(num_params: int, activations: float) -> StageMemory:
        return StageMemory(
            params_bytes=float(WEIGHT_BYTES * num_params),
            grads_bytes=float(GRAD_BYTES * num_params),
            optimizer_bytes=OPTIMIZER_BYTES * num_params / shard,
            activation_bytes=activations,
            activation_bytes_per_layer=per_layer,
        )

    return one(first_params, first_act), one(last_params, last_act)
