"""The Mixtral family (Jiang et al. 2024, "Mixtral of Experts"): Llama's decoder with every MLP routed, E SwiGLU
experts and the top k of a softmax router, always renormalised to sum 1.  Its config is the Qwen3-MoE config with
those settings fixed and no q/k norm; the two families share the torch side and the routed MLP
(``model/qwen3_moe``, ``model/moe_layer.py``).  Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.model.family import Family, HFExperts, read_fields
from ds_megatron.model.qwen3_moe import (
    HF_RENAMED as QWEN3_HF_RENAMED,
)
from ds_megatron.model.qwen3_moe import (
    LAYOUT,
    PLAN,
    SHAPE_RENAMED,
    Qwen3MoeConfig,
    _common_from_hf,
    family_terms,
    moe_size,
    tuner_facts,
)

NAME = "mixtral"  # the config's model.family
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
HF_RENAMED = {**QWEN3_HF_RENAMED, "num_experts": "num_local_experts"}
MIXTRAL_VOCAB_SIZE = 32000
MIXTRAL_SEQ_LENGTH = 32768  # Mixtral's training context

# The published Mixtral-8x7B-v0.1 config.json (transformers' names: intermediate_size is each expert's width).
SIZES = {
    "mixtral-8x7b": moe_size(
        NAME,
        32,
        4096,
        32,
        8,
        14336,
        head_dim=128,
        moe_intermediate_size=14336,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.02,
        vocab_size=MIXTRAL_VOCAB_SIZE,
        seq_length=MIXTRAL_SEQ_LENGTH,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class MixtralConfig(Qwen3MoeConfig):
    """Mixtral architecture, convertible to and from ``transformers.MixtralConfig``.  ``intermediate_size`` (a dense
    layer's width) is unused: no layer is dense."""

    vocab_size: int = MIXTRAL_VOCAB_SIZE
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    moe_intermediate_size: int = 14336
    num_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.02
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5

    family = NAME
    qk_norm = False
    named_sizes = SIZES

    def __post_init__(self) -> None:
        super().__post_init__()
        fixed = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
        wrong = [f"{k}={getattr(self, k)!r}" for k, v in fixed.items() if getattr(self, k) != v]
        if wrong:
            raise ValueError(f"error: mixtral fixes {fixed}, got {', '.join(wrong)}; use the qwen3_moe family")

    def to_hf(self) -> Any:
        """The equivalent ``transformers.MixtralConfig`` (imported lazily)."""
        from transformers import MixtralConfig as HFConfig

        return HFConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.router_aux_loss_coef,
            router_jitter_noise=0.0,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_dropout=self.attention_dropout,
            initializer_range=self.initializer_range,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            sliding_window=None,
            hidden_act="silu",
            attn_implementation=self.attention,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> MixtralConfig:
        """From a ``transformers.MixtralConfig``; refuses settings this model does not implement."""
        unsupported = []
        if getattr(hf, "sliding_window", None) is not None:
            unsupported.append(f"sliding_window={hf.sliding_window}")
        if getattr(hf, "router_jitter_noise", 0.0):
            unsupported.append(f"router_jitter_noise={hf.router_jitter_noise}")
        if getattr(hf, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf.hidden_act}")
        if unsupported:
            raise ValueError(f"error: MixtralConfig: unsupported settings ({', '.join(unsupported)})")
        given = dict(
            _common_from_hf(hf, attention),
            moe_intermediate_size=hf.intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
        return cls(**read_fields(cls, hf, HF_RENAMED, **given))


FAMILY = Family(
    name=NAME,
    config=MixtralConfig,
    modeling="ds_megatron.model.mixtral.model",
    blocks="model.layers",
    # no q/k norm; no dense MLP (every layer routed)
    plan=tuple(r for r in PLAN if r.path not in ("self_attn.q_norm", "self_attn.k_norm", *DENSE_MLP)),
    attention="self_attn",
    layout=LAYOUT,
    hf_base_prefix="model",
    # Mixtral's published files: block_sparse_moe.experts.<e>.{w1,w3,w2}.weight (gate, up, down), the router at
    # block_sparse_moe.gate.weight
    hf_experts=HFExperts(module="block_sparse_moe", gate="w1", up="w3", down="w2"),
    hf_model_type="mixtral",
    hf_architecture="MixtralForCausalLM",
    sizes=SIZES,
    shape_renamed=SHAPE_RENAMED,
    hf_renamed=HF_RENAMED,
    mlp_matrices=3,
    block_terms=family_terms(qk_norm=False)[0],
    tuner=tuner_facts(MIXTRAL_VOCAB_SIZE, MIXTRAL_SEQ_LENGTH, qk_norm=False),
    routed=True,
    fixed_expert_fields=(
        ("norm_topk_prob", True),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", ()),
        ("shared_expert_intermediate_size", 0),
    ),
)
