"""The Llama family (Touvron et al. 2023; Llama 3): RMSNorm, rotary positions, grouped-query attention, SwiGLU, no
biases, tied or untied output layer.  Its config, plan, pipeline layout, transformers names, FLOPs and memory terms
(stdlib only; the torch side is ``model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    NamedShape,
    PlanRow,
    TunerFacts,
    hf_fields,
    read_fields,
)

NAME = "llama"  # the config's model.family
# Our field names that ds_megatron.config.ModelShape spells otherwise (the others are the same).
SHAPE_RENAMED = {"rms_norm_eps": "layer_norm_epsilon", "attention_dropout": "dropout", "initializer_range": "init_std"}
# Our field names that transformers' LlamaConfig spells otherwise (the others are the same).
HF_RENAMED = dict(num_layers="num_hidden_layers", num_heads="num_attention_heads", num_kv_heads="num_key_value_heads")
LLAMA3_VOCAB_SIZE = 128256
LLAMA3_SEQ_LENGTH = 8192  # Llama 3's pretraining context: the training sequence length of a named size
# Llama 3.2's rope_scaling block: positions beyond the original 8,192 reached by stretching the low frequencies.
LLAMA32_ROPE_SCALING = (
    ("factor", 32.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)


def _llama3(layers: int, hidden: int, heads: int, ffn: int, tied: bool, lr: float, scaled: bool) -> NamedShape:
    """8 KV heads; Llama 3.2 (``scaled``) reaches 131,072 positions through its rope scaling, Llama 3 has 8,192."""
    return NamedShape(
        NAME,
        layers,
        hidden,
        heads,
        num_kv_heads=8,
        intermediate_size=ffn,
        vocab_size=LLAMA3_VOCAB_SIZE,
        seq_length=LLAMA3_SEQ_LENGTH,
        max_position_embeddings=131072 if scaled else 8192,
        rope_theta=500000.0,
        rope_scaling=LLAMA32_ROPE_SCALING if scaled else None,
        tie_word_embeddings=tied,
        learning_rate=lr,
    )


# Llama 3 / 3.2: the published config.json of each model as transformers reads it (8 KV heads, vocabulary 128,256,
# rope theta 500,000, tied embeddings for the 3.2 models only, Llama 3.2's rope scaling), with the peak learning
# rates of Llama 3's paper (8B and 70B; the 3.2 models, distilled rather than pretrained, take the 8B's).
SIZES = {
    "llama3.2-1b": _llama3(16, 2048, 32, 8192, True, 3.0e-4, scaled=True),
    "llama3.2-3b": _llama3(28, 3072, 24, 8192, True, 3.0e-4, scaled=True),
    "llama3-8b": _llama3(32, 4096, 32, 14336, False, 3.0e-4, scaled=False),
    "llama3-70b": _llama3(80, 8192, 64, 28672, False, 1.5e-4, scaled=False),
    "llama-tiny": NamedShape(  # for laptops and tests (vocabulary from the tokenizer, sequence from the config)
        NAME, 4, 128, 4, num_kv_heads=2, intermediate_size=352, rope_theta=10000.0, tie_word_embeddings=False
    ),
}


@dataclass(frozen=True)
class LlamaConfig:
    """Llama architecture, convertible to and from ``transformers.LlamaConfig``."""

    vocab_size: int = 32000  # real vocabulary (V); TP padding is applied by parallelize, never here
    hidden_size: int = 4096  # h
    num_layers: int = 32  # L
    num_heads: int = 32  # a
    num_kv_heads: int = 8  # grouped-query attention's KV heads (divides num_heads)
    intermediate_size: int = 14336  # SwiGLU width (F)
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3 scaling as sorted (key, value) pairs
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0  # dropout on attention probabilities (Llama's only dropout)
    initializer_range: float = 0.02
    attention: str = "eager"  # "eager" or "sdpa"

    family = NAME

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # The names the shared layers and the pipeline read off every family's config.
    attn_pdrop = property(lambda self: self.attention_dropout)
    n_layer = property(lambda self: self.num_layers)
    n_embd = property(lambda self: self.hidden_size)

    def to_hf(self) -> Any:
        """The equivalent ``transformers.LlamaConfig`` (imported lazily)."""
        from transformers import LlamaConfig as HFLlamaConfig

        return HFLlamaConfig(
            **hf_fields(self, HF_RENAMED, skip=("rope_theta", "rope_scaling")),
            head_dim=self.head_dim,
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, **dict(self.rope_scaling or ())},
            attention_bias=False,
            mlp_bias=False,
            attn_implementation=self.attention,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @classmethod
    def from_shape(cls, m: Any) -> LlamaConfig:
        """From a resolved model shape (``ds_megatron.config.ModelShape``, read by attribute)."""
        return cls(**read_fields(cls, m, SHAPE_RENAMED, attention=m.attention))

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> LlamaConfig:
        """Build from a ``transformers.LlamaConfig``; refuses settings this model does not implement."""
        unsupported = []
        if getattr(hf, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf.hidden_act}")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf, flag, False):
                unsupported.append(f"{flag}=True")
        head_dim = getattr(hf, "head_dim", None)
        if head_dim not in (None, hf.hidden_size // hf.num_attention_heads):
            unsupported.append(f"head_dim={head_dim} (not hidden_size / num_attention_heads)")
        if getattr(hf, "pretraining_tp", 1) not in (None, 1):
            unsupported.append(f"pretraining_tp={hf.pretraining_tp}")
        scaling = getattr(hf, "rope_scaling", None)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3"):
            unsupported.append(f"rope_scaling.rope_type={kind}")
        if unsupported:
            raise ValueError(
                f"error: LlamaConfig: unsupported settings ({', '.join(unsupported)}); use a standard Llama config"
            )
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        pairs = None
        if kind == "llama3":
            pairs = tuple(sorted([("rope_type", "llama3"), *((k, scaling[k]) for k in keys)]))
        theta = getattr(hf, "rope_theta", None) or (getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
        return cls(
            **read_fields(
                cls,
                hf,
                HF_RENAMED,
                num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
                rope_theta=float(theta if theta is not None else 10000.0),
                rope_scaling=pairs,
                tie_word_embeddings=bool(hf.tie_word_embeddings),
                attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
                attention=attention,
            )
        )


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
      rotary cos/sin tables are shared by every block (2 s d elements per process, not per layer): they are
      ``memory.rotary_table_bytes``, counted once per stage, not here."""
    if num_kv_heads is None or intermediate_size is None:
        raise ValueError("the llama family needs num_kv_heads and intermediate_size")
    kv = num_kv_heads / a  # k d / h
    ffn = intermediate_size / h  # F / h
    replicated = 4 * act + 2 * RSTD_BYTES / h  # two norm inputs, the q/k/v and gate/up inputs; two fp32 1/rms
    split = (2 + 2 * kv + 3 * ffn) * act  # Q, o_proj input, K, V, gate, up, down_proj input
    return BlockTerms(replicated, 0, split, 1 + 2 * kv, bool(attention_dropout), ffn)


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
    hf_base_prefix="model",
    hf_ignored=(".rotary_emb.inv_freq",),  # stored by transformers before 4.31
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    sizes=SIZES,
    shape_renamed=SHAPE_RENAMED,
    hf_renamed=HF_RENAMED,
    mlp_matrices=3,  # gate, up and down (SwiGLU)
    block_terms=block_terms,
    tuner=TunerFacts(
        default_vocab=LLAMA3_VOCAB_SIZE,
        default_seq_length=LLAMA3_SEQ_LENGTH,
        dropout=0.0,  # the published recipes train without dropout, so the tuner models and writes 0
        attention_dropout_only=True,
        norm_params=1,
        norm_stat_bytes=RSTD_BYTES,
        # (2 h^2 + 2 h kv + 3 h F) / t + 2 h: no biases; the replicated part is the two RMSNorms
        block_params=lambda h, kv, f, tp: (2 * h * h + 2 * h * kv + 3 * h * f) // tp + 2 * h,
        block_gemms=block_gemms,
        recomputed_passes={
            "mlp_act": (("silu(gate) * up", 2, 1),),
            "layernorm": (("RMSNorm before attention", 1, 1), ("RMSNorm before the MLP", 1, 1)),
        },
    ),
)
