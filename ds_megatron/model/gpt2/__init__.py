"""The GPT-2 / GPT-3 family (Radford et al. 2019; Brown et al. 2020): learned positions, pre-LayerNorm, GELU MLP of
width 4h, tied embeddings.  Its config, plan, pipeline layout, transformers names, FLOPs and memory terms (stdlib
only; the torch side is ``model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.model.family import (
    COLUMN,
    NORM,
    POSITION,
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

NAME = "gpt2"  # the config's model.family
# Our field names are GPT2Config's, so the map between the two is the identity.
HF_RENAMED: dict[str, str] = {}
# Our field names that ds_megatron.config.ModelShape spells otherwise (one dropout serves all three).
SHAPE_RENAMED = dict(
    n_positions="max_position_embeddings",
    n_embd="hidden_size",
    n_layer="num_layers",
    n_head="num_heads",
    embd_pdrop="dropout",
    attn_pdrop="dropout",
    resid_pdrop="dropout",
    initializer_range="init_std",
)
GPT3_VOCAB_SIZE = 50257  # GPT-2's byte-level BPE vocabulary, which GPT-3 kept
GPT3_SEQ_LENGTH = 2048


def _gpt3(layers: int, hidden: int, heads: int, lr: float) -> NamedShape:
    return NamedShape(
        NAME, layers, hidden, heads, vocab_size=GPT3_VOCAB_SIZE, seq_length=GPT3_SEQ_LENGTH, learning_rate=lr
    )


# GPT-3: Brown et al. 2020, Table 2.1 (s = 2048, V = 50257), with its peak learning rates.
SIZES = {
    "gpt3-125m": _gpt3(12, 768, 12, 6.0e-4),
    "gpt3-350m": _gpt3(24, 1024, 16, 3.0e-4),
    "gpt3-760m": _gpt3(24, 1536, 16, 2.5e-4),
    "gpt3-1.3b": _gpt3(24, 2048, 16, 2.0e-4),  # the paper's 24 heads of 128 do not divide 2048; 16 x 128 do
    "gpt3-2.7b": _gpt3(32, 2560, 32, 1.6e-4),
    "gpt3-6.7b": _gpt3(32, 4096, 32, 1.2e-4),
    "gpt3-13b": _gpt3(40, 5120, 40, 1.0e-4),  # the paper's 5140 is not divisible by 40 heads; 5120 is the usual one
    "gpt3-175b": _gpt3(96, 12288, 96, 0.6e-4),
    "gpt-tiny": NamedShape(NAME, 4, 128, 4),  # for laptops and tests (vocabulary from the tokenizer)
}


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 / GPT-3 architecture: learned positions, pre-LayerNorm, GELU MLP of width 4h, tied embeddings."""

    vocab_size: int = GPT3_VOCAB_SIZE  # real vocabulary (V); TP padding is applied by parallelize, never here
    n_positions: int = 1024  # rows of the learned position table
    n_embd: int = 768  # hidden size (h)
    n_layer: int = 12  # transformer blocks (L)
    n_head: int = 12  # attention heads (a)
    embd_pdrop: float = 0.1  # dropout after embedding
    attn_pdrop: float = 0.1  # dropout on attention probabilities
    resid_pdrop: float = 0.1  # dropout on each residual branch output
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02  # std of the normal init
    attention: str = "eager"  # "eager" (materialised softmax) or "sdpa"

    family = NAME

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_hf(self) -> Any:
        """The equivalent ``transformers.GPT2Config`` (imported lazily)."""
        from transformers import GPT2Config

        return GPT2Config(
            **hf_fields(self, HF_RENAMED),
            n_inner=None,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            attn_implementation=self.attention,
            # GPT-2's own ids (50256) only where they exist; export sets the tokenizer's EOS.
            bos_token_id=50256 if self.vocab_size > 50256 else None,
            eos_token_id=50256 if self.vocab_size > 50256 else None,
        )

    @classmethod
    def from_shape(cls, m: Any) -> GPTConfig:
        """From a resolved model shape (``ds_megatron.config.ModelShape``, read by attribute)."""
        return cls(**read_fields(cls, m, SHAPE_RENAMED, attention=m.attention))

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> GPTConfig:
        """Build from a ``transformers.GPT2Config``; refuses settings this GPT does not implement."""
        unsupported = []
        if getattr(hf, "n_inner", None) not in (None, 4 * hf.n_embd):
            unsupported.append(f"n_inner={hf.n_inner}")
        if getattr(hf, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            unsupported.append(f"activation_function={hf.activation_function}")
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False):
            unsupported.append("scale_attn_by_inverse_layer_idx=True")
        if not getattr(hf, "scale_attn_weights", True):
            unsupported.append("scale_attn_weights=False")
        if not getattr(hf, "tie_word_embeddings", True):
            unsupported.append("tie_word_embeddings=False")
        if unsupported:
            raise ValueError(
                f"error: GPT2Config: unsupported settings ({', '.join(unsupported)}); use a standard GPT-2 config"
            )
        return cls(**read_fields(cls, hf, HF_RENAMED, attention=attention))


