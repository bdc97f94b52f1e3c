"""L3: the GPT as a ``deepspeed.pipe.PipelineModule``.

Layers, in order (each built only on the stage that owns it, from full single-device weights initialised by name,
then sharded by the plan):

    TiedLayerSpec("wte", WordEmbeddingPipe)        ids [b, s] -> [s, b, h]   ([s/t, b, h] under SP)
    LayerSpec(PositionEmbeddingPipe)               + wpe, embedding dropout
    LayerSpec(GPTBlockPipe) x L                    [s(/t), b, h] -> same
    LayerSpec(FinalNormPipe)                       ln_f
    TiedLayerSpec("wte", WordEmbeddingPipe, forward_fn=lm_head_forward)   -> logits [s, b, V_pad/t]
    loss: vocab-parallel cross entropy against labels [b, s]

Only fixed-shape hidden states cross stage boundaries; positions and the causal mask are made locally (the engine's
boundary carries fixed-shape tensors only).
The tied embedding's gradient is summed over the first and last stage by DeepSpeed (``TiedLayerSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ds_megatron.model import GPTBlock, GPTConfig, init_module
from ds_megatron.model.gpt import TiedEmbedding
from ds_megatron.parallelize import (
    ParallelPlan,
    parallelize_block,
    parallelize_module,
)
from ds_megatron.random import RNGTracker
from ds_megatron.recompute import RecomputePlan, checkpoint
from ds_megatron.tensor_parallel import ForkedDropout, vocab_parallel_cross_entropy
from ds_megatron.topology import ParallelTopology

TIED_KEY = "wte"


class WordEmbeddingPipe(nn.Module):
    """Token embedding on the first stage; the same (tied) table is the output layer on the last stage."""

    def __init__(self, config: GPTConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        full = TiedEmbedding(config.vocab_size, config.n_embd)
        init_module(full, config, seed, prefix="transformer.wte.")
        self.wte = parallelize_module("transformer.wte", full, plan)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s, b, h] (SP: [s/t, b, h])."""
        return self.wte(input_ids.t().contiguous())


