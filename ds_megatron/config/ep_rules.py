"""The rules that refuse an expert-parallel size before any process group exists (standard library only, so the
config loader runs them): an EP group spans ranks of one pipeline stage that hold distinct tokens (tp x cp x dp
under sequence parallelism or at tp 1, cp x dp otherwise, where only ep 1 is allowed at tp > 1), and each EP rank
holds num_experts / ep experts.  With expert tensor parallelism (``expert_tp`` = tp > 1) each expert is split over
the tp ranks instead, which all see the same tokens once the MoE layer's input is gathered over tp: the EP group
then spans the cp x dp ranks of one tp index, with or without sequence parallelism.  ``expert_parallel.layout``
builds the groups these rules admit and explains the folding.
"""

from __future__ import annotations

from ds_megatron.config.errors import ConfigError
from ds_megatron.config.facts import BF16_OPTIMIZER, FP16_OPTIMIZER, ZERO_OPTIMIZER

SETTING = "ds_megatron.parallel.ep"
EXPERT_TP_SETTING = "ds_megatron.parallel.expert_tp"


def resolved_expert_tp(expert_tp: int | None, ep: int, tp: int) -> int:
    """How many ranks each routed expert's width F is split over: ``expert_tp`` when set; unset, today's two
    layouts: tp at ep 1 (every expert split over TP as the dense MLP is) and 1 at ep > 1 (whole experts)."""
    if expert_tp is not None:
        return expert_tp
    return tp if ep == 1 else 1


def check_expert_tp(expert_tp: int | None, ep: int, tp: int) -> None:
    """``expert_tp`` is 1 or tp; at ep 1 and tp > 1 only tp (whole experts on every tp rank are not built)."""
    if expert_tp is None:
        return
    valid = [tp] if ep == 1 else sorted({1, tp})
    if expert_tp in valid:
        return
    raise ConfigError(
        EXPERT_TP_SETTING, "each routed expert is split over expert_tp ranks: 1 (whole experts, needs ep > 1 at "
        "tp > 1) or tp (each expert's width split over the tp ranks)", f"expert_tp={expert_tp}, ep={ep}, tp={tp}",
        f"use expert_tp in {valid} (or leave it unset: tp at ep 1, 1 at ep > 1)",
    )  # fmt: skip


def token_ranks(tp: int, cp: int, dp: int, sequence_parallel: bool, expert_tp: int = 1) -> int:
    """How many ranks of one pipeline stage hold distinct tokens that one EP group may span (module docstring); at
    expert_tp > 1 the tokens after the gather over tp, the same on every tp rank."""
    if expert_tp > 1:
        return cp * dp
    return tp * cp * dp if sequence_parallel or tp == 1 else cp * dp


def valid_ep_values(
    tp: int, cp: int, dp: int, sequence_parallel: bool, num_experts: int | None = None, expert_tp: int = 1
) -> list[int]:
    """Every ep the folding can form (and that splits ``num_experts`` evenly, when given)."""
    # without SP at tp > 1 and whole experts, only ep 1: an EP group there would span tp ranks routing the same tokens
    folds = sequence_parallel or tp == 1 or expert_tp > 1
    n = token_ranks(tp, cp, dp, sequence_parallel, expert_tp) if folds else 1
    return [e for e in range(1, n + 1) if n % e == 0 and (num_experts is None or num_experts % e == 0)]


