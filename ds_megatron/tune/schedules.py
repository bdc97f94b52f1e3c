"""The pipeline schedules the tuner models (``ds_megatron.parallel.pipeline_schedule``): how many micro-batch slots
one step's critical path lasts, and how many micro-batches each rank keeps in flight.  Pure Python.

- ``1f1b`` (DeepSpeed's TrainSchedule): m + p - 1 slots of t_mb = T_F + T_B + T_W, exact for equal stage costs.
- ``zb-h1`` (the backward split into B and a deferred W, stage s holding back up to s W passes): the makespan of
  its order (``parallel.zb_order.zb_h1_streams``) under the engines' async sends; at T_F = T_B = T_W (and whenever
  T_W <= T_F <= T_B) the fill and drain shrink from (p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W), W filling the
  cooldown slots; a W dearer than a forward fills less (at T_F 0.8, T_B 1, T_W 0.9: (p-1) T_B, not 0.9 (p-1)).
- ``zb-h2`` (up to 2(p-s)-1 forwards ahead, W wherever a stage would wait; ``parallel.zb_order``): the makespan of
  its own order, built for the costs given and timed under the same async sends (:func:`bubble_s`), never longer
  than ZB-H1's (the order falls back to ZB-H1's where its list schedule finds nothing faster); its floor under
  DeepSpeed's synchronised step is (p-1) T_F.
- ``dualpipev`` (DeepSpeed's DualPipeVSchedule): rank r runs chunks r (phase 0) and 2p-1-r (phase 1) of L/(2p)
  blocks each, in the compute order :func:`dualpipev_order` lists; its makespan comes from
  :func:`simulate_dualpipev`, a list scheduling of that order with each chunk's forward and backward waiting for the
  chunk it depends on (transfers free).  It needs pp > 1 and m >= 2p.
"""

from __future__ import annotations

import functools

from ds_megatron.config.schema import PIPELINE_SCHEDULES
from ds_megatron.pipeline_parallel.zb_order import makespan, zb_h1_streams, zb_h2_streams

# The config's names, one owner; interleaved 1F1B is not modelled here yet (its bubble and activations are
# pipeline_parallel.interleaved_order's), so the tuner neither proposes nor ranks it.
SCHEDULES = tuple(schedule.name for schedule in PIPELINE_SCHEDULES if not schedule.virtual)
# Searched unless --schedule says otherwise: ZB-H1 and ZB-H2 have only been measured on CPU (ZB-H1: idle 0.65x at
# m 4, the step gain eaten by the split backward's extra work; ZB-H2 on a loaded machine only) and DualPipeV not at
# all, so the time model's gains for them are not yet trusted enough to change a winner.  --schedule all ranks the
# four together.
DEFAULT_SCHEDULES = ("1f1b",)
ALL = "all"
# Chunk forward : backward cost of the DualPipeV simulation: the time model's own count (a backward runs the input
# and the weight gradients, two GEMMs of the forward's shapes).
DUALPIPEV_COSTS = (1.0, 2.0)


