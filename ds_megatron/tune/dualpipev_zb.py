"""The tuner's model of ``dualpipev-zb`` (DualPipeV with its weight gradients deferred into the drain,
``ds_megatron.pipeline_parallel.dualpipev_zb``): the step's critical path and the most a rank holds.  Pure Python.

Both read the rank's compute passes from ``config.dualpipev_order.compute_order``, the rule the schedule itself
uses: forwards, whole backward passes, B-only backward passes and the W passes deferred from them.
"""

from __future__ import annotations

import functools

from ds_megatron.config.dualpipev_order import compute_order
from ds_megatron.config.schema import pipeline_schedule
from ds_megatron.tune.schedules import v_pass

NAME = "dualpipev-zb"
# Chunk F : B : W cost of the simulation: the time model's count (the input gradient and the weight gradient are
# each one GEMM of the forward's shapes), DualPipeV's 1 : 2 with its backward split in two.
COSTS = (1.0, 1.0, 1.0)


def two_stages_per_rank(schedule: str) -> bool:
    """Whether ``schedule`` lays the model out as DualPipeV's V (rank r holds chunks r and 2p-1-r)."""
    record = pipeline_schedule(schedule)
    return record.stages_per_rank == 2 and not record.virtual  # interleaving's v chunks are laid out r + c p


@functools.lru_cache(maxsize=1024)
def simulate(p: int, m: int, forward: float, backward: float, weight: float) -> float:
    """The makespan of one step with each chunk's forward costing ``forward``, B ``backward`` and W ``weight``,
    transfers free: a list scheduling of every rank's ``compute_order`` (a forward of chunk k waits for chunk k-1's
    of the same micro-batch, a backward of chunk k for chunk k+1's, which sends its gradient when its whole pass,
    W included where not deferred, is done; a W pass waits for nothing), plus DeepSpeed's batched-commit delay of
    (p - 1) forwards that ``tune.schedules.simulate_dualpipev`` adds.  At the time model's 1 : 1 : 1 it equals the
    makespan of DeepSpeed's instruction streams under batched p2p (tests/unit/test_dualpipev_zb.py, p 2 to 8)."""
    orders = [compute_order(p, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B", chunk, micro-batch) -> finish time
    position, free = [0] * p, [0.0] * p
    counters: list[dict] = [{} for _ in range(p)]
    cost = {"F": forward, "B": backward, "BW": backward + weight, "W": weight}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, phase = orders[r][position[r]]
                start = free[r]
                if kind != "W":
                    key = "F" if kind == "F" else "B"
                    mb = counters[r].get((key, phase), 0)
                    chunk, needs = v_pass(p, r, phase, key, mb)
                    if needs is not None and needs not in done:
                        break
                    start = max(start, done[needs] if needs is not None else 0.0)
                    done[(key, chunk, mb)] = start + cost[kind]
                    counters[r][(key, phase)] = mb + 1
                free[r] = start + cost[kind]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {NAME} order deadlocks at p={p}, m={m}")
    return max(free) + (p - 1) * forward


def slots(p: int, m: int) -> float:
    """The step's critical path in units of t_mb (one micro-batch's two chunks, F, B and W, on a rank)."""
    return simulate(p, m, *COSTS) / (2 * sum(COSTS))


def peak_bytes(p: int, m: int, rank: int, phase_bytes: tuple[float, float], w_bytes: tuple[float, float]) -> float:
    """The most rank ``rank`` keeps over its ``compute_order``: each chunk forwarded and not yet backwarded
    (``phase_bytes[phase]``) and each deferred W pass not yet run (``w_bytes[phase]``: its linears' inputs and
    output gradients).  No W pass is queued at any forward, so the peak is DualPipeV's unless the drain's r + 1
    queued W passes outweigh the chunks their backward passes freed."""
    held, queued, peak = [0, 0], [0, 0], 0.0
    for kind, phase in compute_order(p, m, rank):
        if kind == "F":
            held[phase] += 1
        elif kind in ("B", "BW"):
            held[phase] -= 1
            queued[phase] += kind == "B"
        else:
            queued[phase] -= 1
        total = sum(held[i] * phase_bytes[i] + queued[i] * w_bytes[i] for i in (0, 1))
        peak = max(peak, total)
    return peak
