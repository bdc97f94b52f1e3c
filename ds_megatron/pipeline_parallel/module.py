"""L3.5: the model as a ``deepspeed.pipe.PipelineModule``, for every model family.

Layers, in order (each built only on the stage that owns it, as this rank's shard of the family's plan, holding the
single-device model's initial values there: ``parallelize.build_shard``), for GPT-2 / Llama:

    embedding        wte (tied) / embed_tokens (tied when the model ties)   ids [b, s] -> [s, b, h] ([s/t, b, h] SP)
    positions        learned positions + embedding dropout (wpe; none with rotary positions)
    blocks x L       BlockPipe around the family's block                     [s(/t), b, h] -> same
    final norm       ln_f / norm
    output layer     the tied embedding again (no file of its own), or Llama's untied lm_head  -> [s, b, V_pad/t]
    loss: vocab-parallel cross entropy against labels [b, s]

With the fused loss (``model.fused_loss``, the default) the output layer hands its input [s(/t), b, h] and a view of
its weight to the loss, which computes the logits chunk by chunk together with the cross entropy and its gradients
(``tensor_parallel.fused_cross_entropy``): the logits [s, b, V_pad/t] are never held whole.

Only fixed-shape hidden states cross stage boundaries; positions, rotary tables and the causal mask are made
locally.  With packed documents (``data.document_mask``) the boundary is the tuple (hidden, doc_ids, positions),
the two [b, s/cp] int64 tensors read with the batch (``split_boundary``); masks are still built per call.

Mixture of experts: the boundary ends with the routing statistics of the routed layers run so far, summed
(``RouterStats.pack``: [2 E + 2] fp32, this rank's tokens only), started at zeros by the embedding and added to by
each routed block; the loss sums them over the ranks holding other tokens of the micro-batch (TP under SP, CP) and
adds the load-balancing and z-losses of the whole model, as transformers computes them over all layers at once.
Their gradient flows back through the boundary like the hidden states' (DeepSpeed's engines send a gradient for
every floating boundary tensor), so each stage's routers get exactly the single-device gradient, whatever the
stage cut; the cost is 2 E + 2 numbers per micro-batch and boundary.  Each micro-batch's loss has its own
statistics (transformers' per forward), the engine averaging the micro-batches' losses as for the LM loss.
DeepSpeed sums a tied embedding's gradient over the first and last stage (``TiedLayerSpec``).  Which
module path each layer holds is the family's ``layout``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from torch import nn

from ds_megatron.config.schema import DEFAULT_PARTITION_METHOD, RecomputeSection
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES, ModelConfig, family_of
from ds_megatron.model.family import LayoutTable
from ds_megatron.model.layers import TiedEmbedding, positions_tensor
from ds_megatron.model.moe_layer import RouterStats, load_balancing_loss, router_z_loss
from ds_megatron.parallelize import ParallelContext, build_shard, parallelize_block, parallelize_module, sp_dropout
from ds_megatron.random import RNGTracker
from ds_megatron.recompute import checkpoint
from ds_megatron.tensor_parallel import vocab_parallel_cross_entropy
from ds_megatron.tensor_parallel.experts import load_extremes, router_stats_over_tokens
from ds_megatron.topology import ParallelTopology


@dataclass(frozen=True)
class PipelineLayout:
    """Which pipeline layer index holds what; every name mapping (checkpoint records, export, resharding, HF
    import, fp32 masters) reads it here.  GPT-2 (always tied):

        0: wte (tied, DeepSpeed names it ``tied_modules.wte.*``)   1: wpe   2 .. n_layer+1: blocks
        n_layer+2: ln_f                                             n_layer+3: the tied wte again, as output layer

    Llama: 0: embed_tokens (tied or not), 1 .. n_layer: blocks, n_layer+1: norm, n_layer+2: the output layer (the
    tied embedding, or ``lm_head`` with a file of its own).

    DeepSpeed names a local layer's parameters ``"<index>.<key>"`` and writes one file per layer and TP rank,
    ``layer_<index>-model_<tp>-model_states.pt``, whose keys are the ``<key>`` part (``block.attn.c_attn.weight``)."""

    n_layer: int
    family: str = DEFAULT_FAMILY
    tied: bool = True

    @classmethod
    def of(cls, config: ModelConfig) -> PipelineLayout:
        return cls(config.n_layer, config.family, bool(getattr(config, "tie_word_embeddings", True)))

    @property
    def table(self) -> LayoutTable:
        return FAMILIES[self.family].layout

    @property
    def blocks(self) -> str:
        return FAMILIES[self.family].blocks

    @property
    def pre(self) -> tuple[tuple[str, str], ...]:
        """The layers between the embedding and the blocks (the learned position table, if any)."""
        return (self.table.positions,) if self.table.positions else ()

    @property
    def first_block(self) -> int:
        return 1 + len(self.pre)

    @property
    def num_layers(self) -> int:
        return self.first_block + self.n_layer + 2  # the final norm and the output layer

    @property
    def output_index(self) -> int:
        return self.num_layers - 1

    def parts_of(self, blocks: Sequence[int]) -> list[int]:
        """DeepSpeed's stage boundaries (``PipelineModule.parts``: stage s builds layers [parts[s], parts[s+1])) for
        ``blocks[s]`` transformer blocks on stage s, in model order: the embedding (and learned positions) go with
        the first stage, the final norm and the output layer with the last."""
        if sum(blocks) != self.n_layer or min(blocks, default=0) < 0:
            raise ValueError(f"block counts {list(blocks)} do not split {self.n_layer} blocks")
        parts, end = [0], self.first_block
        for n in blocks[:-1]:
            end += n
            parts.append(end)
        return [*parts, self.num_layers]

    def blocks_of(self, parts: Sequence[int]) -> list[int]:
        """The blocks on each stage of DeepSpeed's boundaries ``parts`` (the inverse of :meth:`parts_of`)."""
        first, end = self.first_block, self.first_block + self.n_layer
        return [max(0, min(b, end) - max(a, first)) for a, b in zip(parts, parts[1:])]

    def _slots(self) -> list[tuple[int, tuple[str, str]]]:
        """(index, slot) of every non-block layer with a file of its own."""
        t = self.table
        slots = [(0, t.embedding), *((1 + i, slot) for i, slot in enumerate(self.pre))]
        slots.append((self.first_block + self.n_layer, t.final_norm))
        if not self.tied:
            slots.append((self.output_index, t.output))
        return slots

    def saved_layers(self) -> list[tuple[int, str]]:
        """(layer index, prefix) of every layer with a file of its own, in pipeline order: a key ``k`` of the
        layer's file is the parameter ``prefix + k.removeprefix("block.")`` (the tied output layer has no file)."""
        out = [(i, path[: len(path) - len(attr)]) for i, (path, attr) in self._slots()]
        out += [(self.first_block + i, f"{self.blocks}.{i}.") for i in range(self.n_layer)]
        return sorted(out)

    def index_of(self, full_name: str) -> int:
        """The (first) layer index holding parameter ``full_name``."""
        blocks = self.blocks + "."
        if full_name.startswith(blocks):
            return self.first_block + int(full_name[len(blocks) :].split(".")[0])
        for i, (path, _) in self._slots():
            if full_name.startswith(path + "."):
                return i
        raise KeyError(f"{full_name} is not a parameter of the {self.family} layout")

    def key_in_layer(self, full_name: str) -> str:
        """The key of ``full_name`` inside its layer's state file."""
        blocks = self.blocks + "."
        if full_name.startswith(blocks):
            return "block." + full_name[len(blocks) :].split(".", 1)[1]
        for _, (path, attr) in self._slots():
            if full_name.startswith(path + "."):
                return attr + full_name[len(path) :]
        raise KeyError(f"{full_name} is not a parameter of the {self.family} layout")

    def local_name(self, index: int, key: str) -> str:
        """DeepSpeed's parameter name of ``key`` in layer ``index`` (what optimizer checkpoints are keyed by)."""
        return f"tied_modules.{self.table.tied_key}.{key}" if index == 0 and self.tied else f"{index}.{key}"

    def full_name(self, local_name: str) -> str | None:
        """DeepSpeed's parameter name -> full (Hugging Face) name; None for names that are not ours."""
        tied = f"tied_modules.{self.table.tied_key}."
        if local_name.startswith(tied):
            path, attr = self.table.embedding
            return path + local_name[len(tied) :].removeprefix(attr)
        idx, _, rest = local_name.partition(".")
        if not idx.isdigit():
            return None
        i = int(idx)
        if self.first_block <= i < self.first_block + self.n_layer:
            return f"{self.blocks}.{i - self.first_block}." + rest.removeprefix("block.")
        for j, (path, attr) in self._slots():
            if i == j and rest.startswith(attr + "."):
                return path + rest[len(attr) :]
        return None


