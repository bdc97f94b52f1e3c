"""Where DualPipeV with deferred weight gradients (``dualpipev-zb``) splits a backward pass and runs its W pass, as
a function of (p, m, rank) only: the one rule that the schedule (``parallel.dualpipev_zb``), the memory terms and
the tuner (``tune.dualpipev_zb``) read.  Standard library only, as all of config/.

DeepSpeed 0.19.8's ``DualPipeVSchedule`` yields its train schedule in nine steps (``step_sizes``).  Three of them
hold an empty commit where DualPipe runs a W pass (``W_SLOT_STEPS``); the backward passes just before those slots
are split (:func:`deferred`): the phase-1 backward of each B1 W F1 pair, the last ``rank + 1`` backward passes of
the B1 B0 drain and the phase-0 backward of each W B0 step, as many as there are slots.
"""

from __future__ import annotations

WARMUP, PAIRS, B1_W_F1, MAIN, B1_F1_B0, B1_B0, W_B0, W, REDUCE = range(9)  # the steps, in order
W_SLOT_STEPS = (B1_W_F1, W_B0, W)  # one W slot per yielded list of these steps


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
    """The compute passes of rank ``rank``, in order: (kind, phase), kind "F" (forward), "BW" (a whole backward,
    B and W together), "B" (B only, its W deferred) or "W" (a deferred W pass, the oldest one: its phase).  The
    passes of ``tune.schedules.dualpipev_order`` with each backward split or not by :func:`deferred`."""
    tail = p - rank - 1
    steps = (
        [(B1_W_F1, (("B", 1), ("W", 0), ("F", 1)))] * tail
        + [(MAIN, (("F", 0), ("B", 1), ("F", 1), ("B", 0)))] * (m - 2 * p + rank + 1)
        + [(B1_F1_B0, (("B", 1), ("F", 1), ("B", 0)))] * tail
        + [(B1_B0, (("B", 1), ("B", 0)))] * (rank + 1)
        + [(W_B0, (("W", 0), ("B", 0)))] * tail
        + [(W, (("W", 0),))] * (rank + 1)
    )
    order = [("F", 0)] * (2 * tail) + [("F", 0), ("F", 1)] * (rank + 1)
    queue: list[int] = []
    drain_index = 0
    for step, passes in steps:
        for kind, phase in passes:
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