# Megatron (Shoeybi et al. 2019): fused q|k|v column-parallel by heads, projection row-parallel, fc1 column, fc2 row;
# vocabulary-parallel tied embedding; the learned position table replicated.
PLAN: tuple[PlanRow, ...] = (
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

# GPT-2's Conv1D stores these weights [in, out] where our nn.Linear stores [out, in].
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def block_terms(
    h: int, a: int, num_kv_heads: int | None, intermediate_size: int | None, attention_dropout: float | None, act: int
) -> BlockTerms:
    """The paper's GPT block, in units of s*b*h elements, eager attention (the paper's setting):
    - replicated under TP, split by SP ("10" in the paper): two LayerNorm inputs (2), QKV and fc1 inputs (2) in
      activation bytes, and the attention-output and MLP dropout masks (2) in mask bytes;
    - split by TP ("24"): Q, K, V (3), projection input (1), GELU input (4), fc2 input (4) in activation bytes;
    - the s^2 terms (5 a s / h), split by TP: softmax output and dropout output (2 a s / h) in activation bytes and
      the softmax dropout mask (a s / h) in mask bytes.
    Fewer KV heads or another MLP width scale their terms.  Its dropouts are always counted: the paper's table is
    for a GPT trained with dropout."""
    if attention_dropout is not None:
        raise ValueError("attention_dropout applies to the llama family; the GPT formula counts its dropouts as on")
    kv = 1.0 if num_kv_heads is None else num_kv_heads / a  # k d / h
    ffn = 4.0 if intermediate_size is None else intermediate_size / h  # F / h
    # paper: 10 = 4 activations + 2 masks (in its bytes: 2 x 4 + 2); 24 = Q, projection input, K, V, GELU and fc2
    # inputs (2 x 12)
    return BlockTerms(4 * act, 2, (2 + 2 * kv + 2 * ffn) * act, 1 + 2 * kv, True, ffn)


def block_gemms(n: int, h: int, kv: int, f: int, t: int) -> tuple[Gemm, ...]:
    """The weight matmuls of one block's forward over n tokens, per TP rank (the TP-split dimension divided by t)."""
    return (
        ("qkv", n, h, 3 * h // t, 1),
        ("attention projection", n, h // t, h, 1),
        ("fc1", n, h, f // t, 1),
        ("fc2", n, f // t, h, 1),
    )


FAMILY = Family(
    name=NAME,
    config=GPTConfig,
    modeling="ds_megatron.model.gpt2.model",
    blocks="transformer.h",
    plan=PLAN,
    attention="attn",
    layout=LayoutTable(
        embedding=("transformer.wte", "wte"),
        positions=("transformer.wpe", "wpe"),
        final_norm=("transformer.ln_f", "ln_f"),
        output=("transformer.wte", "wte"),
        tied_key="wte",
    ),
    hf_model_type="gpt2",
    hf_architecture="GPT2LMHeadModel",
    # deepspeed 0.19.8: "AutoTP not supported for model. Please use kernel injection since container policy for
    # model exists"; kernel injection runs on CUDA only.
    no_autotp_inference="DeepSpeed's AutoTP refuses GPT-2: it has a CUDA-only kernel-injection policy",
    mlp_matrices=2,  # fc1 and fc2
    block_terms=block_terms,
    tuner=TunerFacts(
        default_vocab=GPT3_VOCAB_SIZE,
        default_seq_length=GPT3_SEQ_LENGTH,
        dropout=None,
        attention_dropout_only=False,
        norm_params=2,
        norm_stat_bytes=0,
        # (12 h^2 + 7 h) / t + 6 h: the replicated part is the row-parallel biases and the two LayerNorms
        block_params=lambda h, kv, f, tp: (12 * h * h + 7 * h) // tp + 6 * h,
        block_gemms=block_gemms,
        recomputed_passes={
            "mlp_act": (("GELU", 1, 1),),
            "layernorm": (("LayerNorm before attention", 1, 1), ("LayerNorm before the MLP", 1, 1)),
        },
    ),
    sizes=SIZES,
    shape_renamed=SHAPE_RENAMED,
    hf_renamed=HF_RENAMED,
    fixed_kv_and_width=True,
    hf_transposed=CONV1D_SUFFIXES,
    hf_base_prefix="transformer",
    hf_ignored=(".attn.bias", ".attn.masked_bias"),  # the causal-mask buffers of older GPT-2 files
    sp_dropouts=("attn.resid_dropout", "mlp.dropout"),
    model_sp_dropouts=("transformer.drop",),
)
