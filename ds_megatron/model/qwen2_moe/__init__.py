"""The Qwen2-MoE family (Qwen2 technical report, 2024; Qwen1.5-MoE): Llama's decoder with biases on q, k and v
(no q/k norm, a head width of h / a), and routed MLPs of E SwiGLU experts, top k of a softmax router, not
renormalised by default (``norm_topk_prob`` false), beside a shared expert: a dense SwiGLU of
``shared_expert_intermediate_size`` that every token passes through, scaled per token by ``sigmoid(x w_g)``
(``shared_expert_gate``, h -> 1, no bias) and added to the routed output.  Layers dense by ``mlp_only_layers`` and
``decoder_sparse_step`` as Qwen3-MoE's.

One family of its own, not an option of ``qwen3_moe``: a family record names one transformers model type and
class, and Qwen2-MoE's attention (biases, no q/k norm, no head width of its own) and its shared expert are both
what ``Qwen3MoeForCausalLM`` does not have.  Its config is the Qwen3-MoE config with those settings (as Mixtral's
is); the torch side is the same MoE decoder (``model/qwen3_moe/model.py``), whose routed MLP
(``model/moe_layer.py``) adds the shared expert when the config has a width for it.  Stdlib only.

Under TP the shared expert is split as the dense MLP is (gate and up column-parallel, down row-parallel; under SP
its input all-gathered and its output reduce-scattered) and its gate replicated (under SP on the sequence shard,
its gradient summed over TP, the router's rule); under EP it is not dispatched: every rank runs it on its own
tokens.  Parameters, GEMMs and saved activations count it (``qwen3_moe.family_terms``); FLOPs on active parameters
(``flops.RoutedTerms``) include it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_megatron.model.family import (
    COLUMN,
    GATE,
    ROW,
    Family,
    HFExperts,
    PlanRow,
    hf_fields,
    read_fields,
)
from ds_megatron.model.qwen3_moe import (
    HF_RENAMED,
    LAYOUT,
    PLAN,
    SHAPE_RENAMED,
    TRAINING_ONLY,
    Qwen3MoeConfig,
    _common_from_hf,
    family_terms,
    moe_size,
    tuner_facts,
)

NAME = "qwen2_moe"  # the config's model.family
QWEN2_VOCAB_SIZE = 151936
QWEN2_SEQ_LENGTH = 4096  # the Qwen2 report's pretraining context (extended to 32768 at its end)


def _qwen2(layers: int, hidden: int, heads: int, kv: int, ffn: int, moe_ffn: int, shared: int, **moe: Any):
    """A published Qwen2-MoE config.json: E experts, top k not renormalised, one shared expert (no head width of
    its own: h / a, whatever the hidden size a run sets)."""
    return moe_size(
        NAME,
        layers,
        hidden,
        heads,
        kv,
        ffn,
        moe_intermediate_size=moe_ffn,
        shared_expert_intermediate_size=shared,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.001,
        vocab_size=QWEN2_VOCAB_SIZE,
        seq_length=QWEN2_SEQ_LENGTH,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        **moe,
    )


SIZES = {
    # 60 experts of 1408, top 4, a shared expert of 5632 (four experts' width): 14.3B parameters, 2.7B active
    "qwen1.5-moe-a2.7b": _qwen2(
        24, 2048, 16, 16, 5632, 1408, 5632, num_experts=60, num_experts_per_tok=4, max_position_embeddings=8192
    ),
    # 64 experts of 2560, top 8, a shared expert of 20480: 57B parameters, 14B active
    "qwen2-57b-a14b": _qwen2(
        28, 3584, 28, 4, 18944, 2560, 20480, num_experts=64, num_experts_per_tok=8, max_position_embeddings=131072
    ),
    # for tests and laptops: 4 experts of width 32, top 2, a shared expert of 64, one dense layer
    "qwen2-moe-tiny": moe_size(
        NAME,
        3,
        64,
        4,
        2,
        96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.01,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Qwen2MoeConfig(Qwen3MoeConfig):
    """Qwen2-MoE architecture, convertible to and from ``transformers.Qwen2MoeConfig`` (Qwen1.5-MoE-A2.7B's shape by
    default).  ``head_dim`` is h / a: transformers' Qwen2-MoE has no head width of its own."""

    vocab_size: int = QWEN2_VOCAB_SIZE
    hidden_size: int = 2048
    num_layers: int = 24
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 128
    intermediate_size: int = 5632
    moe_intermediate_size: int = 1408
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = False
    max_position_embeddings: int = 8192
    shared_expert_intermediate_size: int = 5632  # the shared expert's SwiGLU width

    family = NAME
    qk_norm = False
    qkv_bias = True  # biases on q, k and v (Qwen2's attention)
    own_head_dim = False  # heads of hidden_size / num_heads (the config loader refuses another head_dim)
    named_sizes = SIZES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(
                f"error: qwen2_moe: head_dim ({self.head_dim}) must be hidden_size / num_heads "
                f"({self.hidden_size} / {self.num_heads}); transformers' Qwen2-MoE has no head width of its own"
            )
        if self.shared_expert_intermediate_size <= 0:
            raise ValueError(
                f"error: qwen2_moe: shared_expert_intermediate_size ({self.shared_expert_intermediate_size}) must be "
                "positive; every routed layer of Qwen2-MoE has a shared expert"
            )

    def to_hf(self) -> Any:
        """The equivalent ``transformers.Qwen2MoeConfig`` (imported lazily)."""
        from transformers import Qwen2MoeConfig as HFConfig

        return HFConfig(
            **hf_fields(self, HF_RENAMED, skip=("rope_theta", "mlp_only_layers", "head_dim", *TRAINING_ONLY)),
            mlp_only_layers=list(self.mlp_only_layers),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            hidden_act="silu",
            qkv_bias=True,
            use_sliding_window=False,
            attn_implementation=self.attention,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> Qwen2MoeConfig:
        """From a ``transformers.Qwen2MoeConfig``; refuses settings this model does not implement."""
        unsupported = [f"{flag}=True" for flag in ("use_sliding_window",) if getattr(hf, flag, False)]
        if not getattr(hf, "qkv_bias", True):
            unsupported.append("qkv_bias=False")
        if getattr(hf, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf.hidden_act}")
        kind = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
        if kind != "default":
            unsupported.append(f"rope_type={kind}")
        if unsupported:
            raise ValueError(f"error: {cls.__name__}: unsupported settings ({', '.join(unsupported)})")
        given = _common_from_hf(hf, attention)
        given["head_dim"] = hf.hidden_size // hf.num_attention_heads  # what its attention uses
        return cls(**read_fields(cls, hf, HF_RENAMED, **given))


# Qwen3-MoE's plan without the q/k norms, plus the shared expert: split as the dense MLP (gate and up column-parallel
# with one input collective, down row-parallel) and its gate replicated on the block's stream.  The q/k/v biases
# follow their weights' rows (column-parallel).
SHARED_EXPERT_ROWS = (
    PlanRow("mlp.shared_expert.gate_proj", COLUMN, group="shared_gate_up"),
    PlanRow("mlp.shared_expert.up_proj", COLUMN, group="shared_gate_up"),
    PlanRow("mlp.shared_expert.down_proj", ROW),
    PlanRow("mlp.shared_expert_gate", GATE),
)
PLAN = tuple(r for r in PLAN if r.path not in ("self_attn.q_norm", "self_attn.k_norm")) + SHARED_EXPERT_ROWS
_TERMS = dict(qk_norm=False, qkv_bias=True)

FAMILY = Family(
    name=NAME,
    config=Qwen2MoeConfig,
    modeling="ds_megatron.model.qwen2_moe.model",
    blocks="model.layers",
    plan=PLAN,
    attention="self_attn",
    layout=LAYOUT,
    hf_base_prefix="model",
    # mlp.experts.<e>.{gate,up,down}_proj.weight, the router at mlp.gate.weight; the shared expert's linears
    # (mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight) are stored as they are held
    hf_experts=HFExperts(),
    hf_model_type="qwen2_moe",
    hf_architecture="Qwen2MoeForCausalLM",
    sizes=SIZES,
    shape_renamed=SHAPE_RENAMED,
    hf_renamed=HF_RENAMED,
    mlp_matrices=3,
    block_terms=family_terms(**_TERMS)[0],
    tuner=tuner_facts(QWEN2_VOCAB_SIZE, QWEN2_SEQ_LENGTH, **_TERMS),
    routed=True,
)
