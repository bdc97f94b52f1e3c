"""The Qwen3-MoE family (Qwen3 technical report, 2025): Llama's decoder (RMSNorm, rotary positions, grouped-query
attention, no biases) with an RMSNorm over each query and key head before the rotation, a head width of its own
(``head_dim``, not h / a), and routed MLPs: E SwiGLU experts, top-k of a softmax router, renormalised when
``norm_topk_prob``; a layer is dense (a SwiGLU of ``intermediate_size``) when it is in ``mlp_only_layers`` or off the
``decoder_sparse_step``.  The Mixtral family (``model/mixtral``) is this config with Llama's attention and all layers
sparse; both share the torch side (``model.py`` here, the routed MLP in ``model/moe_layer.py``).

Config, plan, pipeline layout, transformers names, and what the analytic tuner and memory model count for a routed
block: its parameters (every expert stored), its saved activations and its GEMMs (k experts per token), stdlib only.
The FLOPs of a routed block are ``flops.RoutedTerms`` (active parameters)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ds_megatron.model.family import (
    COLUMN,
    EXPERTS,
    NORM,
    OUTPUT,
    ROUTER,
    ROW,
    VOCAB,
    BlockTerms,
    Family,
    Gemm,
    HFExperts,
    LayoutTable,
    NamedShape,
    PlanRow,
    RoutedShape,
    TunerFacts,
    check_experts_per_token,
    hf_fields,
    read_fields,
)
from ds_megatron.model.llama import HF_RENAMED as LLAMA_HF_RENAMED
from ds_megatron.model.llama import SHAPE_RENAMED as LLAMA_SHAPE_RENAMED

NAME = "qwen3_moe"  # the config's model.family
# Llama's decoder: its config fields are spelt as Llama's are, in ModelShape and in transformers' config; the
# top-k is ModelShape's ``experts_per_token``.
SHAPE_RENAMED = {**LLAMA_SHAPE_RENAMED, "num_experts_per_tok": "experts_per_token"}
HF_RENAMED = LLAMA_HF_RENAMED
# The routed MLP's fields, as a named size gives them (NamedShape.family_fields; ModelShape spells them through
# SHAPE_RENAMED, config.shape.EXPERT_FIELDS).
MOE_FIELDS = (
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)
# Fields transformers' config has no counterpart of: they shape training only (its model is dropless, without z-loss).
TRAINING_ONLY = ("router_z_loss_coef", "moe_capacity_factor")
QWEN3_VOCAB_SIZE = 151936
QWEN3_SEQ_LENGTH = 4096  # the report's general pretraining stage


def moe_size(family: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, **moe: Any) -> NamedShape:
    """A named size with its family fields (``moe``: MOE_FIELDS and the rest of NamedShape's keywords)."""
    shape_keys = {"vocab_size", "seq_length", "max_position_embeddings", "rope_theta", "tie_word_embeddings"}
    shape = {k: moe.pop(k) for k in list(moe) if k in shape_keys}
    return NamedShape(family, layers, hidden, heads, kv, ffn, **shape, family_fields=tuple(sorted(moe.items())))


def _qwen3(layers: int, hidden: int, heads: int, ffn: int, moe_ffn: int) -> NamedShape:
    """The published Qwen3-MoE config.json: 4 KV heads of width 128, 128 experts, top 8 renormalised."""
    return moe_size(
        NAME,
        layers,
        hidden,
        heads,
        4,
        ffn,
        head_dim=128,
        moe_intermediate_size=moe_ffn,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.001,
        vocab_size=QWEN3_VOCAB_SIZE,
        seq_length=QWEN3_SEQ_LENGTH,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


SIZES = {
    "qwen3-30b-a3b": _qwen3(48, 2048, 32, 6144, 768),
    "qwen3-235b-a22b": _qwen3(94, 4096, 64, 12288, 1536),
    # for laptops and tests: 8 experts of width 64, top 2, one dense layer (vocabulary from the tokenizer)
    "moe-tiny": moe_size(
        NAME,
        4,
        128,
        4,
        2,
        352,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.01,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE architecture, convertible to and from ``transformers.Qwen3MoeConfig``."""

    vocab_size: int = QWEN3_VOCAB_SIZE
    hidden_size: int = 2048  # h
    num_layers: int = 48  # L
    num_heads: int = 32  # a
    num_kv_heads: int = 4
    head_dim: int = 128  # d: q_proj is h -> a d
    intermediate_size: int = 6144  # the dense layers' SwiGLU width
    moe_intermediate_size: int = 768  # each expert's SwiGLU width
    num_experts: int = 128  # E
    num_experts_per_tok: int = 8  # k
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum 1
    decoder_sparse_step: int = 1  # layer i is routed when (i + 1) % step == 0 (and not in mlp_only_layers)
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in the training loss
    router_z_loss_coef: float = 0.0  # the router z-loss's weight (0: off; transformers has none)
    moe_capacity_factor: float = 0.0  # training-time token dropping (0: dropless; transformers is dropless)
    max_position_embeddings: int = 40960
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    attention: str = "eager"  # "eager" or "sdpa"

    family = NAME
    qk_norm = True  # an RMSNorm over each query and key head (Qwen3); Mixtral has none
    rope_scaling = None  # no rope scaling in the published models (the rotary tables take it as an argument)
    named_sizes = SIZES  # the family's named sizes (what from_shape reads the experts' layout off)

    def __post_init__(self) -> None:
        e, k, step = self.num_experts, self.num_experts_per_tok, self.decoder_sparse_step
        check_experts_per_token(k, e)
        if step < 1:
            raise ValueError(f"error: decoder_sparse_step ({step}) must be >= 1; use 1 for every layer routed")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"error: num_heads ({self.num_heads}) is not divisible by num_kv_heads ({self.num_kv_heads})"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has the routed MLP (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    attn_pdrop = property(lambda self: self.attention_dropout)
    n_layer = property(lambda self: self.num_layers)
    n_embd = property(lambda self: self.hidden_size)

    def to_hf(self) -> Any:
        """The equivalent ``transformers.Qwen3MoeConfig`` (imported lazily)."""
        from transformers import Qwen3MoeConfig as HFConfig

        return HFConfig(
            **hf_fields(self, HF_RENAMED, skip=("rope_theta", "mlp_only_layers", *TRAINING_ONLY)),
            mlp_only_layers=list(self.mlp_only_layers),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            hidden_act="silu",
            attention_bias=False,
            use_sliding_window=False,
            attn_implementation=self.attention,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    @classmethod
    def from_shape(cls, m: Any) -> Qwen3MoeConfig:
        """From a resolved model shape (``ds_megatron.config.ModelShape``, the experts' layout included)."""
        return cls(**read_fields(cls, m, SHAPE_RENAMED, attention=m.attention))

    @classmethod
    def from_hf(cls, hf: Any, attention: str = "eager") -> Qwen3MoeConfig:
        """From a ``transformers.Qwen3MoeConfig``; refuses settings this model does not implement."""
        unsupported = [f"{flag}=True" for flag in ("attention_bias", "use_sliding_window") if getattr(hf, flag, False)]
        if getattr(hf, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf.hidden_act}")
        kind = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
        if kind != "default":
            unsupported.append(f"rope_type={kind}")
        if unsupported:
            raise ValueError(f"error: {cls.__name__}: unsupported settings ({', '.join(unsupported)})")
        return cls(**read_fields(cls, hf, HF_RENAMED, **_common_from_hf(hf, attention)))


def _common_from_hf(hf: Any, attention: str) -> dict[str, Any]:
    """The fields both MoE families read off a transformers config the same way."""
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return dict(
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
        rope_theta=float(theta),
        router_z_loss_coef=0.0,
        moe_capacity_factor=0.0,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
        attention=attention,
    )


# Attention as Llama's (q, k, v column-parallel by heads, o_proj row-parallel); q_norm and k_norm act on one head's
# width and are replicated (each TP rank's heads contribute to their gradients: summed over TP); the dense layers'
# MLP as Llama's.  The routed MLP: the router replicated (under SP it routes this rank's sequence shard, its gradient
# summed over TP like a norm's), every expert split over TP as the dense MLP is (expert TP = tp).  A block holds
# either the dense rows or the routed ones (``is_sparse``).
PLAN: tuple[PlanRow, ...] = (
    PlanRow("self_attn.q_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.k_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.v_proj", COLUMN, group="qkv"),
    PlanRow("self_attn.o_proj", ROW),
    PlanRow("self_attn.q_norm", NORM),
    PlanRow("self_attn.k_norm", NORM),
    PlanRow("mlp.gate_proj", COLUMN, group="gate_up"),
    PlanRow("mlp.up_proj", COLUMN, group="gate_up"),
    PlanRow("mlp.down_proj", ROW),
    PlanRow("mlp.gate", ROUTER),
    PlanRow("mlp.experts", EXPERTS),
    PlanRow("input_layernorm", NORM),
    PlanRow("post_attention_layernorm", NORM),
    PlanRow("model.embed_tokens", VOCAB),
    PlanRow("model.norm", NORM),
    PlanRow("lm_head", OUTPUT),
)

LAYOUT = LayoutTable(
    embedding=("model.embed_tokens", "embed_tokens"),
    positions=None,
    final_norm=("model.norm", "norm"),
    output=("lm_head", "lm_head"),
    tied_key="embed_tokens",
)


RSTD_BYTES = 4  # an RMSNorm's fp32 1/rms per row (the block's norms, and Qwen3's q/k norms per head)
ROUTER_BYTES = 4  # the router runs in fp32 whatever the activations (moe_layer.TopKRouter)
INDEX_BYTES = 8  # int64 expert choices and sort orders
OFFSET_BYTES = 4  # the grouped GEMM's int32 end row per expert


def routed_block_params(
    h: int, tp: int, r: RoutedShape, qk_norm: bool, qkv_bias: bool = False, ep: int = 1, expert_tp: int = 1
) -> int:  # fmt: skip
    """One routed block's parameters per TP rank: q, k, v and o_proj split over TP (a d and k d wide; Qwen2's q, k
    and v biases with their rows), every expert's gate, up and down split over TP as ``tensor_parallel.experts``
    does (3 E h F / t), a shared expert's gate, up and down split as the dense MLP (3 h F_s / t), the router [E, h],
    the shared expert's gate [1, h] and the two RMSNorms (and Qwen3's q/k norms, one head wide each) replicated.
    All E experts are stored; at ep > 1 E / ep whole experts instead (``expert_parallel.layer``: not split over
    TP), 3 E h F / ep, or with ``expert_tp`` = tp each of them split over TP too, 3 E h F / (ep t)."""
    split = 2 * h * r.q_width + 2 * h * r.kv_width + 3 * h * r.shared_width
    split += (r.q_width + 2 * r.kv_width) if qkv_bias else 0
    replicated = r.num_experts * h + 2 * h + (2 * r.head_dim if qk_norm else 0) + (h if r.shared_width else 0)
    if ep > 1:
        return split // tp + r.expert_params(h) // (ep * expert_tp) + replicated
    return (split + r.expert_params(h)) // tp + replicated


def active_block_params(h: int, r: RoutedShape, qk_norm: bool, qkv_bias: bool = False) -> int:
    """One routed block's parameters a token passes through (k of the E experts, the whole router, the shared
    expert and its gate): what a model card's "active" counts."""
    dense_experts = r._replace(num_experts=r.top_k)
    return routed_block_params(h, 1, dense_experts, qk_norm, qkv_bias) - r.top_k * h + r.num_experts * h


def routed_block_gemms(
    n: int, h: int, t: int, r: RoutedShape, ep: int | None = None, expert_tp: int = 1
) -> tuple[Gemm, ...]:  # fmt: skip
    """The weight matmuls of one routed block's forward over n tokens, per TP rank: attention as Llama's at head
    width d, the router (n x h by h x E, replicated: each rank routes its sequence shard under SP, all n without;
    counted at n, its fp32 ignored), and k experts per token.  ``ep`` None: the n k routed rows as one GEMM through
    gate|up, F/t wide, and down.  ``ep`` given: one GEMM per expert the rank holds, at its share of the tokens under
    uniform routing (the grouped GEMM reads every expert's weights): at ep 1 all E experts, F/t wide, on the n
    tokens the rank routes (n k / E rows each); at ep > 1 its E / ep whole experts (F wide) on the tokens of the
    whole EP group, each rank holding n / t of them under SP (n without, at tp 1): ep n k / (t E) rows each; with
    ``expert_tp`` = t, F / t of each of them on the tokens every TP rank runs (n, gathered over TP): ep n k / E rows
    each.  A shared expert (Qwen2-MoE) runs on the rank's n tokens, split over TP as the dense MLP."""
    rows, experts, width = n * r.top_k, 1, r.width // t
    if ep is not None:
        experts = r.num_experts if ep == 1 else r.num_experts // ep
        tokens_split = t // expert_tp  # at ep > 1: t with whole experts (each rank its own tokens), 1 when split
        rows = n * r.top_k / r.num_experts if ep == 1 else ep * n * r.top_k / (tokens_split * r.num_experts)
        width = r.width // t if ep == 1 else r.width // expert_tp
    shared = (
        (
            ("shared expert gate, up", n, h, r.shared_width // t, 2),
            ("shared expert down", n, r.shared_width // t, h, 1),
            ("shared expert's gate", n, h, 1, 1),
        )
        if r.shared_width
        else ()
    )
    return (
        ("q", n, h, r.q_width // t, 1),
        ("k, v", n, h, r.kv_width // t, 2),
        ("o_proj", n, r.q_width // t, h, 1),
        ("router", n, h, r.num_experts, 1),
        ("experts gate, up", rows, h, width, 2 * experts),
        ("experts down", rows, width, h, experts),
        *shared,
    )


def routed_block_terms(
    h: int, a: int, _kv: int | None, _f: int | None, attention_dropout: float | None, act: int, *, routed: RoutedShape,
    qk_norm: bool,
) -> BlockTerms:  # fmt: skip
    """One routed block's saved tensors (units of s*b*h bytes), counted off what autograd saves (measured to the byte
    by ``tests/unit/test_memory_moe.py``), a heads and k KV heads of width d, E experts of width F, top k:
    - replicated under TP, split by SP: the two RMSNorm inputs (2 h) and their fp32 1/rms, the q/k/v input (h);
      the router's fp32 copy of its input (4 h bytes: the bf16 norm output itself is kept by nothing), its fp32
      logits and probabilities (4 E bytes each), the log-sum-exp of the z statistic (4), the top-k indices (8 k)
      and, with ``norm_topk_prob``, the top-k weights and their sum (4 k + 4).  The router runs on the sequence
      shard under SP.
    - split by TP: Q, K, V (a d + 2 k d), the o_proj input (a d), Qwen3's q/k norm inputs (a d + k d) and their
      fp32 1/rms per head (4 (a + k) bytes); the experts' gate|up output (2 k F per token), SwiGLU's silu(gate)
      and its product (k F each, the down projection's input): 4 k F, ``moe_split``.
    - whole on every TP rank (``whole``, all dropped by ``moe``): the routed copies of the tokens (k h), the
      expert outputs (k h, kept by the combine for the weights' gradient, in their own dtype although it sums in
      fp32: ``moe_layer.weighted_sum``), the pair order and token index (8 k bytes each) and each pair's weight
      (4 k).  Under SP the experts run on all
      s b tokens (all-gathered), so these are not split; without SP every rank routes all tokens.
    - ``moe`` keeps the checkpoint's inputs: the tokens (h, whole; in fp32 without SP the router's input itself,
      counted above) and routing weights (4 k), and under SP the gathered expert indices (8 k) its function holds.
    - per block: the router weight's fp32 copy (4 E h bytes, bf16 runs only) and the grouped GEMM's offsets (4 E).
    - a shared expert of width F_s (Qwen2-MoE), split by TP as the dense MLP: gate and up and the down projection's
      input (3 F_s, split; ``mlp_act`` drops F_s), and on the stream (replicated, split by SP) the expert's output
      kept by the gate's product (h), the sigmoid (1) and its input, the norm output (h; in fp32 the router's
      input itself, counted above), which ``layernorm`` drops and without SP is the ``moe`` checkpoint's tokens.
    - at ep > 1 (``ep_whole``): the dispatch's permutations to and from expert order (``expert_parallel.dispatch``:
      8 k bytes each per routed token, the pairs a rank receives being as many as it sends under uniform routing).
    The s^2 terms are the shared ones (a heads).  The MLP activation hook (``mlp_act``) does not touch a routed
    MLP; ``layernorm`` drops the q/k/v input and the MLP's norm output where something counted keeps it: the
    router's input in fp32, the ``moe`` checkpoint's tokens without SP (``moe_kept_norm``); a bf16 router keeps its
    own fp32 copy, which stays."""
    r, e, k = routed, routed.num_experts, routed.top_k
    router = ROUTER_BYTES * h + 2 * ROUTER_BYTES * e + ROUTER_BYTES + INDEX_BYTES * k
    router += (ROUTER_BYTES * k + ROUTER_BYTES) if r.norm_topk_prob else 0
    replicated = (3 * act * h + 2 * RSTD_BYTES + router) / h
    qk = ((r.q_width + r.kv_width) * act + RSTD_BYTES * (r.num_heads + r.num_kv_heads)) if qk_norm else 0
    experts_split = 4 * k * r.width * act / h
    split = (2 * r.q_width + 2 * r.kv_width) * act / h + qk / h + experts_split
    whole = (2 * k * h * act + 2 * INDEX_BYTES * k + ROUTER_BYTES * k) / h
    # The checkpoint's tokens: the norm output, already counted when the router's fp32 copy is that very tensor
    # (fp32 activations, all tokens on the rank); under SP the all-gathered tokens, a tensor of their own.
    shared = act == ROUTER_BYTES
    kept = (ROUTER_BYTES * k + (0 if shared else h * act)) / h
    kept_sp = (INDEX_BYTES * k + (h * act if shared else 0)) / h
    fixed_offsets = OFFSET_BYTES * e
    fixed = (ROUTER_BYTES * e * h if act != ROUTER_BYTES else 0) + fixed_offsets
    norm_outputs, kept_norm, kept_counted, mlp_act = (2.0 if shared else 1.0), (0.0 if shared else act), 0.0, 0.0
    if r.shared_width:  # the shared expert: a dense SwiGLU split over TP, its gate and product on the stream
        f_s = r.shared_width
        # its input, the norm output (already counted in fp32: the router's input itself), the expert's output
        # that the gate's product keeps, and the gate's sigmoid (one per token)
        replicated += ((0 if shared else h * act) + h * act + act) / h
        split += 3 * f_s * act / h  # gate and up (SwiGLU's saved inputs) and the down projection's input
        mlp_act = f_s / h  # "mlp_act" recomputes the down projection's input
        norm_outputs, kept_norm = 2.0, 0.0  # "layernorm" drops the norm output the shared expert keeps
        kept_counted = 0.0 if shared else act  # without SP the moe checkpoint's tokens are that same norm output
    return BlockTerms(
        replicated, 0, split, (r.q_width + 2 * r.kv_width) / h, bool(attention_dropout), mlp_act,
        whole=whole, moe_split=experts_split, moe_whole=whole, moe_kept=kept, moe_kept_sp=kept_sp,
        fixed=fixed, moe_fixed=fixed_offsets, norm_outputs=norm_outputs, moe_kept_norm=kept_norm,
        moe_kept_counted=kept_counted, ep_whole=2 * INDEX_BYTES * k / h,
    )  # fmt: skip


def dense_block_params(h: int, f: int, tp: int, r: RoutedShape, qk_norm: bool, qkv_bias: bool = False) -> int:
    """One dense block of a routed family (a layer of ``mlp_only_layers`` or off ``decoder_sparse_step``) per TP
    rank: the routed block's attention (q, k, v, o_proj split over TP, Qwen2's biases with their rows, Qwen3's q/k
    norms replicated), a SwiGLU of the dense width F (3 h F / t) and the two RMSNorms."""
    split = 2 * h * r.q_width + 2 * h * r.kv_width + 3 * h * f + ((r.q_width + 2 * r.kv_width) if qkv_bias else 0)
    return split // tp + 2 * h + (2 * r.head_dim if qk_norm else 0)


def dense_block_gemms(n: int, h: int, f: int, t: int, r: RoutedShape) -> tuple[Gemm, ...]:
    """The weight matmuls of one dense block of a routed family over n tokens, per TP rank: the routed block's
    attention at head width d and a SwiGLU of the dense width F (Llama's)."""
    return (
        ("q", n, h, r.q_width // t, 1),
        ("k, v", n, h, r.kv_width // t, 2),
        ("o_proj", n, r.q_width // t, h, 1),
        ("gate, up", n, h, f // t, 2),
        ("down", n, f // t, h, 1),
    )


def dense_block_terms(
    h: int, f: int, attention_dropout: float | None, act: int, r: RoutedShape, qk_norm: bool
) -> BlockTerms:
    """One dense block of a routed family's saved tensors (units of s*b*h bytes): the routed block's attention terms
    (``routed_block_terms``: two RMSNorm inputs and their fp32 1/rms, the q/k/v input, replicated; Q, K, V, the
    o_proj input and Qwen3's q/k norm inputs and 1/rms, split by TP) and Llama's SwiGLU of the dense width F: its
    gate/up input (the norm output, h, replicated), gate and up and the down projection's input (3 F, split; F
    dropped by ``mlp_act``).  ``layernorm`` drops both norm outputs; ``moe`` touches nothing here."""
    qk = ((r.q_width + r.kv_width) * act + RSTD_BYTES * (r.num_heads + r.num_kv_heads)) if qk_norm else 0
    replicated = (4 * act * h + 2 * RSTD_BYTES) / h
    split = ((2 * r.q_width + 2 * r.kv_width + 3 * f) * act + qk) / h
    return BlockTerms(replicated, 0, split, (r.q_width + 2 * r.kv_width) / h, bool(attention_dropout), f / h)


def _needs_routed(routed: RoutedShape | None) -> RoutedShape:
    if routed is None:
        raise ValueError("a routed family's terms need its experts' layout (routed=RoutedShape.of(model))")
    return routed


def family_terms(
    qk_norm: bool, qkv_bias: bool = False
) -> tuple[Callable[..., BlockTerms], Callable[..., int], Callable[..., tuple]]:
    """(block_terms, block_params, block_gemms) of a routed family, in the family record's signatures plus the
    keywords ``routed`` (a ``RoutedShape``) and ``dense``: True for a dense block of the family (a layer of
    ``mlp_only_layers`` or off ``decoder_sparse_step``: a SwiGLU of the dense width f, whatever ep), else routed;
    ``expert_tp`` (at ep > 1): t when each expert is split over TP, 1 for whole experts."""

    def terms(h, a, kv, f, dropout, act, *, routed=None, dense=False):
        if dense:
            return dense_block_terms(h, f, dropout, act, _needs_routed(routed), qk_norm)
        return routed_block_terms(h, a, kv, f, dropout, act, routed=_needs_routed(routed), qk_norm=qk_norm)

    def params(h, _kv, f, tp, *, routed=None, ep=1, expert_tp=1, dense=False):
        if dense:
            return dense_block_params(h, f, tp, _needs_routed(routed), qk_norm, qkv_bias)
        return routed_block_params(h, tp, _needs_routed(routed), qk_norm, qkv_bias, ep, expert_tp)

    def gemms(n, h, _kv, f, t, *, routed=None, ep=None, expert_tp=1, dense=False):
        if dense:
            return dense_block_gemms(n, h, f, t, _needs_routed(routed))
        return routed_block_gemms(n, h, t, _needs_routed(routed), ep, expert_tp)

    return terms, params, gemms


def tuner_facts(vocab: int, seq_length: int, qk_norm: bool, qkv_bias: bool = False) -> TunerFacts:
    """The MoE families' tuner record: no dropout, RMSNorm, the routed block's terms."""
    _, params, gemms = family_terms(qk_norm, qkv_bias)
    return TunerFacts(
        default_vocab=vocab,
        default_seq_length=seq_length,
        dropout=0.0,
        attention_dropout_only=True,
        norm_params=1,
        norm_stat_bytes=RSTD_BYTES,
        block_params=params,
        block_gemms=gemms,
        # ``layernorm`` re-runs both norms (the router's fp32 copy of the second's output stays stored in bf16)
        recomputed_passes={"layernorm": (("RMSNorm before attention", 1, 1), ("RMSNorm before the MLP", 1, 1))},
    )


FAMILY = Family(
    name=NAME,
    config=Qwen3MoeConfig,
    modeling="ds_megatron.model.qwen3_moe.model",
    blocks="model.layers",
    plan=PLAN,
    attention="self_attn",
    layout=LAYOUT,
    hf_base_prefix="model",
    hf_experts=HFExperts(),  # mlp.experts.<e>.{gate,up,down}_proj.weight, the router at mlp.gate.weight
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    sizes=SIZES,
    shape_renamed=SHAPE_RENAMED,
    hf_renamed=HF_RENAMED,
    mlp_matrices=3,
    block_terms=family_terms(qk_norm=True)[0],
    tuner=tuner_facts(QWEN3_VOCAB_SIZE, QWEN3_SEQ_LENGTH, qk_norm=True),
    routed=True,
    fixed_expert_fields=(("shared_expert_intermediate_size", 0),),  # no shared expert (Qwen2-MoE's family has one)
)
