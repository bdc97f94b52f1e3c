"""DualPipeV's order (DeepSpeed 0.19.8's ``DualPipeVSchedule``) and where its zero-bubble variant splits a backward
pass and runs its W pass, as a function of (p, m, rank) only: the one rule that the engine
(``pipeline_parallel.dualpipev_zb``) and both records (``schedules.dualpipev``, ``schedules.dualpipev_zb``) read.
Standard library only.

Rank r of p holds stages (chunks) r (phase 0) and 2p-1-r (phase 1).  DeepSpeed's schedule yields its train steps in
nine kinds (``step_sizes``: the one owner of their counts).  Three of them hold an empty commit where DualPipe runs a
W pass (``W_SLOT_STEPS``); the backward passes just before those slots are split (:func:`deferred`): the phase-1
backward of each B1 W F1 pair, the last ``rank + 1`` backward passes of the B1 B0 drain and the phase-0 backward of
each W B0 step, as many as there are slots.
"""

from __future__ import annotations

import functools

from ds_megatron.pipeline_parallel.schedules import simulate

WARMUP, PAIRS, B1_W_F1, MAIN, B1_F1_B0, B1_B0, W_B0, W, REDUCE = range(9)  # the steps, in order
W_SLOT_STEPS = (B1_W_F1, W_B0, W)  # one W slot per yielded list of these steps
# The compute passes (kind, phase) of each step; PAIRS' first list is a lone receive (no compute).
STEP_PASSES = {
    WARMUP: (("F", 0),),
    PAIRS: (("F", 0), ("F", 1)),
    B1_W_F1: (("B", 1), ("W", 0), ("F", 1)),
    MAIN: (("F", 0), ("B", 1), ("F", 1), ("B", 0)),
    B1_F1_B0: (("B", 1), ("F", 1), ("B", 0)),
    B1_B0: (("B", 1), ("B", 0)),
    W_B0: (("W", 0), ("B", 0)),
    W: (("W", 0),),
    REDUCE: (),
}


def step_sizes(p: int, m: int, rank: int) -> tuple[int, ...]:
    """How many lists ``DualPipeVSchedule.steps`` yields per step on rank ``rank`` of ``p`` with ``m`` micro-batches:
    the phase-0 warm-up forwards, the forward pairs (after one lone receive), B1 W F1, the main F0 B1 F1 B0 step,
    B1 F1 B0, B1 B0, W B0, W, and the step's reductions."""
    tail = p - rank - 1
    return 2 * tail, rank + 2, tail, m - 2 * p + rank + 1, tail, rank + 1, tail, rank + 1, 1


def step_of(p: int, m: int, rank: int) -> list[int]:
    """The step (``WARMUP`` ... ``REDUCE``) of each list DeepSpeed yields, in order."""
    return [step for step, size in enumerate(step_sizes(p, m, rank)) for _ in range(size)]


def deferred(step: int, phase: int, drain_index: int, rank: int) -> bool:
    """Whether a backward pass of ``phase`` in ``step`` runs B only, its W pass left for the next slot.
    ``drain_index`` counts the backward passes of the B1 B0 drain (2 (rank + 1) of them): the last rank + 1 are."""
    if step == B1_B0:
        return drain_index >= rank + 1
    return (step == B1_W_F1 and phase == 1) or step == W_B0


def compute_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The compute passes of rank ``rank`` under DualPipeV with deferred W, in order: (kind, phase), kind "F"
    (forward), "BW" (a whole backward, B and W together), "B" (B only, its W deferred) or "W" (a deferred W pass,
    the oldest one: its phase).  The steps of :func:`step_sizes` with each backward split or not by
    :func:`deferred`."""
    sizes = step_sizes(p, m, rank)
    order: list[tuple[str, int]] = []
    queue: list[int] = []
    drain_index = 0
    for step, size in enumerate(sizes):
        for _ in range(size - (step == PAIRS)):
            for kind, phase in STEP_PASSES[step]:
                if kind == "B":
                    split = deferred(step, phase, drain_index, rank)
                    drain_index += step == B1_B0
                    if split:
                        queue.append(phase)
                    order.append(("B" if split else "BW", phase))
                elif kind == "W":
                    order.append(("W", queue.pop(0)))
                else:
                    order.append((kind, phase))
    return order


def dualpipev_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The compute passes of rank ``rank`` under DeepSpeed's DualPipeV (every backward whole): ("F" | "B", phase),
    the phases' k-th forward (and k-th backward) being micro-batch k; :func:`compute_order` without its W passes."""
    return [("F" if kind == "F" else "B", phase) for kind, phase in compute_order(p, m, rank) if kind != "W"]


def chunk(p: int, rank: int, phase: int) -> int:
    """The stage (chunk, 0..2p-1 in model order) of ``phase`` on rank ``rank``: r, or 2p-1-r."""
    return rank if phase == 0 else 2 * p - 1 - rank


