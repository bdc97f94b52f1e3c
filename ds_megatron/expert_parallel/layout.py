"""The expert-parallel (EP) group layout and the rules that refuse one before any process group exists.  Standard
library only (plain integers in, rank lists or one ``ConfigError`` line out), so a pre-flight check can call it.

Ranks are ordered as ``ds_megatron.topology`` lays them out, tp innermost, then cp, then dp, then pp:
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.  The tp x cp x dp ranks of one pipeline stage
are consecutive, and the MoE layers of that stage live on them.

The folding: EP splits the experts over ranks that hold different tokens; each rank routes its own tokens and sends
them to the experts' owners.  In one stage, dp ranks hold different samples and cp ranks different chunks of a
sequence, always; tp ranks hold different sequence shards under sequence parallelism (the MoE MLP runs where SP keeps
the [s/t, b, h] shard, as the norms do) and the same tokens without it.  So under SP (or at tp 1) an EP group is
``ep`` consecutive ranks of the stage's tp x cp x dp: tp first, then cp, then dp, the innermost ranks, inside one
node while ep fits in it (the all-to-alls carry every routed token twice per layer, forward and again backward, so
they get the fastest links).  A rank's expert-data-parallel (expert-DP) group is the ranks at its position in every
other EP group of the stage (stride ep), ``tp * cp * dp / ep`` of them: they hold the same experts.
Without SP at tp > 1, ep > 1 is refused: the tp ranks would route the same tokens, each holding and running the
same experts (tp times the expert memory and compute for nothing), which Megatron's folding refuses too (it requires
SP with TP and EP).  At ep 1 every rank holds every expert; the expert-DP group is then every rank holding distinct
tokens of the stage (the data axis per tp rank without SP).

Expert tensor parallelism (``expert_tp`` = tp > 1): the MoE layer's tokens are gathered over tp as the dense MLP's
are (all-gather of the sequence shard under SP, the same tokens anyway without it), so the tp ranks route the same
tokens and each holds its F/t slice of every expert it owns; an EP group is then ``ep`` ranks of one tp index, one
line per tp index over the stage's cp x dp ranks (stride tp), with or without SP, and the expert-DP group the ranks
at its position in the other EP groups of its line.  The divisor stays dp x cp: each line covers every token once.

The gradient rule (``expert_parallel.layer.reduce_expert_grads``): an expert's gradient on its owner already sums
the contributions of the tokens of every rank in the EP group (the combine's backward sends them home), so expert
parameters are summed over the expert-DP group only (EP x expert-DP covers every token rank of the stage once) and
divided by ``dp * cp``, the data-axis size over which DeepSpeed averages every other gradient: both are then the
same mean over the global batch.  DeepSpeed's own MoE reduction (``DeepSpeedEngine._reduce_expert_gradients``) has
the same form: a sum over its expert-DP group divided by the data-parallel world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# the refusals live with the config, which runs them before any process group exists (config.ep_rules)
from ds_megatron.config.ep_rules import (
    SETTING,
    check_dispatch_chunks,
    check_ep,
    check_num_experts,
    token_ranks,
    valid_ep_values,
)

if TYPE_CHECKING:
    from ds_megatron.topology import Group

__all__ = [
    "SETTING",
    "EPLayout",
    "check_dispatch_chunks",
    "check_ep",
    "check_num_experts",
    "ep_layout",
    "token_ranks",
    "valid_ep_values",
]


@dataclass(frozen=True)
class EPLayout:
    """Every EP and expert-DP group of the world, as sorted global rank lists (every rank creates every group, in
    this order).  ``expert_grad_divisor`` is what the expert-DP sum of expert gradients is divided by (dp x cp)."""

    ep: int
    ep_groups: tuple[tuple[int, ...], ...]
    expert_dp_groups: tuple[tuple[int, ...], ...]
    expert_grad_divisor: int

    def ep_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.ep_groups if rank in g)

    def expert_dp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.expert_dp_groups if rank in g)


def ep_layout(
    tp: int,
    cp: int,
    dp: int,
    pp: int,
    ep: int,
    sequence_parallel: bool,
    num_experts: int | None = None,
    expert_tp: int = 1,
) -> EPLayout:
    """The EP and expert-DP groups of a (tp, cp, dp, pp) world at ``ep`` and ``expert_tp`` (module docstring: the
    folding)."""
    check_ep(ep, tp, cp, dp, sequence_parallel, num_experts, expert_tp)
    stage = tp * cp * dp
    ep_groups: list[tuple[int, ...]] = []
    expert_dp_groups: list[tuple[int, ...]] = []
    for pp_rank in range(pp):
        base = pp_rank * stage
        if (sequence_parallel or tp == 1) and expert_tp == 1:
            lines = [list(range(base, base + stage))]
        else:  # the tp ranks hold the same tokens: one line per tp rank, its cp x dp ranks (stride tp)
            lines = [list(range(base + t, base + stage, tp)) for t in range(tp)]
        for line in lines:
            blocks = [tuple(line[i : i + ep]) for i in range(0, len(line), ep)]
            ep_groups += blocks
            expert_dp_groups += [tuple(column) for column in zip(*blocks, strict=True)]
    return EPLayout(ep, tuple(ep_groups), tuple(expert_dp_groups), expert_grad_divisor=dp * cp)


def local_experts(num_experts: int, ep: Group) -> slice:
    """The global experts EP rank ``ep.rank`` holds: experts i E/ep .. (i + 1) E/ep - 1 of E (every expert at ep 1),
    the single-device tensors' slice along their expert dim."""
    per_rank = num_experts // ep.size
    return slice(ep.rank * per_rank, (ep.rank + 1) * per_rank)