class Boundary(NamedTuple):
    """What crosses a layer (and stage) boundary."""

    hidden: torch.Tensor  # hidden states [s(/t), b, h] (token ids [b, s] into the embedding)
    documents: tuple[torch.Tensor, ...]  # () or packed documents' (doc_ids, positions), int64 [b, s/cp]
    router: torch.Tensor | None = None  # mixture of experts: the routing statistics so far (RouterStats.pack)


def split_boundary(x) -> Boundary:
    """What a layer receives: a tensor alone (the default boundary), or with packed documents (hidden or token ids,
    doc_ids, positions), and for a routed family the packed routing statistics last.  The ids and positions cross
    stage boundaries as they are: a middle stage never sees the token ids, and at cp > 1 restart positions depend on
    chunks other ranks hold.  DeepSpeed's pipeline engine sends int64 tensors with their dtype and shape, marks
    received ones ``requires_grad = is_floating_point()`` and sends and expects gradients for floating tensors only,
    so they cost b s/cp x 16 bytes per micro-batch and boundary and no gradient buffer."""
    if not isinstance(x, tuple):
        return Boundary(x, ())
    rest = x[1:]
    if rest and rest[-1].is_floating_point():
        return Boundary(x[0], tuple(rest[:-1]), rest[-1])
    return Boundary(x[0], tuple(rest))


