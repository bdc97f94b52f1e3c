"""LlamaConfig: the single-device Llama's shape, convertible to and from ``transformers.LlamaConfig``.  Stdlib
only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.model.family import from_hf_fields, hf_fields

NAME = "llama"  # the config's model.family
# Our field names that transformers' LlamaConfig spells otherwise (the others are the same).
HF_RENAMED = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
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

    @property
    def attn_pdrop(self) -> float:
        return self.attention_dropout

    @property
    def n_layer(self) -> int:
        return self.num_layers

    @property
    def n_embd(self) -> int:
        return self.hidden_size

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
        return cls(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_theta,
            rope_scaling=m.rope_scaling,
            rms_norm_eps=m.layer_norm_epsilon,
            tie_word_embeddings=m.tie_word_embeddings,
            attention_dropout=m.dropout,
            initializer_range=m.init_std,
            attention=m.attention,
        )

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
            **from_hf_fields(
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
