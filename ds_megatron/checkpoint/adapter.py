"""The one state-dict adapter of a run's family: every checkpoint path (export, ``import``, ``--init-from-hf`` and
its pre-flight, resharding on load and offline) turns a parameter into its TP shards and into a transformers file's
tensors through it, and nothing else reads the family's transformers names.

- TP shards (the shard rule of ``parallelize.shard_rule``, read off the family's plan): fused q|k|v cut by heads,
  column-parallel weights on the output dim, row-parallel on the input dim, vocabulary rows padded for the tp and
  stripped back to the real vocabulary on merge.  Checkpoint files always hold these shards (:meth:`saved_shard`),
  the routed experts included, whatever the run's expert parallelism: a run at ep > 1 holds whole experts, E / ep of
  them (:meth:`shard`: dim 0 of the stacked tensors cut over ep, ``parallelize.local_experts``; at expert_tp = tp
  each of them also cut by the TP rule), and its save writes the shards an ep 1 run at the same tp would
  (``checkpoint/ep_state.py``, :meth:`saved_from_gathered`), so a checkpoint depends on neither ep nor expert_tp.
- transformers (the names of the family record, ``model.family``: ``hf_transposed``, ``hf_base_prefix``,
  ``hf_ignored``, ``hf_experts``): our full names are transformers' causal-LM names; GPT-2's Conv1D weights are
  stored [in, out]; a file of the base model stores names without the base prefix; buffers such as causal masks
  are ignored; the routed MLP's stacked experts are written one linear per expert (the published layout, what
  transformers' ``save_pretrained`` writes by default) and read in that layout or stacked (transformers 5's
  in-memory layout, ``save_pretrained(save_original_format=False)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_megatron.config.schema import DEFAULT_VOCAB_MULTIPLE
from ds_megatron.expert_parallel.layout import local_experts
from ds_megatron.model import ModelConfig, build_model, family_of
from ds_megatron.model.family import EXPERT_PARTS, HF_OUTPUT, STACKED_EXPERTS
from ds_megatron.parallelize import ParallelContext, is_expert_param, shard_rule
from ds_megatron.tensor_parallel import ShardRule, shard, unshard
from ds_megatron.topology import Group


class StateDictAdapter:
    """One run's map between its full parameters (our names, ``nn.Linear``'s [out, in]), their TP shards at the
    context's tp, and a transformers file's tensors."""

    def __init__(self, parallel: ParallelContext):
        self.parallel, self.config, self.family = parallel, parallel.config, family_of(parallel.config)

    @classmethod
    def of(cls, config: ModelConfig, tp: int = 1, vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE) -> StateDictAdapter:
        """The adapter of ``config`` at ``tp`` (only the rules: no process group)."""
        return cls(ParallelContext(config, Group(size=tp), False, None, vocab_multiple))

    # ---- TP shards -------------------------------------------------------------------------------------------------
    def rule(self, name: str) -> ShardRule:
        return shard_rule(name, self.parallel)

    def shard(self, name: str, full: torch.Tensor, tp_rank: int | None = None) -> torch.Tensor:
        """This rank's parameter of the full tensor ``name``: TP rank ``tp_rank``'s (default: this rank's) shard
        (vocabulary rows padded); at ep > 1 a stacked expert tensor is this EP rank's experts instead, whole (at
        expert_tp = tp, this TP rank's shard of them)."""
        if self.parallel.ep.size > 1 and is_expert_param(name, self.parallel):
            local = local_experts(self.parallel.config.num_experts, self.parallel.ep)
            if self.parallel.expert_tp > 1:
                return self.saved_shard(name, full[local], tp_rank)
            return full[local].clone()
        return self.saved_shard(name, full, tp_rank)

    def saved_from_gathered(self, name: str, gathered: torch.Tensor) -> torch.Tensor:
        """The checkpoint's shard of a stacked expert tensor from this EP group's experts concatenated [E, ...]
        (``checkpoint/ep_state.gather_experts``): whole experts cut by the TP rule at expert_tp 1; at expert_tp = tp
        the gathered tensor is already this TP rank's shard of every expert (works on meta tensors)."""
        return gathered if self.parallel.expert_tp > 1 else self.saved_shard(name, gathered)

    def saved_shard(self, name: str, full: torch.Tensor, tp_rank: int | None = None) -> torch.Tensor:
        """TP rank ``tp_rank``'s (default: this rank's) shard of the full tensor ``name`` as checkpoint files hold
        it: the TP rule for every parameter, the experts too, at any ep."""
        rank = self.parallel.tp.rank if tp_rank is None else tp_rank
        return shard(full, self.rule(name), rank, self.parallel.tp.size)

    def merge(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor ``name`` from every TP rank's shard, the vocabulary padding stripped (a replicated
        parameter: rank 0's)."""
        return unshard(parts, self.rule(name))

    # ---- transformers ----------------------------------------------------------------------------------------------
    def canonical(self, stored: str) -> str | None:
        """The name of a stored tensor as transformers holds it on load; None for an ignored buffer."""
        return self.family.hf_canonical(stored)

    def our_name(self, stored: str) -> str | None:
        """The parameter of ours a stored tensor is (or, one expert's linear, a part of); None when ignored."""
        return self.family.our_hf_name(stored)

    def to_hf(self, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors a transformers file stores for our full tensor ``name``: one, transposed where transformers
        keeps [in, out], or one per expert and linear for a stacked expert tensor (views of ``full``)."""
        experts = self.family.hf_experts
        if experts is not None and name.endswith(STACKED_EXPERTS):
            if name.endswith(STACKED_EXPERTS[0]):
                gate, up = full.chunk(2, dim=1)  # [E, 2F, h]: each expert's gate rows, then its up rows
                pieces = {"gate": gate, "up": up}
            else:
                pieces = {"down": full}
            return {experts.stored(name, e, p): t[e] for p, t in pieces.items() for e in range(full.shape[0])}
        return {self.family.hf_name(name): full.t() if self.family.is_hf_transposed(name) else full}

    def from_hf(self, name: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Our full tensor ``name`` from the tensors stored for it, by canonical name (``canonical``).  Refuses
        (ValueError) an incomplete set of experts; works on meta tensors (the pre-flight's shape check)."""
        experts = self.family.hf_experts
        pieces = {} if experts is None else {k: experts.expert_of(k) for k in stored}
        if not pieces or set(pieces.values()) == {None}:
            if len(stored) != 1:
                raise ValueError(f"{name}: stored {len(stored)} times ({', '.join(sorted(stored))})")
            (tensor,) = stored.values()
            return tensor.t() if self.family.is_hf_transposed(name) else tensor
        count = 1 + max(p[1] for p in pieces.values() if p is not None)
        parts = ("down",) if name.endswith(STACKED_EXPERTS[1]) else EXPERT_PARTS[:2]
        want = {experts.stored(name, e, p): (e, p) for p in parts for e in range(count)}
        if set(stored) != set(want):
            odd = sorted(set(want) ^ set(stored))[0]
            raise ValueError(f"{name}: the experts' linears are not one per expert and part of {count} ({odd})")
        stacks = [torch.stack([stored[k] for k, (_, p) in want.items() if p == part]) for part in parts]
        return torch.cat(stacks, dim=1) if len(stacks) == 2 else stacks[0]

    # ---- whole state dicts (tp 1, in memory) -----------------------------------------------------------------------
    def to_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full state dict -> the transformers causal-LM class's (``load_state_dict``), including the output
        layer's key where it is tied to the embedding (transformers' state dict holds the tied copy)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            out.update({k: v.contiguous() for k, v in self.to_hf(name, tensor).items()})
        out.setdefault(HF_OUTPUT + "weight", out[self.family.layout.embedding[0] + ".weight"])
        return out

    def from_hf_state_dict(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers state dict (or a file's tensors) -> ours: ignored buffers dropped, a tensor the model has
        no parameter for accepted only as a copy of one it keeps (transformers' tied output layer)."""
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in hf_state.items():
            name = self.our_name(key)
            if name is not None:
                grouped.setdefault(name, {})[self.canonical(key)] = tensor
        shapes = expected_shapes(self.config)
        ours = {name: self.from_hf(name, group) for name, group in grouped.items() if name in shapes}
        kept = {name: shape for name, shape in shapes.items() if name in ours}
        for name in set(grouped) - set(shapes):
            if not is_copy(self.from_hf(name, grouped[name]), kept, ours.__getitem__):
                raise ValueError(f"{name}: a tensor the model has no parameter for (it would be lost)")
        return ours


def is_copy(extra: torch.Tensor, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor]) -> bool:
    """Whether a stored tensor that is no parameter of the model equals one that is (transformers' tied output
    layer): the one tensor a reader may drop, since nothing is lost.  ``read(name)``: a parameter's tensor."""
    return any(tuple(extra.shape) == shape and torch.equal(read(name), extra) for name, shape in shapes.items())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, read off the single-device model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
