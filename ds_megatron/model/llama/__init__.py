"""The Llama family (Touvron et al. 2023; Llama 3): RMSNorm, rotary positions, grouped-query attention, SwiGLU, no
biases, tied or untied output layer, transformers' ``LlamaForCausalLM`` names.  Stdlib only: the torch side is
``model.py``.

This file is the family's record: its parallel plan, pipeline layout, transformers names and the terms of the
analytic FLOPs (``flops.py``) and activation memory (``memory.py``).
"""

from __future__ import annotations

from ds_megatron.config.sizes import LLAMA3_SEQ_LENGTH, LLAMA3_VOCAB_SIZE
from ds_megatron.model.family import (
    COLUMN,
    NORM,
    OUTPUT,
    ROW,
    VOCAB,
    BlockTerms,
    Family,
    Gemm,
    LayoutTable,
    PlanRow,
    TunerFacts,
)
from ds_megatron.model.llama.config import NAME, LlamaConfig

# q, k and v column-parallel by heads (KV heads split over TP like query heads), o_proj row-parallel, gate and up
# column-parallel, down row-parallel; vocabulary-parallel embedding and output layer (tied or not).
PLAN: tuple[PlanRow, ...] = (
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

RSTD_BYTES = 4  # RMSNorm keeps one fp32 1/rms per token for its backward, whatever the activation dtype


def block_terms(
    h: int, a: int, num_kv_heads: int | None, intermediate_size: int | None, attention_dropout: float | None, act: int
) -> BlockTerms:
    """The Llama block, per token (units of s*b elements), the paper's sec. 4.1 bookkeeping applied to the tensors
    this block saves for backward (k KV heads of d = h / a, SwiGLU of width F):
    - replicated under TP, split by SP: the two RMSNorm inputs (2 h) and their fp32 1/rms (one 4-byte number per
      token each: 8 bytes), the input shared by q/k/v (h) and the input shared by gate/up (h): 4 h in activation
      bytes + 8 bytes.  Under SP the column-parallel projections keep only the sequence shard of their input.
    - split by TP: Q after the rotary embedding, as scaled for the scores (h), K after it and V (k d each:
      grouped-query attention folds each KV head's group of query heads into the rows of the matmul, so K and V are
      stored at KV size, never expanded to a heads), the o_proj input (h), SwiGLU's gate and up (2 F: silu(gate) *
      up is one autograd function that keeps only its two inputs) and the down_proj input (F): 2 h + 2 k d + 3 F in
      activation bytes.
    - the s^2 terms, split by TP: the softmax output (a s, activation bytes); with an attention dropout p > 0
      (Llama's only dropout; 0 in the published recipes) also its output (a s, activation bytes) and mask (a s, mask
      bytes), with p = 0 nothing (dropout returns its input).  There is no residual or embedding dropout.  The
      rotary cos/sin tables are buffers shared by every block (2 s d elements per process, not per layer), so they
      are not counted.
    - eager, p = 0, no recompute: 4 h act + 8 bytes split by SP, (2 h + 2 k d + 3 F) act + a s act split by TP."""
    if num_kv_heads is None or intermediate_size is None:
        raise ValueError("the llama family needs num_kv_heads and intermediate_size")
    kv = num_kv_heads / a  # k d / h
    ffn = intermediate_size / h  # F / h
    replicated = 4 * act + 2 * RSTD_BYTES / h  # two norm inputs, the q/k/v and gate/up inputs; two fp32 1/rms
    split = (2 + 2 * kv + 3 * ffn) * act  # Q, o_proj input, K, V, gate, up, down_proj input
    return BlockTerms(replicated, 0, split, 1 + 2 * kv, bool(attention_dropout), ffn)


def block_params(h: int, kv: int, f: int, tp: int) -> int:
    """(2 h^2 + 2 h kv + 3 h F) / t + 2 h: no biases; the replicated part is the two RMSNorms."""
    return (2 * h * h + 2 * h * kv + 3 * h * f) // tp + 2 * h


def block_gemms(n: int, h: int, kv: int, f: int, t: int) -> tuple[Gemm, ...]:
    """The weight matmuls of one block's forward over n tokens, per TP rank (the TP-split dimension divided by t)."""
    return (
        ("q", n, h, h // t, 1),
        ("k, v", n, h, kv // t, 2),
        ("o_proj", n, h // t, h, 1),
        ("gate, up", n, h, f // t, 2),
        ("down", n, f // t, h, 1),
    )


FAMILY = Family(
    name=NAME,
    config=LlamaConfig,
    modeling="ds_megatron.model.llama.model",
    blocks="model.layers",
    plan=PLAN,
    attention="self_attn",
    layout=LayoutTable(
        embedding=("model.embed_tokens", "embed_tokens"),
        positions=None,
        final_norm=("model.norm", "norm"),
        output=("lm_head", "lm_head"),
        tied_key="embed_tokens",
    ),
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    mlp_matrices=3,  # gate, up and down (SwiGLU)
    block_terms=block_terms,
    tuner=TunerFacts(
        default_vocab=LLAMA3_VOCAB_SIZE,
        default_seq_length=LLAMA3_SEQ_LENGTH,
        dropout=0.0,  # the published recipes train without dropout, so the tuner models and writes 0
        attention_dropout_only=True,
        norm_params=1,
        embedding_dropout=False,
        norm_stat_bytes=RSTD_BYTES,
        block_params=block_params,
        block_gemms=block_gemms,
        recomputed_passes={
            "mlp_act": (("silu(gate) * up", 2, 1),),
            "layernorm": (("RMSNorm before attention", 1, 1), ("RMSNorm before the MLP", 1, 1)),
        },
    ),
)
