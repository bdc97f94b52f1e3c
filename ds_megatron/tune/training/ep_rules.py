"""The expert-parallel rules the tuner mirrors, read from their one owner, ``ds_megatron.config.ep_rules`` (the
run's loader refuses the same layouts with the same functions): the (ep, expert_tp) layouts the folding can form
(whole experts: an EP group spans the dp x cp ranks of a stage and, under SP, its tp ranks; experts split over TP,
expert_tp = tp: the cp x dp ranks of one tp index; ep divides them and the experts), the optimizer wrapper of the
precision the tuner writes.  Standard library only."""

from __future__ import annotations

from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.ep_rules import (
    check_ep,
    check_ep_optimizer,
    check_expert_tp,
    check_num_experts,
    resolved_expert_tp,
    valid_ep_values,
)
from ds_megatron.config.facts import grad_accum_dtype, optimizer_wrapper, zero_stage
from ds_megatron.config.facts import precision as precision_of


def written_precision(zero: int) -> dict:
    """The precision keys of every config the tuner writes (``written.ds_config``): bf16 with fp32 gradient
    accumulation at ZeRO stage ``zero`` (DeepSpeed's BF16 optimizer at stage 1), whose model states the memory
    model counts."""
    return {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": zero}}


def ep_layouts(
    model: ModelShape, tp: int, cp: int, dp: int, sequence_parallel: bool
) -> list[tuple[int | None, int | None]]:
    """The (ep, expert_tp) layouts searched at (tp, cp, dp, SP): for a routed family every ep the folding can form
    with whole experts (expert_tp None: the default resolution, tp at ep 1) and, at tp > 1, every ep > 1 it forms
    with each expert split over the tp ranks (expert_tp = tp), each splitting the experts evenly; [(None, None)]
    for a dense one (no experts: no ep)."""
    if not model.num_experts:
        return [(None, None)]
    layouts: list[tuple[int | None, int | None]] = [
        (ep, None) for ep in valid_ep_values(tp, cp, dp, sequence_parallel, model.num_experts)
    ]
    if tp > 1:
        split = valid_ep_values(tp, cp, dp, sequence_parallel, model.num_experts, expert_tp=tp)
        layouts += [(ep, tp) for ep in split if ep > 1]
    return layouts


def refusal(
    model: ModelShape,
    tp: int,
    cp: int,
    dp: int,
    sequence_parallel: bool,
    ep: int,
    zero: int = 1,
    expert_tp: int | None = None,
) -> str | None:
    """Why the run would refuse ``ep`` (and ``expert_tp``; None: the default resolution) at (tp, cp, dp, SP) with the
    written precision at ``zero`` (the rule's one-line problem and values), or None when it accepts it."""
    precision = written_precision(zero)
    try:
        check_expert_tp(expert_tp, ep, tp)
        if ep == 1:
            return None
        check_num_experts(model.num_experts, ep)
        check_ep(ep, tp, cp, dp, sequence_parallel, model.num_experts, resolved_expert_tp(expert_tp, ep, tp))
        check_ep_optimizer(
            ep,
            optimizer_wrapper(precision),
            zero_stage(precision),
            grad_accum_dtype(precision),
            precision_of(precision),
        )
    except ConfigError as err:
        return f"{err.problem} ({err.values})"
    return None
