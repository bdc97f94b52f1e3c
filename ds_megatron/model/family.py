"""What a model family is: the record each family folder fills in (``model/<family>/__init__.py``) and the registry
(``ds_megatron.model.FAMILIES``) hands to every other module.  Standard library only.  The torch side is the
``modeling`` module's ``MODELING`` (``model.layers.Modeling``: model, block, final norm, initialiser)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

COLUMN, ROW, VOCAB, OUTPUT, POSITION, NORM = "column", "row", "vocab", "output", "position", "norm"
EXPERTS, ROUTER, GATE = "experts", "router", "gate"
# The stacked experts' tensors ([E, out, in] each) and the dim TP splits: each expert's gate|up rows (two fused
# blocks, column-parallel) and its down columns (row-parallel), as the dense SwiGLU's.
EXPERT_SPLITS = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}


@dataclass(frozen=True)
class PlanRow:
    """One module of a family's parallel plan.  ``path``: the module inside a block (``attn.c_attn``) or the model
    (``transformer.wte``).  ``style``:
      column   ColumnParallelLinear: weight and bias split on the output dim (``fused`` blocks, e.g. q|k|v, by heads)
      row      RowParallelLinear: weight split on the input dim, bias replicated (summed over TP under SP)
      vocab    VocabParallelEmbedding: rows split in vocabulary blocks, padded to vocab_multiple x tp; tied output
      output   VocabParallelOutput: an untied output layer, split and padded like the embedding
      position learned position table, replicated; each rank looks up its own sequence chunk under SP
      norm     LayerNorm or RMSNorm, replicated; sees a sequence shard under SP (gradients summed over TP)
      experts  the routed MLP's stacked experts: every expert split as the dense MLP is (EXPERT_SPLITS)
      router   the routed MLP's router, replicated; routes the sequence shard under SP (gradients summed over TP)
      gate     a replicated linear on the block's stream (the shared expert's sigmoid gate): sees the sequence shard
               under SP (gradients summed over TP), the router's rule
    ``group``: column rows of one module with the same group share their input's collective (one all-gather under
    SP for q, k and v; one for gate and up)."""

    path: str
    style: str
    fused: int = 1
    group: str | None = None


@dataclass(frozen=True)
class LayoutTable:
    """Where a family's non-block parameters sit in the pipeline.  A slot is (module path in the full model, the
    attribute the pipeline layer keeps it under): the full name of the layer's key ``<attr>.<leaf>`` is
    ``<path>.<leaf>``.  ``positions``: a learned position table (with the embedding dropout after it; the config
    then has ``n_positions`` and ``embd_pdrop``), None for rotary positions."""

    embedding: tuple[str, str]
    positions: tuple[str, str] | None
    final_norm: tuple[str, str]
    output: tuple[str, str]  # the untied output layer (unused when tied)
    tied_key: str  # TiedLayerSpec key of the tied embedding


class BlockTerms(NamedTuple):
    """One block's stored tensors outside the attention core's s^2 terms, in units of s*b*h (``memory.py``)."""

    replicated: float  # bytes replicated under TP, split by SP, in activation dtype (plus fp32 norm statistics)
    replicated_masks: int  # dropout masks, placed like the above (mask_bytes each)
    split: float  # bytes split by TP, in activation dtype
    qkv: float  # Q, K and V in units of h elements (what the sdpa math path saves again in its own dtype)
    attention_dropout: bool  # the core has a dropout (its output and mask are s^2 terms)
    mlp_act: float  # the MLP activation's output (the second linear's input), units of h; "mlp_act" drops it
    # Routed blocks only (0 for a dense one).  ``whole``: bytes every TP rank keeps for all s*b tokens, SP or not
    # (the routed copies: under SP the experts run on the all-gathered tokens, and their h-wide tensors are not
    # split by TP).  ``moe_split`` / ``moe_whole``: what selective ``moe`` drops of ``split`` / ``whole``;
    # ``moe_kept``: what its checkpoint keeps instead (its inputs: the tokens and routing weights, whole), and
    # ``moe_kept_sp`` more under SP (the gathered expert indices its function holds).  ``fixed``: bytes per block
    # whatever the tokens (the router weight's fp32 copy, the grouped GEMM's offsets), ``moe_fixed`` of it dropped
    # by ``moe``.  ``norm_outputs``: the norm outputs (units of h, activation bytes) ``layernorm`` drops.
    whole: float = 0.0
    moe_split: float = 0.0
    moe_whole: float = 0.0
    moe_kept: float = 0.0
    moe_kept_sp: float = 0.0
    fixed: float = 0.0
    moe_fixed: float = 0.0
    norm_outputs: float = 2.0
    moe_kept_norm: float = 0.0  # of moe_kept, the norm output itself (without SP), which "layernorm" also drops
    # of moe_kept, what a term above already counts without SP (a shared expert's input: the norm output itself)
    moe_kept_counted: float = 0.0
    # At ep > 1 (``expert_parallel``), per token this rank routes, besides ``whole``: the dispatch's two row
    # permutations (int64 per routed pair) that its index_selects keep.
    ep_whole: float = 0.0


class RoutedShape(NamedTuple):
    """What a routed family's memory, parameter and GEMM terms read besides h, a and the dense width: a head's
    width d (Qwen3's is not h / a), the KV heads, and the experts' layout.  ``of`` reads it off a resolved
    ``config.ModelShape``; the tuner passes it as ``routed=`` to a routed family's terms."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int  # E
    top_k: int  # k
    width: int  # each expert's SwiGLU width F
    norm_topk_prob: bool = True
    shared_width: int = 0  # the shared expert's SwiGLU width F_s (Qwen2-MoE); 0: none

    @classmethod
    def of(cls, shape: Any) -> RoutedShape | None:
        """From a resolved model shape; None for a dense one (no experts)."""
        if not getattr(shape, "num_experts", 0):
            return None
        return cls(
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.num_experts,
            shape.experts_per_token,
            shape.moe_intermediate_size,
            bool(shape.norm_topk_prob),
            getattr(shape, "shared_expert_intermediate_size", 0),
        )

    def expert_params(self, h: int) -> int:
        """Every expert's gate, up and down projections together: 3 E h F."""
        return 3 * self.num_experts * h * self.width

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim


def check_experts_per_token(top_k: int, num_experts: int) -> None:
    """A router picks 1..num_experts experts per token (the routed families' configs and both MoE layers)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"error: num_experts_per_tok={top_k} with num_experts={num_experts}; use 1..{num_experts}")


@dataclass(frozen=True)
class NamedShape:
    """Everything a named size fixes (``model.size``).  ``None`` fields are left to the config (vocabulary and
    sequence length of the small CPU shapes, which follow the tokenizer and the run)."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None  # grouped-query attention's KV heads
    intermediate_size: int | None = None  # the MLP's width
    vocab_size: int | None = None
    seq_length: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 scaling, as sorted (key, value) pairs
    tie_word_embeddings: bool | None = None
    learning_rate: float | None = None  # the published peak learning rate, where one is published
    # Fields only the family's own config has (head_dim, the experts' layout), as sorted (field, value) pairs.
    family_fields: tuple[tuple[str, Any], ...] = ()


Gemm = tuple[str, int, int, int, int]  # a block's matmul for the tuner: (name, m, k, n, count) m x k by k x n


@dataclass(frozen=True)
class TunerFacts:
    """What the analytic tuner (``ds_megatron.tune``) counts for a family besides its FLOPs and block terms."""

    default_vocab: int  # vocabulary when neither a named size nor a flag gives one
    default_seq_length: int  # sequence length likewise
    dropout: float | None  # the dropout the tuner models and writes (None: the loader's default)
    attention_dropout_only: bool  # the dropout is the attention's alone (else all are counted, as in the paper)
    norm_params: int  # parameters of one norm per h: LayerNorm's weight and bias 2, RMSNorm's weight 1
    norm_stat_bytes: int  # per token a norm keeps besides its input: RMSNorm's fp32 1/rms (the paper omits LayerNorm's)
    block_params: Callable[[int, int, int, int], int]  # (h, kv width, F, tp) -> one block's parameters per TP rank
    block_gemms: Callable[[int, int, int, int, int], tuple[Gemm, ...]]  # (tokens, h, kv width, F, tp) -> forward
    # Per selective-recompute module, the passes run again: (op, activations read, written) per output element.
    recomputed_passes: dict[str, tuple[tuple[str, int, int], ...]]


@dataclass(frozen=True)
class Family:
    """Everything that is one model family's, read by parallelize, pipeline, checkpoints, FLOPs, memory and tests."""

    name: str  # the config's ``model.family``
    config: type  # the single-device config: ``from_shape``, ``from_hf``, ``to_hf``, ``n_layer``, ``n_embd``
    modeling: str  # the module of the torch side, defining MODELING
    blocks: str  # full names of block i start with "<blocks>.<i>."
    plan: tuple[PlanRow, ...]
    attention: str  # the block's attention module (its ``core_attention`` is what selective recompute wraps)
    layout: LayoutTable
    hf_model_type: str  # transformers' ``model_type``
    hf_architecture: str  # transformers' model class, written to an exported ``config.json``
    mlp_matrices: int  # weight matrices of the MLP, each h x F (FLOPs)
    block_terms: Callable[..., BlockTerms]  # (h, a, num_kv_heads, intermediate_size, attention_dropout, act)
    tuner: TunerFacts
    sizes: dict[str, NamedShape]  # the family's named sizes (``model.size``)
    shape_renamed: dict[str, str]  # config fields that ``config.ModelShape`` spells otherwise (ours -> its)
    hf_renamed: dict[str, str]  # config fields that transformers' config spells otherwise (ours -> theirs)
    # Every head its own K and V and an MLP of width 4h: the shape is L, h, a alone (the formulas then default to
    # kv = h, F = 4h, the config refuses KV heads and MLP width); else both are the family's to choose.
    fixed_kv_and_width: bool = False
    hf_transposed: tuple[str, ...] = ()  # name suffixes transformers stores [in, out] (GPT-2's Conv1D)
    # transformers' ``base_model_prefix``: a file of the base model (``GPT2Model``, ``LlamaModel``; the Hub's own GPT-2
    # files) stores its names without it, and transformers adds it on load into the causal-LM class.
    hf_base_prefix: str = ""
    # Name suffixes of buffers some files store and transformers ignores on load (not parameters: causal masks,
    # rotary frequencies, recomputed from the config).
    hf_ignored: tuple[str, ...] = ()
    hf_experts: HFExperts | None = None  # how published files store the routed MLP's experts (MoE families)
    # Why DeepSpeed's automatic tensor parallelism for inference (init_inference without kernel injection) cannot
    # shard the exported model, or None when it can.
    no_autotp_inference: str | None = None
    # Why the training path (config, pipeline, tuner) does not take this family yet, or None when it does: the model
    # itself builds and runs (``model.build_model``).
    no_training: str | None = None
    # Mixture of experts: the family reads config.shape.EXPERT_FIELDS, and fixes these of them (ModelShape names)
    routed: bool = False
    fixed_expert_fields: tuple[tuple[str, Any], ...] = ()
    sp_dropouts: tuple[str, ...] = ()  # dropouts inside a block acting on the sequence-sharded stream under SP
    model_sp_dropouts: tuple[str, ...] = ()  # the same outside the blocks (paths from the model root)

    def torch_side(self) -> Any:
        """The family's ``Modeling`` (model, block, final norm, init); imports torch."""
        return importlib.import_module(self.modeling).MODELING

    @property
    def block_prefix(self) -> str:
        return self.blocks + "."

    @property
    def block_rows(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.plan if not self.is_model_row(r))

    @property
    def model_rows(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self.plan if self.is_model_row(r))

    def is_model_row(self, row: PlanRow) -> bool:
        root = self.blocks.split(".")[0] + "."
        return row.path.startswith(root) or row.style in (OUTPUT, VOCAB)

    def row(self, name: str) -> PlanRow | None:
        """The row of a full parameter name (``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj``;
        ``model.layers.1.mlp.experts.down_proj`` -> ``mlp.experts``)."""
        module = name.rsplit(".", 1)[0]
        if module.startswith(self.block_prefix):
            module = module[len(self.block_prefix) :].split(".", 1)[-1]
        return next((r for r in self.plan if r.path == module), None)

    def split_dim(self, name: str) -> int | None:
        """The dim along which TP splits the full parameter ``name``: 0 for column-parallel weights and biases and
        the vocabulary tables (output rows), 1 for a row-parallel weight (input columns); None when replicated.
        Initialisation draws along it too (``model.layers.seeded_normal_``), so a shard draws only its own slices."""
        row = self.row(name)
        if row is None:
            return None
        if row.style in (COLUMN, VOCAB, OUTPUT):
            return 0
        if row.style == EXPERTS:
            return EXPERT_SPLITS[name.rsplit(".", 1)[1]][0]
        return 1 if row.style == ROW and name.endswith(".weight") else None

    def hf_shape_fields(self) -> dict[str, str]:
        """transformers' config.json keys -> ``config.ModelShape`` fields, through the family's config fields."""
        return {
            self.hf_renamed.get(f, f): self.shape_renamed.get(f, f)
            for f in (f.name for f in fields(self.config))
            if f != "attention"
        }

    # Everything below names a tensor of a transformers file; the tensors themselves (transposes, the experts'
    # stacking, TP shards) are ``checkpoint/adapter.py``'s, the one reader of these names.
    def hf_canonical(self, stored: str) -> str | None:
        """A stored tensor's name as transformers' causal-LM class holds it on load: the base-model prefix added
        where a base model's file lacks it; None for an ignored buffer."""
        if self.hf_ignored and stored.endswith(self.hf_ignored):
            return None
        prefix = self.hf_base_prefix + "."
        if not self.hf_base_prefix or stored.startswith(prefix) or stored.startswith(HF_OUTPUT):
            return stored
        return prefix + stored

    def our_hf_name(self, stored: str) -> str | None:
        """The parameter of ours a tensor stored as ``stored`` in a transformers file is (or, one expert's linear,
        a part of); None for an ignored buffer."""
        key = self.hf_canonical(stored)
        return key if key is None or self.hf_experts is None else self.hf_experts.ours(key)

    def hf_name(self, name: str) -> str:
        """The name a transformers file stores our parameter ``name`` under (a stacked expert tensor: see
        ``HFExperts.stored``)."""
        return name if self.hf_experts is None else self.hf_experts.theirs(name)

    def is_hf_transposed(self, name: str) -> bool:
        """Whether transformers stores this weight [in, out] where ours is ``nn.Linear``'s [out, in]."""
        return bool(self.hf_transposed) and name.endswith(self.hf_transposed)


HF_OUTPUT = "lm_head."  # transformers' output layer: never under the base-model prefix (tied copies included)
EXPERT_PARTS = ("gate", "up", "down")  # one expert's SwiGLU linears; ours stacks gate|up as ``gate_up_proj``
STACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # ours (``model.moe_layer.Experts``)


@dataclass(frozen=True)
class HFExperts:
    """How transformers' published files (the Hub's, and what ``save_pretrained`` writes by default) store the
    routed MLP that ds_megatron keeps stacked, as transformers 5 does in memory.

    ours      ``<block>.mlp.gate.weight`` [E, h] (the router), ``<block>.mlp.experts.gate_up_proj`` [E, 2F, h]
              (each expert's gate rows, then its up rows), ``<block>.mlp.experts.down_proj`` [E, h, F]
    theirs    ``<block>.<module>.gate.weight`` [E, h], ``<block>.<module>.experts.<e>.<gate|up>.weight`` [F, h],
              ``<block>.<module>.experts.<e>.<down>.weight`` [h, F]
    A file written with ``save_pretrained(save_original_format=False)`` holds our names (and is read as such)."""

    module: str = "mlp"  # the routed MLP's module in a stored block (Mixtral's files: block_sparse_moe)
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def theirs(self, name: str) -> str:
        """The stored name of a parameter of ours that is not a stacked expert tensor."""
        return name.replace(".mlp.gate.", f".{self.module}.gate.") if name.endswith(".mlp.gate.weight") else name

    def stored(self, name: str, expert: int, part: str) -> str:
        """The stored name of one expert's ``part`` (``EXPERT_PARTS``) of our stacked tensor ``name``."""
        block = name.removesuffix(STACKED_EXPERTS[1 if part == "down" else 0])
        return f"{block}.{self.module}.experts.{expert}.{getattr(self, part)}.weight"

    def expert_of(self, key: str) -> tuple[str, int, str] | None:
        """(our stacked name, expert, part) of one expert's stored linear; None for any other key."""
        block, sep, rest = key.partition(f".{self.module}.experts.")
        expert, _, leaf = rest.partition(".")
        part = next((p for p in EXPERT_PARTS if leaf == getattr(self, p) + ".weight"), None)
        if not sep or not expert.isdigit() or part is None:
            return None
        return block + STACKED_EXPERTS[1 if part == "down" else 0], int(expert), part

    def ours(self, key: str) -> str:
        """Our name of a canonical stored key (one expert's linear: the stacked tensor it is a part of)."""
        piece = self.expert_of(key)
        if piece is not None:
            return piece[0]
        router = f".{self.module}.gate.weight"
        return key.removesuffix(router) + ".mlp.gate.weight" if key.endswith(router) else key


def hf_fields(config: Any, renamed: dict[str, str], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config's dataclass fields under transformers' names (``renamed``: ours -> theirs; others keep their name;
    ``attention`` is the attention kernel, not a field of transformers' config; ``skip``: fields mapped by hand)."""
    return {
        renamed.get(f.name, f.name): getattr(config, f.name)
        for f in fields(config)
        if f.name != "attention" and f.name not in skip
    }


def read_fields(cls: type, source: Any, renamed: dict[str, str], **given: Any) -> dict[str, Any]:
    """The inverse of :func:`hf_fields`: ``cls``'s fields read off ``source`` (a transformers config, a resolved
    shape) under ``renamed`` names, ``given`` taking precedence."""
    names = [f.name for f in fields(cls) if f.name != "attention" and f.name not in given]
    return {**{name: getattr(source, renamed.get(name, name)) for name in names}, **given}
