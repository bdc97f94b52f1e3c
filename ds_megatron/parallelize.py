"""L3: the module swap that turns a family's single-device modules into TP/SP ones, read off the family's plan
(Megatron; Shoeybi et al. 2019, Korthikanti et al. 2022): ``ds_megatron.model.<family>.PLAN``, one row per module,
its parallel style and the shard rule of its weight, read by the swap, checkpoints (``shard_rule``) and tests.

Inside a block: swap the modules of the plan, give the block its ``BlockHooks`` (``block_hooks``: grouped
projections, the core attention's RNG state, selective recompute), swap the dropouts on sequence shards (a
different mask on each TP rank).  Full recompute (chunks of blocks) is the pipeline module's forward.  At ep > 1 a
routed block's router and experts are replaced by the expert-parallel layer (:func:`expert_parallel_block`): whole
experts split over the EP group, not over TP; a shared expert (Qwen2-MoE) stays in it and is swapped by its plan
rows as the dense MLP is.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE, RecomputeSection
from ds_megatron.context_parallel.attention import cp_attention
from ds_megatron.context_parallel.layout import position_ranges
from ds_megatron.expert_parallel.layer import ExpertParallelMoE
from ds_megatron.expert_parallel.layout import local_experts
from ds_megatron.model import Family, ModelConfig, family_of
from ds_megatron.model.family import (
    COLUMN,
    EXPERT_SPLITS,
    EXPERTS,
    GATE,
    OUTPUT,
    POSITION,
    ROUTER,
    ROW,
    VOCAB,
    PlanRow,
)
from ds_megatron.model.kernels import EAGER, Kernels, compiled_kernels, use_kernels
from ds_megatron.model.layers import (
    BlockHooks,
    RMSNorm,
    Slices,
    TensorCache,
    compose,
    contiguous_positions,
    expert_slices,
    project_each,
    run_core,
)
from ds_megatron.random import TENSOR_PARALLEL, RNGTracker
from ds_megatron.recompute import checkpoint, discard_output
from ds_megatron.tensor_parallel import (
    REPLICATED,
    ColumnParallelLinear,
    ForkedDropout,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    SequenceShardedPositionEmbedding,
    ShardRule,
    VocabParallelEmbedding,
    VocabParallelOutput,
    grouped_column_linear,
    padded_vocab_size,
    shard,
)
from ds_megatron.tensor_parallel.experts import SequenceParallelGate, SequenceParallelRouter, TensorParallelExperts
from ds_megatron.topology import Group


@dataclass
class ParallelContext:
    """What the module swap needs besides the plan: the model, the TP group and the choices for every module."""

    config: ModelConfig
    tp: Group
    sequence_parallel: bool
    rng: RNGTracker | None
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE
    recompute: RecomputeSection = field(default_factory=RecomputeSection)
    cp: Group = Group()  # the CP ranks of this replica (no group: cp 1)
    cp_comm: str = "ring"  # "ring" or "a2a" (ds_megatron.context_parallel.attention)
    compile: bool = False  # the blocks' memory-bound pieces as inductor kernels (``model.kernels``)
    # expert parallelism (ep > 1): each routed block's experts split over this EP group, whole (expert_tp 1) or
    # each also split over TP (expert_tp = tp: the EP group then spans the ranks of this rank's tp index)
    ep: Group = Group()
    ep_dispatch_chunks: int = 1  # C > 1: the EP exchange in C chunks, overlapped with the experts (expert_parallel)
    expert_tp: int = 1
    init_weights: bool = True  # False: the weights are loaded next (--init-from-hf), so none is drawn (zeros)
    # packed documents' attention plans, one per micro-batch's ids tensor, shared by the blocks of this process
    document_plans: TensorCache = field(default_factory=TensorCache, repr=False, compare=False)

    @property
    def kernels(self) -> Kernels:
        """The bodies every RMSNorm, rotary, SwiGLU and GELU of this rank runs: compiled or eager."""
        return compiled_kernels() if self.compile else EAGER

    def positions(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        """The global positions of this rank's ``seq_len`` local tokens ([start, stop) ranges): the load-balanced
        chunks of a sequence of ``seq_len * cp`` tokens (rank i holds chunks i and 2 cp - 1 - i)."""
        return position_ranges(seq_len * self.cp.size, self.cp.rank, self.cp.size)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.config.vocab_size, self.tp.size, self.vocab_multiple)

    @property
    def family(self) -> Family:
        return family_of(self.config)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp.size > 1

    def tp_fork(self):
        """Context-manager factory entering the tensor-parallel RNG state (a no-op without a tracker)."""
        if self.rng is None:
            return contextlib.nullcontext
        return functools.partial(self.rng.fork, TENSOR_PARALLEL)


def shard_rule(name: str, ctx: ParallelContext) -> ShardRule:
    """The shard rule of one full parameter (its Hugging Face name), read off the family's plan table; used by the
    layers' construction, checkpoints (export, resharding, HF import) and tests."""
    dim = ctx.family.split_dim(name)
    if dim is None:
        return REPLICATED
    row = ctx.family.row(name)
    if row.style in (VOCAB, OUTPUT):
        return ShardRule(dim=0, padded_size=ctx.padded_vocab_size, unpadded_size=ctx.config.vocab_size)
    if row.style == EXPERTS:
        return ShardRule(dim=dim, fused=EXPERT_SPLITS[name.rsplit(".", 1)[1]][1])
    return ShardRule(dim=dim, fused=row.fused)