def check_ep(
    ep: int,
    tp: int,
    cp: int,
    dp: int,
    sequence_parallel: bool,
    num_experts: int | None = None,
    expert_tp: int = 1,
) -> None:
    """Refuse an ep the folding cannot form, in one line naming the valid values."""
    valid = valid_ep_values(tp, cp, dp, sequence_parallel, num_experts, expert_tp)
    if ep in valid:
        return
    values = f"ep={ep}, tp={tp}, cp={cp}, dp={dp}, sequence_parallel={str(sequence_parallel).lower()}"
    if expert_tp > 1:
        values += f", expert_tp={expert_tp}"
    if num_experts is not None:
        values += f", num_experts={num_experts}"
    if ep > 1 and tp > 1 and not sequence_parallel and expert_tp == 1:
        problem = "an EP group spans ranks holding distinct tokens; without sequence parallelism tp ranks share theirs"
        split = ep in valid_ep_values(tp, cp, dp, sequence_parallel, num_experts, expert_tp=tp)
        fix = "turn on sequence_parallel" + (f", set expert_tp to {tp}" if split else "") + f", or use ep in {valid}"
    elif expert_tp > 1:
        problem = "at expert_tp = tp an EP group spans the cp x dp ranks of one tp index: ep must divide cp x dp"
        if num_experts is not None:
            problem += " and num_experts"
        fix = f"use ep in {valid}"
    else:
        problem = "ep must divide the ranks of a stage holding distinct tokens (tp x cp x dp under SP, cp x dp without)"
        if num_experts is not None:
            problem += " and num_experts"
        fix = f"use ep in {valid}"
    raise ConfigError(SETTING, problem, values, fix)


def check_ep_model(ep: int, num_experts: int | None, family: str) -> None:
    """ep > 1 splits routed experts: refuse it for a model that has none."""
    if ep > 1 and not num_experts:
        raise ConfigError(
            SETTING, "expert parallelism splits routed experts, and this model has none",
            f"ep={ep}, family={family}", "use ep 1, or a routed family (qwen3_moe, mixtral, qwen2_moe)",
        )  # fmt: skip


def check_num_experts(num_experts: int, ep: int) -> None:
    """Each EP rank holds num_experts / ep experts: refuse an uneven split."""
    if num_experts % ep != 0:
        divisors = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ConfigError(
            SETTING, "each EP rank holds num_experts / ep experts", f"num_experts={num_experts}, ep={ep}",
            f"use ep in {divisors}",
        )  # fmt: skip


CHUNKS_SETTING = "ds_megatron.parallel.ep_dispatch_chunks"


