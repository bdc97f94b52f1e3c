"""Evaluate every candidate's memory and step time, rank those that fit, and compare with the common configuration:
what large GPT runs used before SP and selective recompute (full recompute of every block, no SP, eager attention,
the largest in-node tp, the smallest pipeline that fits, its fastest micro-batch).  Pure Python."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from ds_megatron.config import ModelShape
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.tune.core.memory_model import GIB, MARGIN_BYTES, MARGIN_FRACTION, StageMemory, stage_memory
from ds_megatron.tune.core.spec import Candidate, Cluster, Pins
from ds_megatron.tune.training.layout import balanced
from ds_megatron.tune.training.space import Rejection, enumerate_candidates, layout_candidates, tp_sizes
from ds_megatron.tune.training.time_model import StepTime, ranked_step, step_time
from ds_megatron.tune.training.validate import validate_request


@dataclass(frozen=True)
class Evaluation:
    """One candidate with its predicted memory (first and last stage) and step time."""

    candidate: Candidate
    first: StageMemory
    last: StageMemory
    time: StepTime
    fits: bool
    reason: str | None  # why it does not fit (None when it fits)

    @property
    def required_bytes(self) -> float:
        return max(self.first.required_bytes, self.last.required_bytes)

    def as_dict(self) -> dict:
        return {
            **self.candidate.settings(),
            "fits": self.fits,
            "reason": self.reason,
            "memory": {"first_stage": self.first.as_dict(), "last_stage": self.last.as_dict()},
            "step_time_s": self.time.step_s,
            "tokens_per_s": self.time.tokens_per_s,
            "mfu": self.time.mfu,
            "hfu": self.time.hfu,
            "time": self.time.as_dict(),
        }


@dataclass
class SearchResult:
    """Everything a report needs: ranked evaluations, rejected families, the common configuration, timing."""

    model: ModelShape
    cluster: Cluster
    global_batch_size: int
    pins: Pins
    evaluations: list[Evaluation]  # every candidate: those that fit first (fastest first), then the rest
    rejections: list[Rejection]
    common: Evaluation | None
    common_note: str
    elapsed_s: float = 0.0
    ranked: list[Evaluation] = field(init=False)

    def __post_init__(self) -> None:
        self.ranked = [e for e in self.evaluations if e.fits]

    @property
    def winner(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None

    @property
    def speedup(self) -> float | None:
        """Predicted step time of the common configuration over the winner's."""
        if self.winner is None or self.common is None:
            return None
        return self.common.time.step_s / self.winner.time.step_s


def _memory_reason(first: StageMemory, last: StageMemory, capacity: float) -> str:
    stage, mem = ("first", first) if first.required_bytes >= last.required_bytes else ("last", last)
    return (
        f"out of memory on the {stage} stage: needs {mem.required_bytes / GIB:.1f} GiB > {capacity / GIB:.0f} GiB "
        f"(weights {mem.params_bytes / GIB:.1f} + grads {mem.grads_bytes / GIB:.1f} + optimizer "
        f"{mem.optimizer_bytes / GIB:.1f} + activations {mem.activation_bytes / GIB:.1f} GiB, "
        f"+{MARGIN_FRACTION:.0%} + {MARGIN_BYTES / GIB:.0f} GiB margin)"
    )


def evaluate(model: ModelShape, cluster: Cluster, cand: Candidate, global_batch_size: int) -> Evaluation:
    """Memory and time of one candidate."""
    first, last = stage_memory(model, cand)
    capacity = cluster.gpu_memory_gb * GIB
    fits = max(first.required_bytes, last.required_bytes) <= capacity
    reason = None if fits else _memory_reason(first, last, capacity)
    return Evaluation(cand, first, last, step_time(model, cluster, cand, global_batch_size), fits, reason)


def _rank_key(e: Evaluation) -> tuple:
    # Layouts with equal predicted steps (cp 8 x micro-batch 1 against cp 16 x micro-batch 2 hold the same tokens per
    # rank) rank the smaller cp first: the time model counts a ring's exchange as hidden behind compute, which
    # holds less surely the more, shorter chunks it cuts the sequence into.  Then the smaller memory.
    return (not e.fits, ranked_step(e.time.step_s) if e.fits else e.required_bytes, e.candidate.cp, e.required_bytes)