def is_expert_param(name: str, ctx: ParallelContext) -> bool:
    """Whether the full parameter ``name`` is a routed block's stacked expert tensor."""
    row = ctx.family.row(name)
    return row is not None and row.style == EXPERTS


def shard_slices(ctx: ParallelContext) -> Slices:
    """This rank's slices of every full parameter (``model.layers.Slices``): along the TP split dim, the global
    indices of the rows (or columns) its shard holds, cut by the parameter's own rule (:func:`shard` of the indices,
    so fused q|k|v blocks and vocabulary padding come out as they do for the weights); replicated ones whole.  At
    ep > 1 the stacked experts are split over EP instead (dim 0, ``expert_parallel.layout.local_experts``), whole
    along the others (at expert_tp = tp, cut along them over TP too)."""

    def slices(name: str, param: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if is_expert_param(name, ctx):  # per expert (``model.layers.Slices``): whole experts over EP, rows over TP
            dim = ctx.family.split_dim(name)
            split = ctx.ep.size == 1 or ctx.expert_tp > 1  # each expert's rows over TP
            full = param.shape[dim] * (ctx.tp.size if split else 1)
            rows = torch.arange(full)
            if split:
                rows = shard(rows, ShardRule(0, shard_rule(name, ctx).fused), ctx.tp.rank, ctx.tp.size)
            experts = torch.arange(param.shape[0])
            if ctx.ep.size > 1:
                local = local_experts(ctx.config.num_experts, ctx.ep)
                experts = torch.arange(local.start, local.stop)
            return dim, expert_slices(experts, rows, full)
        rule = shard_rule(name, ctx)
        if rule.replicated:
            return 0, None
        full = rule.unpadded_size or param.shape[rule.dim] * ctx.tp.size
        ids = torch.arange(1, full + 1)  # shifted by one: the padding shard() appends is 0, so -1 below
        return rule.dim, shard(ids, ShardRule(0, rule.fused, rule.padded_size), ctx.tp.rank, ctx.tp.size) - 1

    return slices


# The random fills a module's default initialisation runs (nn.Linear's kaiming uniform, nn.Embedding's N(0, 1)).
DEFAULT_INIT_DRAWS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    *(getattr(nn.init, f) for f in ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_")),
    *(getattr(nn.init, f) for f in ("xavier_uniform_", "xavier_normal_")),
}


class _WithoutDefaultInit(TorchFunctionMode):
    """Modules built inside keep their parameters' storage as allocated: every default random fill is skipped
    (each parameter is initialised by name afterwards, so the default draws were thrown away)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DEFAULT_INIT_DRAWS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _replace_parameters(module: nn.Module, make) -> None:
    """Swap every parameter ``p`` of ``module`` for ``make(p)`` (None: keep), keeping the attributes set on it."""
    for sub in module.modules():
        for key, param in sub._parameters.items():
            new = make(param) if param is not None else None
            if new is not None:
                new.__dict__.update(param.__dict__)  # the TP / SP marks the parallel layers set
                sub._parameters[key] = new


def _shape_only(param: nn.Parameter) -> nn.Parameter:
    """A parameter of ``param``'s shape whose elements all share one value's storage: cutting it costs only the
    shard's copy, reading no memory (an untouched full tensor's pages would each be faulted in)."""
    return nn.Parameter(param.new_empty(1).expand(param.shape), param.requires_grad)


def _owned(param: nn.Parameter) -> nn.Parameter | None:
    """Storage of its own for a parameter still on a :func:`_shape_only` one (a module the plan keeps whole)."""
    if param.untyped_storage().nbytes() >= param.numel() * param.element_size():
        return None
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype), param.requires_grad)


def build_shard(path: str, build_full, parallelize, ctx: ParallelContext, seed: int) -> nn.Module:
    """This rank's parallel module of the full module ``build_full()`` at ``path`` (``parallelize(full)``), holding
    the single-device model's initial values of its parameters, without drawing the full module: it is built without
    its default initialisation and cut by the plan as shapes only (:func:`_shape_only`), then each parameter of the
    shard draws only its own slices (:func:`shard_slices`), the values the full tensor has there.  Drawing every
    full tensor on every rank (twice: the default init, then by name) and slicing cost each rank the whole model's
    draws (t times its shard's; ~11 billion at 175B, pp 16).  With ``ctx.init_weights`` False (weights loaded next)
    the parameters are zeros and nothing is drawn."""
    with _WithoutDefaultInit():
        full = build_full()
    _replace_parameters(full, _shape_only)
    module = use_kernels(parallelize(full), ctx.kernels)
    _replace_parameters(module, _owned)
    if ctx.init_weights:
        prefix = f"{path}." if path else ""
        ctx.family.torch_side().init(module, ctx.config, seed, prefix, shard_slices(ctx))
    else:
        with torch.no_grad():
            for param in module.parameters():
                param.zero_()
    return module


def sp_dropout(drop: nn.Dropout, ctx: ParallelContext) -> nn.Module:
    """Dropout on sequence shards must draw different masks on each TP rank; replicated regions keep the default."""
    return ForkedDropout(drop.p, ctx.tp_fork()) if ctx.sp else drop


def _swap(root: nn.Module, path: str, build) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, build(getattr(parent, attr)))


def _builder(row: PlanRow, ctx: ParallelContext):
    """The module swap of one plan row: full single-device module in, this rank's parallel module out."""
    if row.style == COLUMN:
        return lambda m: ColumnParallelLinear(m, ShardRule(dim=0, fused=row.fused), ctx.tp, ctx.sp)
    if row.style == ROW:
        return lambda m: RowParallelLinear(m, ctx.tp, ctx.sp)
    if row.style == VOCAB:
        return lambda m: VocabParallelEmbedding(m, ctx.padded_vocab_size, ctx.tp, ctx.sp)
    if row.style == OUTPUT:
        return lambda m: VocabParallelOutput(m, ctx.padded_vocab_size, ctx.tp, ctx.sp)
    if row.style == POSITION:
        return lambda m: SequenceShardedPositionEmbedding(m.weight.data, ctx.tp) if ctx.sp else m
    if row.style == EXPERTS:
        # selective recompute of ``moe``: the experts' activations, not the collectives around them
        return lambda m: TensorParallelExperts(m, ctx.tp, ctx.sp, moe_recompute(ctx))
    if row.style == ROUTER:
        return lambda m: SequenceParallelRouter(m, ctx.tp) if ctx.sp else m
    if row.style == GATE:
        return lambda m: SequenceParallelGate(m, ctx.tp) if ctx.sp else m
    return lambda m: parallelize_norm(m, ctx)


def moe_recompute(ctx: ParallelContext):
    """Selective recompute of ``moe``: the experts' activations, not the collectives around them (the TP gathers of
    ``TensorParallelExperts``, the EP all-to-alls of ``ExpertParallelMoE``); None stores them."""
    return functools.partial(checkpoint, rng=ctx.rng) if "moe" in ctx.recompute.selective_modules else None


def parallelize_module(path: str, module: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The parallel form of the model-level module at ``path`` of the plan (``transformer.wte``, ``lm_head``...)."""
    row = next(r for r in ctx.family.model_rows if r.path == path)
    return _builder(row, ctx)(module)


def block_hooks(ctx: ParallelContext) -> BlockHooks:
    """The ``BlockHooks`` of every block under ``ctx`` (see ``ds_megatron.model.layers.BlockHooks``)."""
    modules, split, cp = ctx.recompute.selective_modules, ctx.tp.size > 1, ctx.cp.size > 1
    fork = ctx.tp_fork() if split else contextlib.nullcontext

    def cp_core(core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None) -> torch.Tensor:
        # Causal attention of this rank's chunks over the whole sequence, across the CP group; the core's kernel and
        # scale, no dropout (attention dropout with cp > 1 is refused by the loader).  ``doc_ids``: this rank's
        # tokens' documents (packed documents), sliced like its tokens: planned once per micro-batch and stage, the
        # plan shared by every block through the context's cache.
        return cp_attention(ctx.cp_comm, q, k, v, ctx.cp.group, core.kernel, core.scale, doc_ids, ctx.document_plans)

    local_core = cp_core if cp else run_core

    def core_in_state(core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None):
        with fork():
            return local_core(core, q, k, v, doc_ids)

    def recomputed_core(core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None):
        # Under CP the whole cp_attention is recomputed in backward, its exchange included (every CP rank recomputes
        # the same layer at the same point of backward, so the messages still match); what is saved is q, k, v (and
        # the document ids, an integer input with no gradient).
        ids = () if doc_ids is None else (doc_ids,)
        return checkpoint(functools.partial(core_in_state, core), q, k, v, *ids, rng=ctx.rng)

    def grouped_projection(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        queue = linears[0].weight_grad_queue  # deferred weight gradients (zero-bubble schedules), or None
        out = grouped_column_linear(x, tuple(m.weight for m in linears), ctx.tp.group, ctx.sp, queue)
        # column-parallel biases (Qwen2's q, k, v): this rank's slice, added to its output columns
        return tuple(y if m.bias is None else y + m.bias for y, m in zip(out, linears, strict=True))

    return BlockHooks(
        around_norm=discard_output if "layernorm" in modules else compose,
        around_act=discard_output if "mlp_act" in modules else compose,
        project=grouped_projection if split else project_each,
        core_attention=recomputed_core if "core_attn" in modules else core_in_state if split or cp else run_core,
        positions=ctx.positions if cp else contiguous_positions,
    )


def parallelize_block(block: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Apply the family's plan to one transformer block in place (full weights in, this rank's shards out)."""
    family = ctx.family
    routed = expert_parallel_path(ctx)
    if routed is not None and not _holds(block, f"{routed}.experts"):
        routed = None  # a dense layer's MLP at the same path
    if routed is not None:
        _swap(block, routed, lambda moe: expert_parallel_block(moe, ctx))
    for row in family.block_rows:
        if family.routed and not _holds(block, row.path):
            continue  # a routed family's block has either the dense MLP's rows or the router's and experts'
        if routed is not None and row.path.startswith(f"{routed}.") and row.style in (EXPERTS, ROUTER):
            continue  # the expert-parallel layer replaced the router and experts (a shared expert is swapped below)
        _swap(block, row.path, _builder(row, ctx))
    block.hooks = block_hooks(ctx)
    for path in family.sp_dropouts:
        _swap(block, path, lambda drop: sp_dropout(drop, ctx))
    return block


def expert_parallel_path(ctx: ParallelContext) -> str | None:
    """The routed MLP's path in a block when ep > 1 (the expert-parallel layer replaces it whole), else None."""
    if ctx.ep.size == 1 or not ctx.family.routed:
        return None
    return next(r.path for r in ctx.family.block_rows if r.style == EXPERTS).rpartition(".")[0]


def expert_parallel_block(moe: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The routed MLP with its experts split over the EP group (whole experts at expert_tp 1: under SP the EP group
    folds the tp ranks in, each routing its own sequence shard; at expert_tp = tp each expert also split over TP, the
    tokens gathered over it as the dense MLP's), its router replicated; under SP the router sees a sequence shard,
    so its gradient is summed over TP like the norms'."""
    tp = ctx.tp if ctx.expert_tp > 1 else Group()
    layer = ExpertParallelMoE.from_block(
        moe, ctx.ep, moe_recompute(ctx), ctx.ep_dispatch_chunks, tp, ctx.sequence_parallel
    )
    if ctx.sp:
        layer.gate = SequenceParallelRouter(layer.gate, ctx.tp)
    return layer


def _holds(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def parallelize_norm(norm: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Under SP a norm sees a sequence shard: its gradients are summed over TP."""
    if not ctx.sp:
        return norm
    if isinstance(norm, RMSNorm):
        return SequenceParallelRMSNorm(norm, ctx.tp)
    return SequenceParallelLayerNorm(norm, ctx.tp)


def parallelize_model(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Apply the family's plan to a whole single-device model in place.  Its forward then returns this rank's
    vocabulary block of logits ([b, s, V_pad/t]; use vocab-parallel cross entropy).  Under SP the plain forward stays
    correct because the embedding reduce-scatters along the sequence (and a learned position lookup keeps this
    rank's rows)."""
    if ctx.cp.size > 1:
        # The single-device forward embeds positions 0..s-1 of what it is given; a CP rank holds two chunks of
        # the sequence at other positions, which only the pipeline's position layer (``ctx.positions``) knows.
        raise ValueError("parallelize_model: cp > 1 runs through the pipeline layers (pipeline.layer_specs) only")
    family = ctx.family
    for row in family.model_rows:
        if row.style == OUTPUT and not hasattr(model, row.path):
            continue  # tied: the embedding is the output layer
        _swap(model, row.path, _builder(row, ctx))
    for path in family.model_sp_dropouts:
        _swap(model, path, lambda drop: sp_dropout(drop, ctx))
    for block in model.get_submodule(family.blocks):
        parallelize_block(block, ctx)
    return use_kernels(model, ctx.kernels)