def check_dispatch_chunks(chunks: int, ep: int, num_experts: int | None) -> None:
    """The overlapped exchange cuts each EP rank's num_experts / ep local experts into ``chunks`` ranges
    (``expert_parallel.overlap``): refuse a count that is not 1..E/ep, or above 1 where nothing is exchanged (ep 1)."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(CHUNKS_SETTING, "must be a positive integer", f"got {chunks!r}", "use 1 (no overlap) or more")
    if chunks > 1 and ep == 1:
        raise ConfigError(
            CHUNKS_SETTING, "overlaps the expert-parallel exchange, and ep 1 exchanges nothing",
            f"ep_dispatch_chunks={chunks}, ep=1", "use 1, or ep > 1",
        )  # fmt: skip
    local = (num_experts or 0) // ep
    if chunks > 1 and chunks > local:
        raise ConfigError(
            CHUNKS_SETTING, "each chunk is a range of an EP rank's num_experts / ep local experts",
            f"ep_dispatch_chunks={chunks}, num_experts={num_experts}, ep={ep}: {local} local experts",
            f"use ep_dispatch_chunks in {list(range(1, local + 1))}",
        )  # fmt: skip


# The optimizer wrappers of DeepSpeed (config.facts.optimizer_wrapper) that train ep > 1, and why the others
# do not (each reason is the refusal's text).
EP_OPTIMIZER_WRAPPERS = (
    None,  # plain fp32 at ZeRO 0: ClippedAdamW (optim.global_grad_norm)
    BF16_OPTIMIZER,  # DeepSpeed's BF16 optimizer (bf16 at ZeRO 0, bf16 + ZeRO-1 with fp32 accumulation)
    ZERO_OPTIMIZER,  # DeepSpeed's ZeRO optimizer (fp32 + ZeRO-1, bf16 + ZeRO-1 with bf16 accumulation), not fp16
)
EP_REFUSED_WRAPPERS = {
    FP16_OPTIMIZER: "DeepSpeed's fp16 optimizer (around a torch optimizer) leaves expert gradients out of the norm "
    "it clips by and logs (FP16_UnfusedOptimizer.step), so every rank would clip by the non-expert gradients' norm",
}
# fp16 on DeepSpeed's ZeRO optimizer: its expert handling is the one bf16 and fp32 train with, but its loss scaler
# with experts has never run here (DeepSpeed's CPU accelerator refuses fp16 where the CPU lacks fp16 kernels).  The
# fp16 optimizer's overflow check is not the reason for its refusal: its CheckOverflow takes the max over the largest
# registered EP group and the model group, so every rank skips alike.
EP_ZERO_FP16_REFUSAL = (
    "fp16 on DeepSpeed's ZeRO optimizer is untested at ep > 1 (its dynamic loss scaling with experts has not been "
    "checked against ep 1)"
)
# What DeepSpeed's ZeRO optimizer needs to handle experts (its _configure_moe_settings asserts the first; its CPU
# offload norm, complete_grad_norm_calculation_for_cpu_offload, counts experts on TP rank 0 only, like the norm
# engine.count_experts_on_every_tp_rank corrects, and is not corrected), and to save them (checkpoint/ep_state.py
# writes its optimizer files in the rigid layout, a list of per-group states being the elastic one).
EP_ZERO_OPTIONS = {
    "zero_optimization.reduce_scatter": "DeepSpeed's ZeRO optimizer reduces expert gradients over their expert-DP "
    "group only on its reduce-scatter path",
    "zero_optimization.offload_optimizer": "DeepSpeed's ZeRO optimizer counts experts in the gradient norm on TP "
    "rank 0 only when it offloads, and ds_megatron corrects its on-device norm only",
    "zero_optimization.elastic_checkpoint": "DeepSpeed's ZeRO optimizer's files are written as the ep 1 run's at "
    "ep > 1 in its default (rigid) layout only",
}


def check_ep_optimizer(ep: int, wrapper: str | None, zero_stage: int, grad_accum_dtype: str, precision: str) -> None:
    """Refuse, at ep > 1, an optimizer wrapper whose expert handling does not fit ours (``EP_REFUSED_WRAPPERS``),
    and fp16 on the ZeRO optimizer (``EP_ZERO_FP16_REFUSAL``)."""
    if ep == 1 or (wrapper in EP_OPTIMIZER_WRAPPERS and not (wrapper == ZERO_OPTIMIZER and precision == "fp16")):
        return
    problem = EP_REFUSED_WRAPPERS.get(wrapper, EP_ZERO_FP16_REFUSAL)
    raise ConfigError(
        SETTING, problem,
        f"ep={ep}, DeepSpeed optimizer wrapper {wrapper} (precision {precision}, zero_optimization.stage="
        f"{zero_stage}, grad_accum_dtype={grad_accum_dtype})",
        "use bf16 or fp32 (at ZeRO 0 or 1), or ep 1",
    )  # fmt: skip


def check_ep_zero_options(
    ep: int, wrapper: str | None, reduce_scatter: bool, offload: str | None, elastic_checkpoint: bool = False
) -> None:
    """At ep > 1 on DeepSpeed's ZeRO optimizer, refuse the options its expert handling lacks (``EP_ZERO_OPTIONS``)."""
    if ep == 1 or wrapper != ZERO_OPTIMIZER:
        return
    values = f"ep={ep}, DeepSpeed optimizer wrapper {wrapper}"
    if not reduce_scatter:
        key = "zero_optimization.reduce_scatter"
        raise ConfigError(key, EP_ZERO_OPTIONS[key], f"{values}, reduce_scatter=false", "remove it (default true)")
    if offload not in (None, "none"):
        key = "zero_optimization.offload_optimizer"
        raise ConfigError(key, EP_ZERO_OPTIONS[key], f"{values}, device={offload}", "remove it, or use ep 1")
    if elastic_checkpoint:
        key = "zero_optimization.elastic_checkpoint"
        raise ConfigError(key, EP_ZERO_OPTIONS[key], f"{values}, elastic_checkpoint=true", "remove it (default false)")