def _evaluate_layout(model: ModelShape, cluster: Cluster, cand: Candidate, global_batch_size: int) -> Evaluation:
    """``cand`` with the uneven layout that balances its output layer's cost (``layout.balanced``), or with the even
    split where only that fits: the layout may put more blocks on the first stage (at pp 2 it takes the last's)."""
    chosen = balanced(model, cluster, cand)
    found = evaluate(model, cluster, chosen, global_batch_size)
    if chosen is not cand and not found.fits:
        even = evaluate(model, cluster, cand, global_batch_size)
        return even if even.fits else found
    return found


def _memory_families(evaluations: list[Evaluation]) -> list[Rejection]:
    """Families (tp, pp, dp, sp, policy) none of whose members fit, with the closest member's reason."""
    groups: dict[tuple, list[Evaluation]] = defaultdict(list)
    for e in evaluations:
        c = e.candidate
        key = (c.tp, c.pp, c.dp, c.sequence_parallel, c.recompute, c.attention, c.cp, c.cp_comm, c.schedule)
        groups[(*key, c.virtual_stages, c.ep, c.expert_tp)].append(e)
    rejected = []
    for (tp, pp, dp, sp, policy, kernel, cp, comm, schedule, v, ep, expert_tp), members in groups.items():
        if any(e.fits for e in members):
            continue
        closest = min(members, key=lambda e: e.required_bytes)
        family = {"tp": tp, "pp": pp, "dp": dp, "sequence_parallel": sp, "recompute": policy, "attention": kernel}
        if ep is not None:  # a routed family's (a dense family is named as before the tuner knew ep)
            family["ep"] = ep
        if expert_tp is not None:  # experts split over TP at ep > 1 (the default split is named as before)
            family["expert_tp"] = expert_tp
        if cp > 1:  # a cp 1 family is named as before the tuner knew cp
            family.update(cp=cp, cp_comm=comm)
        if schedule != DEFAULT_SCHEDULE.name:  # a 1f1b family is named as before the tuner knew schedules
            family["pipeline_schedule"] = schedule
        if v is not None:
            family["virtual_stages"] = v
        best = closest.candidate
        reason = f"{closest.reason}; closest member b={best.micro_batch_size} {best.recompute_label()}"
        rejected.append(Rejection(family, reason, len(members), closest.required_bytes))
    rejected.sort(
        key=lambda r: (
            tuple(r.family[k] for k in ("tp", "pp", "sequence_parallel", "recompute", "attention"))
            + (r.family.get("cp", 1),)
        )
    )
    return rejected


def common_configuration(model: ModelShape, cluster: Cluster, global_batch_size: int) -> tuple[Evaluation | None, str]:
    """Full recompute of every block, no SP, eager attention, the largest in-node tp, the smallest pp that fits, its
    best b (a routed family's experts split over TP, ep 1)."""
    tps, _ = tp_sizes(model, cluster, Pins())
    if not tps:
        return None, "no tensor-parallel size fits in a node"
    tp = max(tps)
    pins = Pins(tp=tp, sequence_parallel=False, recompute="full", attention="eager", ep=1)  # no EP (routed families)
    for pp in range(1, model.num_layers + 1):
        if cluster.num_gpus % (tp * pp) != 0:
            continue
        dp = cluster.num_gpus // (tp * pp)
        cands, _ = layout_candidates(model, global_batch_size, tp, pp, dp, pins)
        every_block = [c for c in cands if c.recompute_method == "uniform" and c.recompute_layers == 1]
        fitting = [e for e in (evaluate(model, cluster, c, global_batch_size) for c in every_block) if e.fits]
        if fitting:
            best = min(fitting, key=lambda e: e.time.step_s)
            return best, (
                f"full recompute of every block, no SP, eager attention, tp {tp}, smallest pp that fits ({pp}), best b"
            )
    return None, f"does not fit at any pipeline depth (tp {tp}, full recompute of every block, no SP, eager attention)"


def search(model: ModelShape, cluster: Cluster, global_batch_size: int, pins: Pins | None = None) -> SearchResult:
    """Enumerate, evaluate and rank; raises ConfigError for inputs no search can satisfy."""
    pins = pins or Pins()
    validate_request(model, cluster, global_batch_size, pins)
    start = time.perf_counter()
    candidates, rejected = enumerate_candidates(model, cluster, global_batch_size, pins)
    evaluations = sorted((_evaluate_layout(model, cluster, c, global_batch_size) for c in candidates), key=_rank_key)
    rejected += _memory_families(evaluations)
    common, note = common_configuration(model, cluster, global_batch_size)
    result = SearchResult(model, cluster, global_batch_size, pins, evaluations, rejected, common, note)
    result.elapsed_s = time.perf_counter() - start
    return result
