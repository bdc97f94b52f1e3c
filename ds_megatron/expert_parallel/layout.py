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

The gradient rule (``expert_parallel.layer.reduce_expert_grads``): an expert's gradient on its owner already sums
the contributions of the tokens of every rank in the EP group (the combine's backward sends them home), so expert
parameters are summed over the expert-DP group only (EP x expert-DP covers every token rank of the stage once) and
divided by ``dp * cp``, the data-axis size over which DeepSpeed averages every other gradient: both are then the
same mean over the global batch.  DeepSpeed's own MoE reduction (``DeepSpeedEngine._reduce_expert_gradients``) has
the same form: a sum over its expert-DP group divided by the data-parallel world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_megatron.config.errors import ConfigError

SETTING = "ds_megatron.parallel.ep"


def token_ranks(tp: int, cp: int, dp: int, sequence_parallel: bool) -> int:
    """How many ranks of one pipeline stage hold distinct tokens that one EP group may span (module docstring)."""
    return tp * cp * dp if sequence_parallel or tp == 1 else cp * dp


def valid_ep_values(tp: int, cp: int, dp: int, sequence_parallel: bool, num_experts: int | None = None) -> list[int]:
    """Every ep the folding can form (and that splits ``num_experts`` evenly, when given)."""
    # without SP at tp > 1 only ep 1: an EP group there would span tp ranks routing the same tokens
    n = token_ranks(tp, cp, dp, sequence_parallel) if sequence_parallel or tp == 1 else 1
    return [e for e in range(1, n + 1) if n % e == 0 and (num_experts is None or num_experts % e == 0)]


def check_ep(ep: int, tp: int, cp: int, dp: int, sequence_parallel: bool, num_experts: int | None = None) -> None:
    """Refuse an ep the folding cannot form, in one line naming the valid values."""
    valid = valid_ep_values(tp, cp, dp, sequence_parallel, num_experts)
    if ep in valid:
        return
    values = f"ep={ep}, tp={tp}, cp={cp}, dp={dp}, sequence_parallel={str(sequence_parallel).lower()}"
    if num_experts is not None:
        values += f", num_experts={num_experts}"
    if ep > 1 and tp > 1 and not sequence_parallel:
        problem = "an EP group spans ranks holding distinct tokens; without sequence parallelism tp ranks share theirs"
        fix = f"turn on sequence_parallel, or use ep in {valid}"
    else:
        problem = "ep must divide the ranks of a stage holding distinct tokens (tp x cp x dp under SP, cp x dp without)"
        if num_experts is not None:
            problem += " and num_experts"
        fix = f"use ep in {valid}"
    raise ConfigError(SETTING, problem, values, fix)


def check_num_experts(num_experts: int, ep: int) -> None:
    """Each EP rank holds num_experts / ep experts: refuse an uneven split."""
    if num_experts % ep != 0:
        divisors = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ConfigError(
            SETTING, "each EP rank holds num_experts / ep experts", f"num_experts={num_experts}, ep={ep}",
            f"use ep in {divisors}",
        )  # fmt: skip


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
    tp: int, cp: int, dp: int, pp: int, ep: int, sequence_parallel: bool, num_experts: int | None = None
) -> EPLayout:
    """The EP and expert-DP groups of a (tp, cp, dp, pp) world at ``ep`` (module docstring: the folding)."""
    check_ep(ep, tp, cp, dp, sequence_parallel, num_experts)
    stage = tp * cp * dp
    ep_groups: list[tuple[int, ...]] = []
    expert_dp_groups: list[tuple[int, ...]] = []
    for pp_rank in range(pp):
        base = pp_rank * stage
        if sequence_parallel or tp == 1:
            lines = [list(range(base, base + stage))]
        else:  # the tp ranks hold the same tokens: one line per tp rank, its cp x dp ranks (stride tp)
            lines = [list(range(base + t, base + stage, tp)) for t in range(tp)]
        for line in lines:
            blocks = [tuple(line[i : i + ep]) for i in range(0, len(line), ep)]
            ep_groups += blocks
            expert_dp_groups += [tuple(column) for column in zip(*blocks, strict=True)]
    return EPLayout(ep, tuple(ep_groups), tuple(expert_dp_groups), expert_grad_divisor=dp * cp)