def join_boundary(hidden: torch.Tensor, documents: tuple[torch.Tensor, ...], router: torch.Tensor | None = None):
    """The inverse of :func:`split_boundary`: the hidden states alone when there is nothing else."""
    rest = (*documents, *(() if router is None else (router,)))
    return (hidden, *rest) if rest else hidden


def router_size(config: ModelConfig) -> int:
    """Elements of the routing statistics on the boundary (0: a dense family, no statistics)."""
    experts = getattr(config, "num_experts", 0)
    return RouterStats.packed_size(experts) if experts else 0


def keep_slot(layer: nn.Module, slot: tuple[str, str], build_full, seed: int, ctx: ParallelContext) -> None:
    """Keep this rank's shard of the module ``build_full()`` at ``slot`` (its path in the model, the attribute the
    layer keeps it under), cut by the plan and initialised by name (``build_shard``: only the shard is drawn), as
    ``layer.<attr>``, so checkpoint keys read like the model's."""
    path, layer.attr = slot
    setattr(layer, layer.attr, build_shard(path, build_full, lambda m: parallelize_module(path, m, ctx), ctx, seed))


class EmbeddingPipe(nn.Module):
    """Token embedding on the first stage; when tied, the same table is the output layer on the last stage, whose
    output ``loss`` decides (:meth:`VocabParallelLoss.head_output`; logits without one)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, loss: VocabParallelLoss | None = None):
        super().__init__()
        full = functools.partial(TiedEmbedding, config.vocab_size, config.n_embd)
        keep_slot(self, family_of(config).layout.embedding, full, seed, ctx)
        self.loss = loss
        self.router_size = router_size(config)

    def forward(self, inputs):
        """ids [b, s] -> [s, b, h] (SP: [s/t, b, h]); with packed documents (ids, doc_ids, positions) -> (hidden,
        doc_ids, positions); a routed family's statistics appended, zeros (a leaf that takes a gradient, so that a
        first stage without routed layers still has a floating output to run backward from)."""
        input_ids, documents, _ = split_boundary(inputs)
        hidden = getattr(self, self.attr)(input_ids.t().contiguous())
        router = None
        if self.router_size:
            router = torch.zeros(self.router_size, device=hidden.device, requires_grad=torch.is_grad_enabled())
        return join_boundary(hidden, documents, router)


def head_output(head: nn.Module, inputs, loss: VocabParallelLoss | None):
    """What an output layer ``head`` returns: this rank's vocabulary block of logits [s, b, V_pad/t], or, for a
    fused ``loss``, (its input [s(/t), b, h], a view of its weight); the routing statistics appended for the loss
    (none while it emits logits)."""
    hidden, _, router = split_boundary(inputs)
    out = loss.head_output(head, hidden) if loss is not None else head.logits(hidden)
    if router is None or loss is None or loss.emit_logits:
        return out
    return (*out, router) if isinstance(out, tuple) else (out, router)


def lm_head_forward(module: EmbeddingPipe, inputs) -> torch.Tensor:
    """Tied output layer: hidden [s(/t), b, h] -> this rank's vocabulary block of logits [s, b, V_pad/t] (for a
    fused loss: the hidden states and a view of the weight)."""
    return head_output(getattr(module, module.attr), inputs, module.loss)


class OutputPipe(nn.Module):
    """An untied output layer (Llama's ``lm_head``), vocabulary-parallel: [s(/t), b, h] -> [s, b, V_pad/t] (for a
    fused ``loss``: its input and a view of its weight)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, loss: VocabParallelLoss | None = None):
        super().__init__()
        full = functools.partial(nn.Linear, config.n_embd, config.vocab_size, bias=False)
        keep_slot(self, family_of(config).layout.output, full, seed, ctx)
        self.loss = loss

    def forward(self, inputs) -> torch.Tensor:
        return head_output(getattr(self, self.attr), inputs, self.loss)