def passes(p: int, m: int, rank: int, split: bool) -> tuple[tuple, ...]:
    """Rank ``rank``'s passes ("F" | "B" | "BW" | "W", stage, micro-batch): DualPipeV's (``split`` False: every
    backward whole, "BW") or with its W passes deferred (:func:`compute_order`)."""
    counters = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queue: list[tuple[int, int]] = []
    out = []
    for kind, phase in compute_order(p, m, rank):
        if kind == "W":
            if split:
                out.append(("W", *queue.pop(0)))
            continue
        key = ("F" if kind == "F" else "B", phase)
        mb = counters[key]
        counters[key] += 1
        stage = chunk(p, rank, phase)
        if kind == "B" and split:
            queue.append((stage, mb))
        out.append((kind if split or kind == "F" else "BW", stage, mb))
    return tuple(out)


def makespan(p: int, m: int, split: bool, forward: float, backward: float, weight: float = 0.0) -> float:
    """The makespan of one step with each chunk's forward costing ``forward``, B ``backward`` and W ``weight``
    (``split`` False: every backward whole, costing ``backward + weight``), transfers free: every rank's
    :func:`passes` under the one timing model (``schedules.simulate``), plus DeepSpeed's batched commits.

    DeepSpeed launches each step's sends and receives as one batch (CommitP2P) and waits for all of them before the
    step's compute, so a pass also waits for the inputs of the pass it is paired with (a forward for the gradient of
    the backward after it).  On the critical path that costs (p - 1) chunk forwards more than the order alone,
    whatever the costs: added here (tests/unit/test_tune_schedule.py simulates DeepSpeed's instruction stream with
    its batched p2p and finds exactly this for p 2 to 8, m 2p to 4p and three forward : backward ratios; with W
    deferred, tests/unit/test_dualpipev_zb.py at F : B : W = 1 : 1 : 1)."""
    return _makespan(p, m, split, forward, backward, weight)


@functools.lru_cache(maxsize=1024)
def _makespan(p: int, m: int, split: bool, forward: float, backward: float, weight: float) -> float:
    streams = simulate.pass_streams([passes(p, m, r, split) for r in range(p)], 2 * p)
    return simulate.makespan(streams, (forward, backward, weight)) + (p - 1) * forward


def slots(p: int, m: int, split: bool, costs: tuple[float, ...]) -> float:
    """The step's critical path in units of t_mb (one micro-batch's two chunks, all their passes, on a rank) when the
    chunk passes cost ``costs`` (forward, backward[, weight])."""
    return makespan(p, m, split, *costs) / (2 * sum(costs))


def bubble(p: int, m: int, split: bool, t_f: float, t_b: float, t_w: float) -> float:
    """The step's fill and drain for a rank whose two chunks take ``t_f``, ``t_b`` and ``t_w`` per micro-batch."""
    chunk = (t_f / 2, t_b / 2, t_w / 2) if split else (t_f / 2, (t_b + t_w) / 2)
    return makespan(p, m, split, *chunk) - m * (t_f + t_b + t_w)


def peak_bytes(
    p: int, m: int, rank: int, split: bool, phase_bytes: tuple[float, float], w_bytes: tuple[float, float] = (0, 0)
) -> float:
    """The most rank ``rank`` keeps over its :func:`passes` (timing does not change it): each chunk forwarded and
    not yet backwarded (``phase_bytes[phase]``) and, with ``split``, each deferred W pass not yet run
    (``w_bytes[phase]``: its linears' inputs and output gradients).  No W pass is queued at any forward, so the
    peak is DualPipeV's unless the drain's r + 1 queued W passes outweigh the chunks their backward passes freed."""

    def phase(stage: int) -> int:
        return 0 if stage == rank else 1

    return simulate.peak_held(
        passes(p, m, rank, split),
        lambda s: phase_bytes[phase(s)],
        (lambda s: w_bytes[phase(s)]) if split else None,
    )


def peaks(p: int, m: int, split: bool, t) -> tuple[float, float]:
    """(first, last) rank's activation bytes (``record.ActivationTerms`` of one chunk): each rank's two chunks in
    flight at the peak of its order; rank 0 adds the embedding's to its phase-0 chunks and the output layer's to its
    phase-1 chunks, the loss being computed there, and with ``split`` its queued W passes (phase 1's with the output
    layer)."""
    ends = (t.stored + t.embedding, t.stored + t.output)
    if split:
        w, w_loss = t.deferred_w(False), t.deferred_w(True)
        first = peak_bytes(p, m, 0, True, ends, (w, w_loss)) + t.transient
        last = peak_bytes(p, m, p - 1, True, (t.stored, t.stored), (w, w)) + t.transient
    else:
        first = peak_bytes(p, m, 0, False, ends) + t.transient
        last = peak_bytes(p, m, p - 1, False, (t.stored, t.stored)) + t.transient
    return first, last
