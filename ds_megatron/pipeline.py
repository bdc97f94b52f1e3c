"""L3: the model as a ``deepspeed.pipe.PipelineModule``, for every model family.

Layers, in order (each built only on the stage that owns it, from full single-device weights initialised by name,
then sharded by the family's plan), for GPT-2 / Llama:

    embedding        wte (tied) / embed_tokens (tied when the model ties)   ids [b, s] -> [s, b, h] ([s/t, b, h] SP)
    gpt2 only        wpe + embedding dropout
    blocks x L       GPTBlockPipe around the family's block                  [s(/t), b, h] -> same
    final norm       ln_f / norm
    output layer     the tied embedding again (no file of its own), or Llama's untied lm_head  -> [s, b, V_pad/t]
    loss: vocab-parallel cross entropy against labels [b, s]

Only fixed-shape hidden states cross stage boundaries; positions, rotary tables and the causal mask are made
locally (the engine's boundary carries fixed-shape tensors only).  A tied embedding's gradient is summed over the
first and last stage by DeepSpeed (``TiedLayerSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ds_megatron.model import ModelConfig, family_of
from ds_megatron.model.gpt import TiedEmbedding
from ds_megatron.model.llama import RMSNorm
from ds_megatron.parallelize import (
    ParallelPlan,
    parallelize_block,
    parallelize_module,
)
from ds_megatron.random import RNGTracker
from ds_megatron.recompute import RecomputePlan, checkpoint
from ds_megatron.tensor_parallel import ForkedDropout, vocab_parallel_cross_entropy
from ds_megatron.topology import ParallelTopology


@dataclass(frozen=True)
class LayoutTable:
    """Where a family's parameters sit in the pipeline.  A slot is (module path in the full model, the attribute
    the pipeline layer keeps it under): the full name of the layer's key ``<attr>.<leaf>`` is ``<path>.<leaf>``."""

    embedding: tuple[str, str]
    pre: tuple[tuple[str, str], ...]  # layers between the embedding and the blocks
    blocks: str  # full names of block i start with "<blocks>.<i>."
    post: tuple[tuple[str, str], ...]  # layers after the blocks (the final norm)
    output: tuple[str, str]  # the untied output layer (unused when tied)
    tied_key: str  # TiedLayerSpec key of the tied embedding


LAYOUTS: dict[str, LayoutTable] = {
    "gpt2": LayoutTable(
        embedding=("transformer.wte", "wte"),
        pre=(("transformer.wpe", "wpe"),),
        blocks="transformer.h",
        post=(("transformer.ln_f", "ln_f"),),
        output=("transformer.wte", "wte"),
        tied_key="wte",
    ),
    "llama": LayoutTable(
        embedding=("model.embed_tokens", "embed_tokens"),
        pre=(),
        blocks="model.layers",
        post=(("model.norm", "norm"),),
        output=("lm_head", "lm_head"),
        tied_key="embed_tokens",
    ),
}


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
    family: str = "gpt2"
    tied: bool = True

    @classmethod
    def of(cls, config: ModelConfig) -> PipelineLayout:
        return cls(config.n_layer, config.family, bool(getattr(config, "tie_word_embeddings", True)))

    @property
    def table(self) -> LayoutTable:
        return LAYOUTS[self.family]

    @property
    def first_block(self) -> int:
        return 1 + len(self.table.pre)

    @property
    def num_layers(self) -> int:
        return self.first_block + self.n_layer + len(self.table.post) + 1

    @property
    def output_index(self) -> int:
        return self.num_layers - 1

    def _slots(self) -> list[tuple[int, tuple[str, str]]]:
        """(index, slot) of every non-block layer with a file of its own."""
        t = self.table
        slots = [(0, t.embedding), *((1 + i, slot) for i, slot in enumerate(t.pre))]
        after = self.first_block + self.n_layer
        slots += [(after + i, slot) for i, slot in enumerate(t.post)]
        if not self.tied:
            slots.append((self.output_index, t.output))
        return slots

    def saved_layers(self) -> list[tuple[int, str]]:
        """(layer index, prefix) of every layer with a file of its own, in pipeline order: a key ``k`` of the
        layer's file is the parameter ``prefix + k.removeprefix("block.")`` (the tied output layer has no file)."""
        out = [(i, path[: len(path) - len(attr)]) for i, (path, attr) in self._slots()]
        out += [(self.first_block + i, f"{self.table.blocks}.{i}.") for i in range(self.n_layer)]
        return sorted(out)

    def index_of(self, full_name: str) -> int:
        """The (first) layer index holding parameter ``full_name``."""
        blocks = self.table.blocks + "."
        if full_name.startswith(blocks):
            return self.first_block + int(full_name[len(blocks) :].split(".")[0])
        for i, (path, _) in self._slots():
            if full_name.startswith(path + "."):
                return i
        raise KeyError(f"{full_name} is not a parameter of the {self.family} layout")

    def key_in_layer(self, full_name: str) -> str:
        """The key of ``full_name`` inside its layer's state file."""
        blocks = self.table.blocks + "."
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
            return f"{self.table.blocks}.{i - self.first_block}." + rest.removeprefix("block.")
        for j, (path, attr) in self._slots():
            if i == j and rest.startswith(attr + "."):
                return path + rest[len(attr) :]
        return None


