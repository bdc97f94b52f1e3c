"""The search space: every (tp, cp, pp, dp, sp, ep, b, recompute, attention, zero, schedule and its v) the tuner
considers under the package's layout rules and the pipeline engine's limits (the table is in docs/tuner.md, "The
search space"), and every family left out, with its reason.  Pure Python."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.config.ep_rules import resolved_expert_tp
from ds_megatron.config.rules import TP_SPLITS, core_attn_saves_nothing
from ds_megatron.config.schema import ATTENTION_KERNELS
from ds_megatron.pipeline_parallel.schedules import schedule_named
from ds_megatron.tune.core.memory_model import layers_per_stage
from ds_megatron.tune.core.spec import (
    SDPA_CORE_ATTN_REASON,
    Candidate,
    Cluster,
    Pins,
    ordered_modules,
)
from ds_megatron.tune.training import cp_rules, ep_rules, schedules

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)

# The module sets selective recompute is searched with, per attention kernel.  Eager: the s x s core alone (the
# paper's selective recompute: the most memory for the least recompute), and everything (the norm and activation
# outputs cost one memory-bound elementwise pass each, so they are worth adding where memory is short).  sdpa
# stores no s x s core, so it has only the other two, together or alone (each alone saves less and costs less).
SELECTIVE_MODULES = {
    "eager": (("core_attn",), ("core_attn", "mlp_act", "layernorm")),
    "sdpa": (("mlp_act", "layernorm"), ("mlp_act",), ("layernorm",)),
}
# A routed family's experts keep most of a block's activations (4 k F per token for their SwiGLU, k h and more for
# the routed rows), so ``moe`` (their forward GEMMs once more in backward, at any ep) is searched too: with the
# kernel's smallest set (eager's core alone; sdpa: nothing else, then the norms, the one other module that touches
# a routed block) and with its largest.
ROUTED_SELECTIVE_MODULES = {
    "eager": (("core_attn", "moe"), ("core_attn", "mlp_act", "layernorm", "moe")),
    "sdpa": (("moe",), ("layernorm", "moe")),
}

# Context parallelism is searched (unpinned) from this sequence length on.  Below it every shipped size fits with
# tp, SP, pp and recompute alone, and CP only adds K/V traffic and shorter matmuls; above it a block's activations
# (about 34 s b h / t bytes under SP) outgrow a GPU's share for the larger models, which is what CP is for.  Keeping
# the search at cp 1 below it also keeps those searches (and their reports) exactly what they were.  --cp N searches
# that cp at any length.
CP_MIN_SEQ_LENGTH = 16384

ZERO0_REASON = (
    "ZeRO stage 0 is not offered: with bf16 and fp32 gradient accumulation DeepSpeed's pipeline engine accepts only "
    "stage 1 (stage 0 raises NotImplementedError in engine._do_optimizer_sanity_check), and its bf16 stage-0 path "
    "shards the optimizer like stage 1 anyway, only with unsafe bf16 accumulation"
)


@dataclass
class Rejection:
    """A family of configurations left out, the dimensions it shares and why."""

    family: dict
    reason: str
    count: int = 0  # candidates of the family that were evaluated (0: excluded before evaluation)
    required_bytes: float | None = None  # out-of-memory families: what the closest member needs

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def tp_sizes(model: ModelShape, cluster: Cluster, pins: Pins) -> tuple[list[int], list[Rejection]]:
    """Tensor-parallel sizes that divide the heads (query and KV) and the MLP width and fit in one node."""
    node = min(cluster.gpus_per_node, cluster.num_gpus)
    divisors = [tp for tp in range(1, model.num_heads + 1) if model.num_heads % tp == 0]
    divisors = [tp for tp in divisors if pins.tp is None or tp == pins.tp]
    rejected = []
    for name in (n for n in TP_SPLITS if n != "num_heads"):
        value = getattr(model, name)
        left_out = [tp for tp in divisors if value % tp != 0]
        if left_out:
            rejected.append(Rejection({"tp": left_out}, f"tp does not divide {name} ({value}): {TP_SPLITS[name]}"))
            divisors = [tp for tp in divisors if tp not in left_out]
    too_big = [tp for tp in divisors if tp > node]
    if too_big:
        reason = f"tp > GPUs per node ({node}): TP communicates in every layer and must stay on NVLink"
        rejected.append(Rejection({"tp": too_big}, reason))
    straddling = [tp for tp in divisors if tp <= node and node % tp != 0]
    if straddling:
        reason = f"tp does not divide the node ({node} GPUs): a TP group would straddle two nodes"
        rejected.append(Rejection({"tp": straddling}, reason))
    sizes = [tp for tp in divisors if tp <= node and node % tp == 0]
    return sizes, rejected


def attention_options(pins: Pins) -> list[str]:
    """The attention kernels to try: both unless pinned."""
    return [k for k in ATTENTION_KERNELS if pins.attention is None or k == pins.attention]


def selective_modules(kernel: str, pins: Pins, routed: bool = False) -> tuple[tuple[str, ...], ...]:
    """The module sets selective recompute is tried with under ``kernel``: the pinned set where the kernel allows it,
    else the kernel's row of SELECTIVE_MODULES (and for a ``routed`` family ROUTED_SELECTIVE_MODULES' too)."""
    if pins.recompute_modules is None:
        return SELECTIVE_MODULES[kernel] + (ROUTED_SELECTIVE_MODULES[kernel] if routed else ())
    pinned = ordered_modules(pins.recompute_modules)
    return () if core_attn_saves_nothing(kernel, pinned) else (pinned,)


def recompute_options(
    num_blocks: int, kernel: str, pins: Pins, routed: bool = False
) -> list[tuple[str, int, str, tuple[str, ...]]]:
    """(policy, k, method, modules) choices for a stage of ``num_blocks`` blocks under attention ``kernel`` (a
    ``routed`` family's selective sets include ``moe``: ``selective_modules``).  At
    cp > 1 eager's core_attn checkpoints the whole cp_comm call (the run does: its exchange runs again in backward),
    which keeps q, k, v and drops the core's output and log-sum-exp."""
    ks = sorted({k for k in (2**i for i in range(num_blocks.bit_length())) if k < num_blocks} | {num_blocks})
    options = [("none", 1, "uniform", ())]
    options += [("selective", 1, "uniform", modules) for modules in selective_modules(kernel, pins, routed)]
    options += [("full", k, "uniform", ()) for k in ks]
    options += [("full", k, "block", ()) for k in ks if k < num_blocks]  # block with k = n equals uniform with k = 1
    policy = "selective" if pins.recompute_modules is not None else pins.recompute
    return [o for o in options if policy is None or o[0] == policy]


def cp_sizes(model: ModelShape, replicas: int, pins: Pins) -> list[int]:
    """The cp degrees to try where ``replicas`` = GPUs / (tp x pp) ranks share the data and context axes: the pinned
    one, else every divisor from CP_MIN_SEQ_LENGTH tokens on, else 1."""
    if pins.cp is not None:
        return [pins.cp] if replicas % pins.cp == 0 else []
    if model.seq_length < CP_MIN_SEQ_LENGTH:
        return [1]
    return [cp for cp in range(1, replicas + 1) if replicas % cp == 0]


def cp_comm_options(cp: int, pins: Pins) -> list[str]:
    """The exchanges to try at ``cp``: both (or the pinned one) when cp > 1; at cp 1 there is none ("ring" stands
    for it, as in a cp 1 config)."""
    if cp == 1:
        return ["ring"]
    return [c for c in cp_rules.cp_comms() if pins.cp_comm is None or c == pins.cp_comm]


def schedule_options(pins: Pins) -> tuple[str, ...]:
    """The pipeline schedules to try: the pinned one, all of them (``--schedule all``), else DEFAULT_SCHEDULES."""
    if pins.schedule is None:
        return schedules.DEFAULT_SCHEDULES
    return schedules.SCHEDULES if pins.schedule == schedules.ALL else (pins.schedule,)


def layout_candidates(
    model: ModelShape, global_batch_size: int, tp: int, pp: int, dp: int, pins: Pins, cp: int = 1
) -> tuple[list[Candidate], list[Rejection]]:
    """Every candidate of one (tp, cp, pp, dp) layout, and the micro-batch / SP / cp_comm families it cannot use."""
    layout = {"tp": tp, "pp": pp, "dp": dp, **({"cp": cp} if cp > 1 else {})}
    if global_batch_size % dp != 0:
        reason = f"global batch ({global_batch_size}) not divisible by dp ({dp})"
        return [], [Rejection(layout, reason)]
    per_replica = global_batch_size // dp
    sizes = (pins.micro_batch_size,) if pins.micro_batch_size is not None else MICRO_BATCH_SIZES
    rejected = []
    not_dividing = [b for b in sizes if per_replica % b != 0]
    if not_dividing:
        reason = f"b does not divide the batch per replica ({global_batch_size}/dp = {per_replica})"
        rejected.append(Rejection({**layout, "micro_batch_size": not_dividing}, reason))
    too_few = [b for b in sizes if per_replica % b == 0 and per_replica // b < pp]
    if too_few:
        reason = f"m = {global_batch_size}/(dp x b) < pp ({pp}): the 1F1B pipeline never fills"
        rejected.append(Rejection({**layout, "micro_batch_size": too_few}, reason))
    micro = [b for b in sizes if b not in not_dividing and b not in too_few]

    sp_options = [False, True] if tp > 1 else [False]
    if pins.sequence_parallel is not None:
        sp_options = [sp for sp in sp_options if sp == pins.sequence_parallel]
    if True in sp_options and model.seq_length % tp != 0:
        sp_options.remove(True)
        reason = f"SP needs seq_length ({model.seq_length}) divisible by tp ({tp})"
        rejected.append(Rejection({**layout, "sequence_parallel": True}, reason))

    # The run's own CP rules (sequence length per SP choice, a2a heads, attention dropout), each family refused once.
    allowed = []
    for comm in cp_comm_options(cp, pins):
        for sp in sp_options:
            why = cp_rules.refusal(model, tp, cp, comm, sp)
            if why is None:
                allowed.append((comm, sp))
            else:
                family = {**layout, "cp_comm": comm, **({"sequence_parallel": sp} if tp > 1 else {})}
                rejected.append(Rejection(family, why))

    runs = {}  # schedule -> the micro-batch sizes it can run
    for schedule in schedule_options(pins):
        refused: dict[str, list[int]] = {}
        for b in micro:
            why = schedules.refusal(schedule, pp, per_replica // b)
            if why is not None:
                refused.setdefault(why, []).append(b)
        for why, sizes_refused in refused.items():
            family = {**layout, "pipeline_schedule": schedule, "micro_batch_size": sizes_refused}
            rejected.append(Rejection(family, why))
        runs[schedule] = [b for b in micro if schedules.refusal(schedule, pp, per_replica // b) is None]

    # Expert parallelism (routed families): every (ep, expert_tp) the folding forms at each SP choice (or the pinned).
    eps = {}
    for comm, sp in allowed:
        values = ep_rules.ep_layouts(model, tp, cp, dp, sp)
        if values != [(None, None)] and (pins.ep is not None or pins.expert_tp is not None):
            values, why = _pinned_ep_layouts(model, tp, cp, dp, sp, pins, values)
            if why is not None:
                pinned = {"ep": pins.ep, "expert_tp": pins.expert_tp}
                family = {**layout, **({"sequence_parallel": sp} if tp > 1 else {})}
                rejected.append(Rejection({**family, **{k: v for k, v in pinned.items() if v is not None}}, why))
        eps[comm, sp] = values

    recompute = {}
    stages = {}  # schedule -> the stages per rank it is searched at (None: fixed by its record)
    for schedule in list(runs):
        stages[schedule] = schedules.virtual_stage_options(schedule, model.num_layers, pp, pins.virtual_stages)
        if not stages[schedule] and runs[schedule]:
            family = {**layout, "pipeline_schedule": schedule}
            reason = f"no v >= 2 divides the layers per stage evenly ({model.num_layers} layers / pp {pp})"
            rejected.append(Rejection(family, reason))
    for schedule in runs:  # full recompute's k counts blocks of one stage: with v stages per rank, ceil(L/(v p))
        for v in stages[schedule]:
            num_blocks = layers_per_stage(model.num_layers, schedule_named(schedule, v).per_rank() * pp)
            recompute[schedule, v] = {
                k: recompute_options(num_blocks, k, pins, bool(model.num_experts)) for k in attention_options(pins)
            }
    of_layout = functools.partial(Candidate, tp, pp, dp)
    candidates = [
        of_layout(sp, b, per_replica // b, policy, k, method, 1, kernel, modules, cp, comm, schedule, v, **experts)
        for schedule, schedule_micro in runs.items()
        for v in stages[schedule]
        for comm, sp in allowed
        for experts in ({"ep": ep, "expert_tp": etp} for ep, etp in eps[comm, sp])
        for b in schedule_micro
        for kernel, options in recompute[schedule, v].items()
        for policy, k, method, modules in options
    ]
    return candidates, rejected


def _pinned_ep_layouts(
    model: ModelShape, tp: int, cp: int, dp: int, sp: bool, pins: Pins, searched: list
) -> tuple[list[tuple[int, int | None]], str | None]:
    """The (ep, expert_tp) layouts ``--ep`` and ``--expert-tp`` leave at (tp, cp, dp, SP) that the run accepts, and
    why none is left (the first refusal), else None.  ``--ep`` alone: that ep with whole experts and, at ep > 1 and
    tp > 1, with experts split over TP; ``--expert-tp`` alone: the searched layouts of that split."""
    if pins.ep is not None:
        asked = [(pins.ep, pins.expert_tp)]
        if pins.expert_tp is None and pins.ep > 1 and tp > 1:
            asked.append((pins.ep, tp))
    else:
        asked = [(ep, etp) for ep, etp in searched if resolved_expert_tp(etp, ep, tp) == pins.expert_tp]
        asked = asked or [(1, pins.expert_tp)]  # none: the rule's refusal of the split at ep 1 names the valid ones
    reasons = [ep_rules.refusal(model, tp, cp, dp, sp, ep, pins.zero or 1, etp) for ep, etp in asked]
    kept = [layout for layout, why in zip(asked, reasons, strict=True) if why is None]
    return kept, None if kept else reasons[0]


def enumerate_candidates(
    model: ModelShape, cluster: Cluster, global_batch_size: int, pins: Pins
) -> tuple[list[Candidate], list[Rejection]]:
    """All candidates allowed by the pins, and the families left out before any memory or time is modelled."""
    rejected: list[Rejection] = []
    if pins.zero in (None, 0):
        rejected.append(Rejection({"zero_stage": 0}, ZERO0_REASON))
    if pins.zero == 0:
        return [], rejected
    if "sdpa" in attention_options(pins) and pins.recompute in (None, "selective"):
        asked = ("core_attn",) if pins.recompute_modules is None else ordered_modules(pins.recompute_modules)
        if core_attn_saves_nothing("sdpa", asked):  # what the unpinned search leaves out, or all a pinned set gives
            family = {"attention": "sdpa", "recompute": "selective", "recompute_modules": ",".join(asked)}
            rejected.append(Rejection(family, SDPA_CORE_ATTN_REASON))
    tps, tp_rejected = tp_sizes(model, cluster, pins)
    rejected += tp_rejected
    candidates: list[Candidate] = []
    for tp in tps:
        skipped = []
        for pp in range(1, model.num_layers + 1):
            if pins.pp is not None and pp != pins.pp:
                continue
            if cluster.num_gpus % (tp * pp) != 0:
                skipped.append(pp)
                continue
            for cp in cp_sizes(model, cluster.num_gpus // (tp * pp), pins):
                dp = cluster.num_gpus // (tp * cp * pp)
                if pins.dp is not None and dp != pins.dp:
                    continue
                found, why = layout_candidates(model, global_batch_size, tp, pp, dp, pins, cp)
                candidates += found
                rejected += why
        if skipped and pins.pp is not None:
            reason = f"tp({tp}) x pp({pins.pp}) does not divide the GPU count ({cluster.num_gpus})"
            rejected.append(Rejection({"tp": tp, "pp": pins.pp}, reason))
        elif skipped:
            reason = f"tp({tp}) x pp does not divide the GPU count ({cluster.num_gpus})"
            rejected.append(Rejection({"tp": tp, "pp": _ranges(skipped)}, reason))
    return candidates, rejected


def _ranges(values: list[int]) -> str:
    """[3, 5, 6, 7, 9] -> '3, 5-7, 9' (short family descriptions)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
