"""GPTConfig: the single-device GPT's shape, convertible to and from ``transformers.GPT2Config``.  Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.config.sizes import GPT3_VOCAB_SIZE
from ds_megatron.model.family import from_hf_fields, hf_fields

NAME = "gpt2"  # the config's model.family
# Our field names are GPT2Config's, so the map between the two is the identity.
HF_RENAMED: dict[str, str] = {}


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
        return cls(
            vocab_size=m.vocab_size,
            n_positions=m.max_position_embeddings,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_heads,
            embd_pdrop=m.dropout,
            attn_pdrop=m.dropout,
            resid_pdrop=m.dropout,
            layer_norm_epsilon=m.layer_norm_epsilon,
            initializer_range=m.init_std,
            attention=m.attention,
        )

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
        return cls(**from_hf_fields(cls, hf, HF_RENAMED, attention=attention))