class EmbeddingPipe(nn.Module):
    """Token embedding on the first stage; when tied, the same table is the output layer on the last stage.  The
    attribute name is the family's (``wte`` / ``embed_tokens``), so checkpoint keys read like the model's."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        path, self.attr = LAYOUTS[config.family].embedding
        full = TiedEmbedding(config.vocab_size, config.n_embd)
        family_of(config).init(full, config, seed, prefix=path + ".")
        setattr(self, self.attr, parallelize_module(path, full, plan))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s, b, h] (SP: [s/t, b, h])."""
        return getattr(self, self.attr)(input_ids.t().contiguous())


WordEmbeddingPipe = EmbeddingPipe  # the GPT-2 family's name for it


def lm_head_forward(module: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Tied output layer: hidden [s(/t), b, h] -> this rank's vocabulary block of logits [s, b, V_pad/t]."""
    return getattr(module, module.attr).logits(hidden)


class OutputPipe(nn.Module):
    """Llama's untied output layer (``lm_head``), vocabulary-parallel: [s(/t), b, h] -> [s, b, V_pad/t]."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        path, attr = LAYOUTS[config.family].output
        full = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        family_of(config).init(full, config, seed, prefix=path + ".")
        self.lm_head = parallelize_module(path, full, plan)
        assert attr == "lm_head"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class PositionEmbeddingPipe(nn.Module):
    """GPT-2's learned positions and embedding dropout."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        full = nn.Embedding(config.n_positions, config.n_embd)
        family_of(config).init(full, config, seed, prefix="transformer.wpe.")
        self.wpe = parallelize_module("transformer.wpe", full, plan)
        drop = nn.Dropout(config.embd_pdrop)
        self.drop = ForkedDropout(drop.p, plan.tp_fork()) if plan.sp else drop
        self.seq_factor = plan.tp_size if plan.sp else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0] * self.seq_factor
        pos = torch.arange(s, device=x.device)
        return self.drop(x + self.wpe(pos).unsqueeze(1))


class GPTBlockPipe(nn.Module):
    """One transformer block of the config's family (the class name is what the pipeline partitioner balances)."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, seed: int, layer_idx: int):
        super().__init__()
        family = family_of(config)
        block = family.block(config)
        family.init(block, config, seed, prefix=f"{LAYOUTS[config.family].blocks}.{layer_idx}.")
        self.block = parallelize_block(block, plan)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class FinalNormPipe(nn.Module):
    """The final norm (GPT-2's ``ln_f`` LayerNorm, Llama's ``norm`` RMSNorm), under the family's attribute name."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        path, self.attr = LAYOUTS[config.family].post[0]
        if config.family == "llama":
            norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        else:
            norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        family_of(config).init(norm, config, seed, prefix=path + ".")
        setattr(self, self.attr, parallelize_module(path, norm, plan))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(x)