class PositionEmbeddingPipe(nn.Module):
    """Learned positions (GPT-2's ``wpe``) and the embedding dropout after them."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int):
        super().__init__()
        full = functools.partial(nn.Embedding, config.n_positions, config.n_embd)
        keep_slot(self, family_of(config).layout.positions, full, seed, ctx)
        self.drop = sp_dropout(nn.Dropout(config.embd_pdrop), ctx)
        self.seq_factor = ctx.tp.size if ctx.sp else 1
        self.positions = ctx.positions

    def forward(self, inputs):
        # Global positions of this rank's tokens (under CP its two chunks); under SP the local sequence is first
        # split over TP by the position table itself, as the embedding's reduce-scatter splits the tokens.  Packed
        # documents: each token's own position ([b, s] -> [s, b], split over TP the same way).
        x, documents, _ = split_boundary(inputs)
        table = getattr(self, self.attr)
        if documents:
            return join_boundary(self.drop(x + table(documents[1].t())), documents)
        s = x.shape[0] * self.seq_factor
        pos = positions_tensor(self.positions(s), x.device)
        return self.drop(x + table(pos).unsqueeze(1))


class BlockPipe(nn.Module):
    """One transformer block of the config's family (the class name is what the pipeline partitioner balances)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int, layer_idx: int):
        super().__init__()
        family = family_of(config)
        # a routed family's block is dense or routed by its index (mlp_only_layers, decoder_sparse_step)
        where = {"layer": layer_idx} if family.routed else {}
        block = functools.partial(family.torch_side().block, config, **where)
        path = f"{family.block_prefix}{layer_idx}"
        self.block = build_shard(path, block, lambda b: parallelize_block(b, ctx), ctx, seed)
        self.layer_idx = layer_idx

    def forward(self, inputs):
        x, documents, router = split_boundary(inputs)
        out = self.block(x, *documents)
        if router is None:
            return join_boundary(out, documents)
        hidden, stats = out  # a routed family's block: its statistics (None for a dense layer) added to the sum
        return join_boundary(hidden, documents, router if stats is None else router + stats.pack())