def refusal(schedule: str, pp: int, num_micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run at ``pp`` stages and ``num_micro_batches`` micro-batches (None: it can)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule (use one of {', '.join(SCHEDULES)} or {ALL})"
    if schedule in ("dualpipev", "dualpipev-zb") and pp == 1:
        return f"{schedule} needs pp > 1 (each pipeline rank holds two stages of one pipeline)"
    if schedule in ("dualpipev", "dualpipev-zb") and num_micro_batches < 2 * pp:
        return f"{schedule} needs m >= 2 x pp (DualPipeVSchedule refuses fewer micro-batches)"
    if schedule in ("zb-h1", "zb-h2") and pp == 1:
        return f"{schedule} needs pp > 1 (with one stage there is no bubble for the W passes to fill)"
    return None


def bubble_s(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The part of one step's critical path spent filling and draining the pipeline, for a stage whose forward,
    input-gradient (B) and weight-gradient (W) passes take ``t_f``, ``t_b`` and ``t_w`` seconds per micro-batch
    (the 1F1B backward is B + W): 1F1B (p-1)(T_F+T_B+T_W); ZB-H1 and ZB-H2 their orders' simulated makespans
    (``parallel.zb_order.makespan``, the engines' async sends) less m (T_F+T_B+T_W).  The one owner of these
    bubbles (the time model and the benchmarks call it)."""
    if p == 1:
        return 0.0
    if schedule in ("zb-h1", "zb-h2"):
        scale = max(t_f, t_b, t_w)
        return scale * _zb_unit_bubble(schedule, p, m, (t_f / scale, t_b / scale, t_w / scale))
    return (p - 1) * (t_f + t_b + t_w)


@functools.lru_cache(maxsize=4096)
def _zb_unit_bubble(schedule: str, p: int, m: int, shares: tuple[float, float, float]) -> float:
    """ZB-H1's or ZB-H2's bubble for costs at most 1 (the orders and makespans scale with the costs), cached: a
    ZB-H2 build at p 8, m 64 takes about 0.03 s (ZB-H1's order and three list schedules, each timed), and the time
    model rounds its W share so that a search builds a few orders."""
    streams = zb_h1_streams(p, m) if schedule == "zb-h1" else zb_h2_streams(p, m, shares)
    return makespan(streams, shares) - m * sum(shares)


def dualpipev_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The compute passes rank ``rank`` of a ``p``-rank DualPipeV pipeline runs, in order: ("F" | "B", phase).
    The phases' k-th forward (and k-th backward) is micro-batch k.  The seven steps with compute of the schedule:
    warm-up forwards of phase 0, forward pairs, backward-forward pairs of phase 1, the steady F0 B1 F1 B0 step,
    then the drain."""
    tail = p - rank - 1
    steps = (
        (2 * tail, (("F", 0),)),
        (rank + 1, (("F", 0), ("F", 1))),
        (tail, (("B", 1), ("F", 1))),
        (m - 2 * p + rank + 1, (("F", 0), ("B", 1), ("F", 1), ("B", 0))),
        (tail, (("B", 1), ("F", 1), ("B", 0))),
        (rank + 1, (("B", 1), ("B", 0))),
        (tail, (("B", 0),)),
    )
    return [op for count, ops in steps for _ in range(count) for op in ops]


@functools.lru_cache(maxsize=1024)
def simulate_dualpipev(p: int, m: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """The makespan of one DualPipeV step with every chunk's forward costing ``forward`` and its backward
    ``backward``, transfers free.  Chunk k (0..2p-1) lives on rank min(k, 2p-1-k); a forward of chunk k waits for
    chunk k-1's forward of the same micro-batch, a backward of chunk k for chunk k+1's backward (the last chunk's
    for its own forward); each rank runs its :func:`dualpipev_order` one pass at a time.

    DeepSpeed launches each step's sends and receives as one batch (CommitP2P) and waits for all of them before the
    step's compute, so a pass also waits for the inputs of the pass it is paired with (a forward for the gradient of
    the backward after it).  On the critical path that costs (p - 1) chunk forwards more than the order alone,
    whatever the costs: added here (tests/unit/test_tune_schedule.py simulates DeepSpeed's instruction stream with its
    batched p2p and finds exactly this for p 2 to 8, m 2p to 4p and three forward : backward ratios)."""
    orders = [dualpipev_order(p, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (pass, chunk, micro-batch) -> finish time
    position, free = [0] * p, [0.0] * p
    counters = [{key: 0 for key in (("F", 0), ("F", 1), ("B", 0), ("B", 1))} for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, phase = orders[r][position[r]]
                mb = counters[r][(kind, phase)]
                chunk, needs = v_pass(p, r, phase, kind, mb)
                if needs is not None and needs not in done:
                    break
                start = max(free[r], done[needs] if needs is not None else 0.0)
                free[r] = done[(kind, chunk, mb)] = start + (forward if kind == "F" else backward)
                counters[r][(kind, phase)] += 1
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the DualPipeV order deadlocks at p={p}, m={m}")
    return max(free) + (p - 1) * forward


def v_pass(p: int, rank: int, phase: int, kind: str, mb: int) -> tuple[int, tuple[str, int, int] | None]:
    """The chunk a DualPipeV rank's pass of ``phase`` runs (rank r holds chunks r and 2p-1-r) and the pass it waits
    for: a forward ("F") of chunk k the forward of chunk k-1 of the same micro-batch (none on chunk 0), a backward
    ("B") of chunk k the backward of chunk k+1, or on the last chunk its own forward."""
    chunk = rank if phase == 0 else 2 * p - 1 - rank
    if kind == "F":
        return chunk, (("F", chunk - 1, mb) if chunk > 0 else None)
    return chunk, (("B", chunk + 1, mb) if chunk < 2 * p - 1 else ("F", chunk, mb))


def dualpipev_slots(p: int, m: int) -> float:
    """The step's critical path in units of t_mb (one micro-batch's two chunks, forward and backward, on a rank)."""
    forward, backward = DUALPIPEV_COSTS
    return simulate_dualpipev(p, m, forward, backward) / (2 * (forward + backward))


def dualpipev_peak_bytes(p: int, m: int, rank: int, phase_bytes: tuple[float, float]) -> float:
    """The most a rank keeps in flight over its :func:`dualpipev_order` (timing does not change it): chunks
    forwarded and not yet backwarded, ``phase_bytes[phase]`` each."""
    held, peak = [0, 0], 0.0
    for kind, phase in dualpipev_order(p, m, rank):
        held[phase] += 1 if kind == "F" else -1
        peak = max(peak, held[0] * phase_bytes[0] + held[1] * phase_bytes[1])
    return peak