class VocabParallelLoss:
    """Mean next-token loss over a micro-batch from vocabulary-parallel logits (full logits never gathered)."""

    def __init__(self, plan: ParallelPlan):
        self.tp_group = plan.tp_group
        self.vocab_start = plan.tp_rank * (plan.padded_vocab_size // plan.tp_size)
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logits [s, b, V_pad/t], labels [b, s]."""
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.vocab_start).mean()


def layer_specs(config: ModelConfig, plan: ParallelPlan, seed: int) -> list:
    """The layers in the order of :class:`PipelineLayout`."""
    layout = PipelineLayout.of(config)
    key, attr = layout.table.tied_key, layout.table.embedding[1]
    if layout.tied:
        specs: list = [TiedLayerSpec(key, EmbeddingPipe, config, plan, seed, tied_weight_attr=[f"{attr}.weight"])]
    else:
        specs = [LayerSpec(EmbeddingPipe, config, plan, seed)]
    if config.family == "gpt2":
        specs.append(LayerSpec(PositionEmbeddingPipe, config, plan, seed))
    specs += [LayerSpec(GPTBlockPipe, config, plan, seed, i) for i in range(config.n_layer)]
    specs.append(LayerSpec(FinalNormPipe, config, plan, seed))
    if layout.tied:
        specs.append(
            TiedLayerSpec(
                key, EmbeddingPipe, config, plan, seed, forward_fn=lm_head_forward, tied_weight_attr=[f"{attr}.weight"]
            )
        )
    else:
        specs.append(LayerSpec(OutputPipe, config, plan, seed))
    assert len(specs) == layout.num_layers
    return specs


class GPTPipelineModule(PipelineModule):
    """PipelineModule whose forward applies full recompute to chunks of transformer blocks.

    DeepSpeed's own ``activation_checkpoint_interval`` counts every local layer (embeddings included) and so cannot
    express "chunks of k blocks" or "the first k blocks of the stage"; this forward does, with exact RNG replay.
    """

    def __init__(self, *args, layout: PipelineLayout, recompute: RecomputePlan, rng: RNGTracker | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recompute_plan, self.rng = recompute, rng
        self.layout = layout
        self.segments = self._segments()

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
        blocks = [i for i, f in enumerate(funcs) if isinstance(f, GPTBlockPipe)]
        if not blocks:
            return [(0, len(funcs), False)] if funcs else []
        first, last = blocks[0], blocks[-1] + 1
        segments = [(first + s, first + e, r) for s, e, r in self.recompute_plan.chunks(last - first)]
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
            x = checkpoint(fn, x, rng=self.rng) if recomputed else fn(x)
        return x


def build_pipeline_module(
    config: ModelConfig,
    plan: ParallelPlan,
    topology: ParallelTopology,
    seed: int,
    partition_method: str = "type:GPTBlockPipe",
) -> GPTPipelineModule:
    """The model as a PipelineModule over ``topology`` (layers balanced by block count across stages)."""
    return GPTPipelineModule(
        layers=layer_specs(config, plan, seed),
        topology=topology.ds_topology,
        loss_fn=VocabParallelLoss(plan),
        partition_method=partition_method,
        activation_checkpoint_interval=0,
        layout=PipelineLayout.of(config),
        recompute=plan.recompute,
        rng=plan.rng,
    )


def pipeline_param_name(module_name: str, module: GPTPipelineModule) -> str | None:
    """Full (Hugging Face) name of a parameter of ``module`` (see :meth:`PipelineLayout.full_name`)."""
    return module.layout.full_name(module_name)