class FinalNormPipe(nn.Module):
    """The final norm (GPT-2's ``ln_f`` LayerNorm, Llama's ``norm`` RMSNorm), under the family's attribute name."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, seed: int):
        super().__init__()
        family = family_of(config)
        norm = functools.partial(family.torch_side().final_norm, config)
        keep_slot(self, family.layout.final_norm, norm, seed, ctx)

    def forward(self, inputs) -> torch.Tensor:
        hidden, _, router = split_boundary(inputs)  # nothing after it needs the documents
        return join_boundary(getattr(self, self.attr)(hidden), (), router)


class VocabParallelLoss:
    """Mean next-token loss over a micro-batch from vocabulary-parallel logits (full logits never gathered).

    ``fused``: the output layer hands over its input and its weight (:meth:`head_output`), and the loss runs the
    output matmul and the cross entropy together in chunks of tokens (``VocabParallelEmbedding.fused_loss``), so the
    logits are never held whole; while :meth:`emitting_logits` is active (generation reads logits) the output layer
    returns its logits as without it.

    The weight travels as a view made inside the output layer, among the module's outputs: DeepSpeed runs its
    backward prologue (the BF16 optimizer clears the 16-bit gradients there) when the gradient of a module output
    arrives, so a parameter used only after the module (in the loss) would have its gradient accumulated before
    the prologue and cleared by it (measured: the tied embedding's output-layer gradient lost under bf16)."""

    def __init__(self, ctx: ParallelContext, fused: bool = False):
        self.tp_group = ctx.tp.group
        self.vocab_start = ctx.tp.rank * (ctx.padded_vocab_size // ctx.tp.size)
        self.__name__ = "vocab_parallel_cross_entropy"
        self.fused, self.emit_logits = fused, False
        self.head: nn.Module | None = None  # fused: the vocab-parallel output module, handed over by its forward
        # mixture of experts: the ranks whose tokens the routing statistics are summed over, the losses' weights
        self.routed = bool(router_size(ctx.config))
        self.stats_tp_group = ctx.tp.group if ctx.sp else None
        self.cp_group = ctx.cp.group
        self.top_k = getattr(ctx.config, "num_experts_per_tok", 0)
        self.aux_coef = getattr(ctx.config, "router_aux_loss_coef", 0.0)
        self.z_coef = getattr(ctx.config, "router_z_loss_coef", 0.0)
        self.router_metrics: dict[str, torch.Tensor] = {}  # the last training micro-batch's (ROUTER_METRICS)

    def head_output(self, head: nn.Module, hidden: torch.Tensor):
        """The output layer's result: logits [s, b, V_pad/t], or for the fused loss (``hidden`` [s(/t), b, h], a
        view of the weight), with ``head`` kept for :meth:`__call__`."""
        if not self.fused or self.emit_logits:
            return head.logits(hidden)
        self.head = head
        return hidden, head.weight.view_as(head.weight)

    @contextlib.contextmanager
    def emitting_logits(self) -> Iterator[None]:
        """The output layer returns logits inside (the loss is then not computed: generation)."""
        self.emit_logits = True
        try:
            yield
        finally:
            self.emit_logits = False

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """outputs: logits [s, b, V_pad/t], or for the fused loss (hidden states [s(/t), b, h], weight view);
        a routed family's packed routing statistics last; labels [b, s]."""
        router = None
        if self.routed and isinstance(outputs, tuple) and not self.emit_logits:
            *rest, router = outputs
            outputs = tuple(rest) if len(rest) > 1 else rest[0]
        if self.fused:
            if self.emit_logits:
                raise RuntimeError("the fused loss got logits: compute no loss inside emitting_logits()")
            hidden, weight = outputs
            lm = self.head.fused_loss(hidden, labels.t(), weight=weight)
        else:
            lm = vocab_parallel_cross_entropy(outputs, labels.t(), self.tp_group, self.vocab_start).mean()
        if router is None or not torch.is_grad_enabled():
            return lm  # validation: the LM loss alone (its perplexity)
        return self.with_router_losses(lm, router)

    def with_router_losses(self, lm: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """lm + router_aux_loss_coef x the load-balancing loss (+ router_z_loss_coef x the z-loss) of the whole
        micro-batch's routing statistics; the parts kept for logging (``router_metrics``)."""
        stats = RouterStats.unpack(router_stats_over_tokens(router, self.stats_tp_group, self.cp_group))
        aux, z = load_balancing_loss(stats), router_z_loss(stats)
        loss = lm + self.aux_coef * aux.to(lm.dtype)
        if self.z_coef:
            loss = loss + self.z_coef * z.to(lm.dtype)
        low, high = load_extremes(stats, self.top_k)
        values = (lm, aux, z, low, high)
        self.router_metrics = {name: v.detach().float() for name, v in zip(ROUTER_METRICS, values, strict=True)}
        return loss


# What a routed family's training logs per step beside the loss (the training objective), each the mean over the
# step's micro-batches and the data-parallel ranks (DeepSpeed's "additional losses"): the LM loss alone, the
# load-balancing loss, the z-loss (logged whatever its weight), and the least and most loaded expert's share of the
# assignments relative to a balanced router (1.0), over all routed layers together.
ROUTER_METRICS = ("lm_loss", "aux_loss", "z_loss", "expert_load_min", "expert_load_max")


def layer_specs(config: ModelConfig, ctx: ParallelContext, seed: int, loss: VocabParallelLoss | None = None) -> list:
    """The layers in the order of :class:`PipelineLayout`; the output layer's result is for ``loss`` (logits
    without one)."""
    layout = PipelineLayout.of(config)
    key, attr = layout.table.tied_key, layout.table.embedding[1]
    if layout.tied:
        specs: list = [TiedLayerSpec(key, EmbeddingPipe, config, ctx, seed, loss, tied_weight_attr=[f"{attr}.weight"])]
    else:
        specs = [LayerSpec(EmbeddingPipe, config, ctx, seed)]
    specs += [LayerSpec(PositionEmbeddingPipe, config, ctx, seed) for _ in layout.pre]
    specs += [LayerSpec(BlockPipe, config, ctx, seed, i) for i in range(config.n_layer)]
    specs.append(LayerSpec(FinalNormPipe, config, ctx, seed))
    if layout.tied:
        specs.append(
            TiedLayerSpec(
                key,
                EmbeddingPipe,
                config,
                ctx,
                seed,
                loss,
                forward_fn=lm_head_forward,
                tied_weight_attr=[f"{attr}.weight"],
            )
        )
    else:
        specs.append(LayerSpec(OutputPipe, config, ctx, seed, loss))
    assert len(specs) == layout.num_layers
    return specs


def stage_parts(
    layout: PipelineLayout, specs: Sequence, num_stages: int, partition_method: str, blocks: Sequence[int] | None
) -> list[int] | None:
    """The one table of pipeline stages: DeepSpeed's boundaries ``parts`` (stage s holds layers [parts[s],
    parts[s+1]) of ``specs``, in model order) over ``num_stages`` stages (pp x the schedule's stages per rank).
    ``blocks`` (``ds_megatron.parallel.pipeline_layout``) sets each stage's blocks (:meth:`PipelineLayout.parts_of`);
    without it, ``partition_method`` as DeepSpeed computes it from the layer specs (``uniform``, or the layers whose
    class name matches ``type:<regex>`` balanced by ``partition_balanced``).  None for a method that measures
    built layers (``parameters``): DeepSpeed's own, which only the module can run.  The module, the schedules'
    engines (through its ``parts``) and every checkpoint reader (``checkpoint.layout.stage_param_layers``) read it."""
    if blocks is not None:
        if len(blocks) != num_stages:
            raise ValueError(f"{len(blocks)} block counts for {num_stages} pipeline stages")
        return layout.parts_of(blocks)
    method = partition_method.lower()
    if method == "uniform":
        return partition_uniform(len(specs), num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(s.typename.__name__) else 0 for s in specs]
        return [int(p) for p in partition_balanced(weights, num_stages)]
    return None


class PipelineModel(PipelineModule):
    """The model as a PipelineModule, whose forward applies full recompute to chunks of transformer blocks.

    DeepSpeed's own ``activation_checkpoint_interval`` counts every local layer (embeddings included) and so cannot
    express "chunks of k blocks" or "the first k blocks of the stage"; this forward does, with exact RNG replay.
    """

    def __init__(
        self,
        *args,
        layout: PipelineLayout,
        recompute: RecomputeSection,
        rng: RNGTracker | None,
        stage_blocks: Sequence[int] | None = None,
        **kwargs,
    ):
        # read by _partition_layers, which PipelineModule.__init__ calls before nn.Module has its attribute tables
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "stage_blocks", None if stage_blocks is None else tuple(stage_blocks))
        super().__init__(*args, **kwargs)
        self.recompute, self.rng = recompute, rng
        self.segments = self._segments()

    def _partition_layers(self, method="uniform"):
        """DeepSpeed's stage boundaries from :func:`stage_parts` over ``num_stages`` stages (a schedule's module with
        several stages per rank multiplies ``num_stages`` first), this rank's layers the stage ``stage_id``'s."""
        parts = stage_parts(self.layout, self._layer_specs, self.num_stages, method, self.stage_blocks)
        if parts is None:  # measured on built layers: DeepSpeed's own, at the stage count already set
            PipelineModule._partition_layers(self, method)
            return
        self.parts = parts
        self._set_bounds(start=parts[self.stage_id], stop=parts[self.stage_id + 1])

    def get_additional_losses(self):
        """DeepSpeed's hook for losses reported beside the loss: a routed family's ROUTER_METRICS of the last
        micro-batch (summed over the step by the engine, averaged over micro-batches and the data axis, and
        broadcast to every stage: ``engine.agg_additional_losses``).  Stages without the loss name them too (the
        engine sizes its broadcast by their number).  None for a dense family."""
        loss = self.loss_fn
        if not getattr(loss, "routed", False):
            return None
        return loss.router_metrics or {name: torch.zeros(()) for name in ROUTER_METRICS}

    def writes_checkpoint_files(self) -> bool:
        """Whether DeepSpeed's save writes files from this rank: data-parallel rank 0 writes every layer file and the
        model-state file (the optimizer's state on the fp32 path); with DeepSpeed's parallel pipeline-stage writes
        (``checkpoint.parallel_write.pipeline_stage``) every data-parallel rank writes a share of the layers."""
        return bool(self.checkpoint_parallel_write_pipeline) or self._grid.data_parallel_id == 0

    def _synchronize_tied_weights(self) -> None:
        # DeepSpeed copies the first stage's tied embedding to the last stage with an in-place broadcast, at
        # construction and after loading.  With autograd on, the broadcast (a collective with no autograd kernel) is
        # recorded on the weight, and every backward through it warns of "silently incorrect behavior"; a weight copy
        # is not part of the model's computation, so it runs without autograd.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _segments(self) -> list[tuple[int, int, bool]]:
        """(start, end, recomputed) ranges over this stage's forward_funcs."""
        funcs = self.forward_funcs
        blocks = [i for i, f in enumerate(funcs) if isinstance(f, BlockPipe)]
        if not blocks:
            return [(0, len(funcs), False)] if funcs else []
        first, last = blocks[0], blocks[-1] + 1
        segments = [(first + s, first + e, r) for s, e, r in self.recompute.chunks(last - first)]
        if first > 0:
            segments.insert(0, (0, first, False))
        if last < len(funcs):
            segments.append((last, len(funcs), False))
        return segments

    def _run(self, start: int, end: int):
        def run(x):
            for f in self.forward_funcs[start:end]:
                x = f(x)
            return x

        return run

    def forward(self, forward_input):
        x = forward_input
        if isinstance(x, tuple) and len(x) == 1:
            x = x[0]
        for start, end, recomputed in self.segments:
            fn = self._run(start, end)
            x = checkpoint_segment(fn, x, self.rng) if recomputed else fn(x)
        return x


def checkpoint_segment(fn, x, rng: RNGTracker | None):
    """Full recompute of ``fn`` (a chunk of blocks) on what crosses a boundary: the hidden states (and a routed
    family's statistics) are kept and recomputed from; packed documents' ids and positions (no gradient, unchanged
    by blocks) go in as inputs and around the checkpoint's output."""
    hidden, documents, router = split_boundary(x)
    if not documents and router is None:
        return checkpoint(fn, x, rng=rng)
    if router is None:
        return (checkpoint(lambda h, *d: fn((h, *d))[0], hidden, *documents, rng=rng), *documents)

    def run(h, r, *d):
        out = split_boundary(fn(join_boundary(h, d, r)))
        return out.hidden, out.router

    hidden, router = checkpoint(run, hidden, router, *documents, rng=rng)
    return join_boundary(hidden, documents, router)


def build_pipeline_module(
    config: ModelConfig,
    ctx: ParallelContext,
    topology: ParallelTopology,
    seed: int,
    partition_method: str = DEFAULT_PARTITION_METHOD,
    module_class: type[PipelineModel] = PipelineModel,
    fused_loss: bool = True,
    stage_blocks: Sequence[int] | None = None,
) -> PipelineModel:
    """The model as a PipelineModule over ``topology`` (layers balanced by block count across stages, or
    ``stage_blocks`` blocks per stage: :func:`stage_parts`); ``module_class`` is the pipeline schedule's
    (``pipeline_parallel.dualpipev``); ``fused_loss``: the output layer and the loss computed together in chunks of
    tokens (:class:`VocabParallelLoss`)."""
    loss = VocabParallelLoss(ctx, fused_loss)
    return module_class(
        layers=layer_specs(config, ctx, seed, loss),
        topology=topology.ds_topology,
        loss_fn=loss,
        partition_method=partition_method,
        activation_checkpoint_interval=0,
        layout=PipelineLayout.of(config),
        recompute=ctx.recompute,
        rng=ctx.rng,
        stage_blocks=stage_blocks,
    )


def pipeline_param_name(module_name: str, module: PipelineModel) -> str | None:
    """Full (Hugging Face) name of a parameter of ``module`` (see :meth:`PipelineLayout.full_name`)."""
    return module.layout.full_name(module_name)


@contextlib.contextmanager
def zero_param_shapes_saved_as(engine, shapes: list) -> Iterator[None]:
    """Inside, DeepSpeed's save records ``shapes`` (per optimizer group, an ordered {parameter name: shape}) as the
    ZeRO parameter shapes of each ``mp_rank`` file (``param_shapes``, which its engine takes from the private
    ``_get_zero_param_shapes``: the optimizer's own groups); on exit the engine's own method again."""
    engine._get_zero_param_shapes = lambda: shapes
    try:
        yield
    finally:
        del engine._get_zero_param_shapes  # the instance entry: the class's method again