def lm_head_forward(module: WordEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [s(/t), b, h] -> this rank's vocabulary block of logits [s, b, V_pad/t]."""
    return module.wte.logits(hidden)


class PositionEmbeddingPipe(nn.Module):
    def __init__(self, config: GPTConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        full = nn.Embedding(config.n_positions, config.n_embd)
        init_module(full, config, seed, prefix="transformer.wpe.")
        self.wpe = parallelize_module("transformer.wpe", full, plan)
        drop = nn.Dropout(config.embd_pdrop)
        self.drop = ForkedDropout(drop.p, plan.tp_fork()) if plan.sp else drop
        self.seq_factor = plan.tp_size if plan.sp else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0] * self.seq_factor
        pos = torch.arange(s, device=x.device)
        return self.drop(x + self.wpe(pos).unsqueeze(1))


class GPTBlockPipe(nn.Module):
    """One transformer block (the class name is what the pipeline partitioner balances)."""

    def __init__(self, config: GPTConfig, plan: ParallelPlan, seed: int, layer_idx: int):
        super().__init__()
        block = GPTBlock(config)
        init_module(block, config, seed, prefix=f"transformer.h.{layer_idx}.")
        self.block = parallelize_block(block, plan)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class FinalNormPipe(nn.Module):
    def __init__(self, config: GPTConfig, plan: ParallelPlan, seed: int):
        super().__init__()
        ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        init_module(ln_f, config, seed, prefix="transformer.ln_f.")
        self.ln_f = parallelize_module("transformer.ln_f", ln_f, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class VocabParallelLoss:
    """Mean next-token loss over a micro-batch from vocabulary-parallel logits (full logits never gathered)."""

    def __init__(self, plan: ParallelPlan):
        self.tp_group = plan.tp_group
        self.vocab_start = plan.tp_rank * (plan.padded_vocab_size // plan.tp_size)
        self.__name__ = "vocab_parallel_cross_entropy"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logits [s, b, V_pad/t], labels [b, s]."""
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.vocab_start).mean()


@dataclass(frozen=True)
class PipelineLayout:
    """Which pipeline layer index holds what, for a GPT of ``n_layer`` blocks; every name mapping (checkpoint
    records, export, resharding, HF import, fp32 masters) reads it here.

        0: wte (tied, DeepSpeed names it ``tied_modules.wte.*``)   1: wpe   2 .. n_layer+1: blocks
        n_layer+2: ln_f                                             n_layer+3: the tied wte again, as output layer

    DeepSpeed names a local layer's parameters ``"<index>.<key>"`` and writes one file per layer and TP rank,
    ``layer_<index>-model_<tp>-model_states.pt``, whose keys are the ``<key>`` part (``block.attn.c_attn.weight``)."""

    n_layer: int

    @property
    def num_layers(self) -> int:
        return self.n_layer + 4

    @property
    def ln_f_index(self) -> int:
        return self.n_layer + 2

    def saved_layers(self) -> list[tuple[int, str]]:
        """(layer index, prefix of its full GPT names) of every layer with a file of its own (the output layer is
        the tied wte and has none), in pipeline order."""
        names = [(0, "transformer."), (1, "transformer.")]
        names += [(2 + i, f"transformer.h.{i}.") for i in range(self.n_layer)]
        return [*names, (self.ln_f_index, "transformer.")]

    def index_of(self, full_name: str) -> int:
        """The (first) layer index holding full GPT parameter ``full_name``."""
        if full_name == "transformer.wte.weight":
            return 0
        if full_name == "transformer.wpe.weight":
            return 1
        if full_name.startswith("transformer.h."):
            return 2 + int(full_name.split(".")[2])
        return self.ln_f_index

    @staticmethod
    def key_in_layer(full_name: str) -> str:
        """The key of ``full_name`` inside its layer's state file."""
        if full_name.startswith("transformer.h."):
            return "block." + full_name.split(".", 3)[3]
        return full_name.removeprefix("transformer.")

    @staticmethod
    def local_name(index: int, key: str) -> str:
        """DeepSpeed's parameter name of ``key`` in layer ``index`` (what optimizer checkpoints are keyed by)."""
        return f"tied_modules.{TIED_KEY}.{key}" if index == 0 else f"{index}.{key}"

    def full_name(self, local_name: str) -> str | None:
        """DeepSpeed's parameter name -> full GPT (HF GPT-2) name; None for names that are not ours."""
        if local_name.startswith(f"tied_modules.{TIED_KEY}."):
            return "transformer.wte.weight"
        idx, _, rest = local_name.partition(".")
        if not idx.isdigit():
            return None
        i = int(idx)
        if i == 1:
            return "transformer." + rest  # wpe.weight
        if 2 <= i < 2 + self.n_layer:
            return f"transformer.h.{i - 2}." + rest.removeprefix("block.")
        if i == self.ln_f_index:
            return "transformer." + rest  # ln_f.*
        return None


def layer_specs(config: GPTConfig, plan: ParallelPlan, seed: int) -> list:
    """The layers in the order of :class:`PipelineLayout`."""
    specs: list = [
        TiedLayerSpec(TIED_KEY, WordEmbeddingPipe, config, plan, seed, tied_weight_attr=["wte.weight"]),
        LayerSpec(PositionEmbeddingPipe, config, plan, seed),
    ]
    specs += [LayerSpec(GPTBlockPipe, config, plan, seed, i) for i in range(config.n_layer)]
    specs += [
        LayerSpec(FinalNormPipe, config, plan, seed),
        TiedLayerSpec(
            TIED_KEY, WordEmbeddingPipe, config, plan, seed, forward_fn=lm_head_forward, tied_weight_attr=["wte.weight"]
        ),
    ]
    assert len(specs) == PipelineLayout(config.n_layer).num_layers
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
    config: GPTConfig,
    plan: ParallelPlan,
    topology: ParallelTopology,
    seed: int,
    partition_method: str = "type:GPTBlockPipe",
) -> GPTPipelineModule:
    """The GPT as a PipelineModule over ``topology`` (layers balanced by block count across stages)."""
    return GPTPipelineModule(
        layers=layer_specs(config, plan, seed),
        topology=topology.ds_topology,
        loss_fn=VocabParallelLoss(plan),
        partition_method=partition_method,
        activation_checkpoint_interval=0,
        layout=PipelineLayout(config.n_layer),
        recompute=plan.recompute,
        rng=plan.rng,
    )


def pipeline_param_name(module_name: str, module: GPTPipelineModule) -> str | None:
    """Full GPT name of a parameter of ``module`` (see :meth:`PipelineLayout.full_name`)."""
    return module.layout.full_name(module_name)
