"""The instruction orders of ZB-H1 and ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1), pure
Python: built here, mapped to DeepSpeed instructions by ``pipeline_parallel.zero_bubble`` and timed by their records
(``schedules.zb_h1``, ``schedules.zb_h2``) with the one timing model, ``schedules.simulate.makespan``.

ZB-H1 (:func:`zb_h1_streams`) is DeepSpeed's 1F1B order with each backward split into B (input gradients) and a
deferred W (weight gradients), stage s holding back up to s W passes.  ZB-H2 (:func:`zb_h2_streams`) lets stage s
run up to 2(p - s) - 1 forwards ahead of its backwards (1F1B: p - s), so the first stages keep computing where
1F1B waits for the first gradient, and defers the W passes into whatever idle time is left, above all the cooldown.
The published schedule also moves the optimizer step's synchronisation out of the way, which makes its bubble
(p - 1)(T_F + T_B - 2 T_W), zero at equal costs, in the steady state across steps; DeepSpeed's step (the
tied-embedding all-reduce, the gradient norm) synchronises every stage at the end, and the last stage cannot start
before its first activation arrives, (p - 1) T_F into the step, so here the bubble's floor is (p - 1) T_F (1F1B's
is (p - 1)(T_F + T_B + T_W)).

The timing model is the engines' p2p (``pipeline_parallel.p2p``): a send is an isend and never waits (its message is
there from the moment the sender posts it, right after the pass that produced it: transfers are free here), a receive
waits until the message's producing pass has finished.  So a stage never waits on its own send, only on its
inputs, and a set of streams runs to the end unless its receives wait on each other in a cycle (:func:`makespan`
refuses those).  ZB-H2's order is made by running the stages against each other under that model: a list schedule
of the compute (B first, then F within its limit, then a W when nothing else can run, or when the stage holds more
than its limit of them), each receive placed just before the pass that needs it and each send just after the pass
that produced it, then each link's messages put in one order on both its stages (:func:`pair_links`: NCCL runs a
pair's sends and receives in posting order and a send waits for its receive, ``pipeline_parallel.rendezvous``; in
such an order a receive waits only for its send, so :func:`makespan` times NCCL's p2p too).  Of four such list schedules
and ZB-H1's own order, :func:`zb_h2_streams` keeps the fastest under the costs given: ZB-H2 falls back to ZB-H1's
order (1F1B's activations in flight) wherever the list schedules find nothing faster, so it is never predicted
slower than ZB-H1.

An op is a tuple: ("F" | "B" | "LOAD" | "SA" | "RA" | "SG" | "RG", micro-batch) or ("W",).  SA/RA: send and
receive an activation (downstream), SG/RG: a gradient (upstream); LOAD: the first and last stages' input or labels.
"""

from __future__ import annotations

import functools

from ds_megatron.pipeline_parallel.schedules.simulate import Costs, makespan, rank_costs

# The costs the order is built with (T_F, T_B, T_W): equal, the paper's assumption and what a GPU's GEMMs give.
# Any costs give a valid (deadlock-free) order; these decide only where the passes land.  Everywhere here ``costs``
# is one (T_F, T_B, T_W) for every stage or one per stage (the last stage also runs the output layer and the loss).
BUILD_COSTS = (1.0, 1.0, 1.0)
# Times closer than this (relative to the costs, which the callers scale to at most 1) are the same instant, so
# that float sums of equal costs (0.1 + 0.2 against 0.3) do not decide the order.
EPS = 1e-9


ZB_H2_FORWARDS_AHEAD = 2  # ZB-H2's factor k of forwards_ahead (its record, schedules.zb_h2, reads it)


def forwards_ahead(p: int, stage: int, m: int, k: int = ZB_H2_FORWARDS_AHEAD) -> int:
    """The most micro-batches stage ``stage`` keeps forwarded and not yet backward: k (p - s) - (k - 1), at most m
    (1F1B, k 1: p - s; ZB-H2, k 2: 2(p - s) - 1)."""
    return min(m, k * (p - stage) - (k - 1))


def w_limit(p: int, stage: int) -> int:
    """The most W passes stage ``stage`` holds in a ZB-H2 list schedule before it must run one: 2p - s, that is
    2(p - s) (one per forward it may run ahead) plus ZB-H1's s (the cooldown slots its upstream stages leave).
    Holding W passes delays nothing (a stage runs one whenever it would otherwise wait) but costs memory; of the
    limits tried (p - s, p - s + 1, 2(p - s), 2p - s, 3p - 2s) over 195 cost sets at pp 2-8 (random, equal and
    CPU-measured), 2p - s alone gave nearly all the gain over ZB-H1's order that all of them together gave, and
    the lower ones nothing beyond it."""
    return 2 * p - stage


def max_w_held(p: int, stage: int) -> int:
    """The most W passes stage ``stage`` can hold in a ZB-H2 order: one more than :func:`w_limit` (between the B
    that passes it and the W that follows), which also covers ZB-H1's stage + 1 where ZB-H2 falls back to it."""
    return w_limit(p, stage) + 1


@functools.lru_cache(maxsize=256)
def zb_h1_streams(p: int, m: int) -> tuple[tuple[tuple, ...], ...]:
    """Every stage's ZB-H1 ops, in order: DeepSpeed's 1F1B order (``TrainSchedule``, checked instruction for
    instruction in tests/unit/test_zero_bubble.py) with the W passes inserted, stage s holding back up to s.

    1F1B in 2(m + p - 1) steps: at step t stage s runs the forward of micro-batch (t - s) / 2 when t - s is even,
    else the backward of (t + s + 1) / 2 - p, where those exist.  A forward step first sends upstream the gradient
    of the previous step's backward, then receives its activation (and loads, on the first and last stage); a
    backward step first receives its gradient, then sends downstream the previous step's activation.

    The W passes were placed for DeepSpeed's blocking sends: while the stage still has forwards to run, a due W
    runs right after its B (before the gradient is sent: the upstream stage is busy with its own forward and W
    until it asks for it); in the cooldown, once the last forward has run, after the gradient has been sent, while
    the upstream stage runs that B; what is left runs at the end.  With T_F = T_B = T_W this gives ZB-H1's bubble
    of (p - 1)(T_F + T_B - T_W) under the engines' async sends too (T_W above T_F or T_B above T_F + T_W make it
    longer: :func:`makespan` times it as it is)."""
    return tuple(_zb_h1_stage(p, m, s) for s in range(p))


def _zb_h1_stage(p: int, m: int, s: int) -> tuple[tuple, ...]:
    """Stage ``s``'s ops of :func:`zb_h1_streams`."""
    ops: list[tuple] = []
    pending, forwards_left, previous = 0, m, None
    for t in range(2 * (m + p - 1)):
        forward = (t - s) % 2 == 0
        mb = (t - s) // 2 if forward else (t + s + 1) // 2 - p
        valid = 0 <= mb < m
        due = False
        if forward:
            if previous is not None and s > 0:
                ops.append(("SG", previous))
                due = forwards_left == 0
            if valid and s > 0:
                ops.append(("RA", mb))
            if valid and s in (0, p - 1):
                ops.append(("LOAD", mb))
        else:
            if valid and s < p - 1:
                ops.append(("RG", mb))
            if previous is not None and s < p - 1:
                ops.append(("SA", previous))
        if valid:
            ops.append(("F" if forward else "B", mb))
            forwards_left -= forward
            pending += not forward
            due = due or (not forward and (forwards_left > 0 or s == 0))
        if due and pending > s:  # run the W passes beyond the s this stage holds back
            ops += [("W",)] * (pending - s)
            pending = s
        previous = mb if valid else None
    return tuple(ops + [("W",)] * pending)


def zb_h2_candidates(p: int, m: int, costs: Costs = BUILD_COSTS) -> list[tuple[tuple[tuple, ...], ...]]:
    """The orders ZB-H2 chooses from: ZB-H1's first (the fallback, and the first of equals: it keeps the fewest
    activations), then the list schedules built for ``costs``, greedy and keeping time for the next gradient (see
    :func:`_build`), each with its links paired both ways (:func:`pair_links`).  The memory model counts the most
    any of them keeps (``memory.stage_activations_in_flight``,
    ``memory.stage_deferred_w_passes``)."""
    builds = [_build(p, m, costs, wait_for_grad) for wait_for_grad in (False, True)]
    return [zb_h1_streams(p, m)] + [pair_links(streams, early) for streams in builds for early in (False, True)]


@functools.lru_cache(maxsize=256)
def zb_h2_streams(p: int, m: int, costs: Costs = BUILD_COSTS) -> tuple[tuple[tuple, ...], ...]:
    """Every stage's ZB-H2 ops, in order (see the module docstring): of :func:`zb_h2_candidates`, the one
    :func:`makespan` finds fastest under ``costs`` (ZB-H1's order where the list schedules gain nothing)."""
    return min(zb_h2_candidates(p, m, costs), key=lambda streams: makespan(streams, costs))


def _build(p: int, m: int, costs: Costs, wait_for_grad: bool) -> tuple[tuple[tuple, ...], ...]:
    """The list schedule of the module docstring, stage s holding at most :func:`w_limit` W passes.  Time advances
    from one pass's end to the next; a stage that is free picks what its inputs allow now (an activation or
    gradient is there once the pass that produced it has ended).  With ``wait_for_grad`` a stage does not start a
    W that it need not run yet while the gradient of its next B is being computed downstream and would arrive
    before that W ends: it waits for the gradient instead, so the B chain upstream is not held back by a W."""
    cost = rank_costs(costs, p)
    streams: list[list[tuple]] = [[] for _ in range(p)]
    next_f, next_b, pending_w = [0] * p, [0] * p, [0] * p
    act_at = [dict.fromkeys(range(m), 0.0)] + [{} for _ in range(p - 1)]  # micro-batch -> when its activation is there
    grad_at: list[dict[int, float]] = [{} for _ in range(p)]  # micro-batch -> when its output gradient is there
    running: list[tuple[str, int, float] | None] = [None] * p  # (kind, micro-batch, end) of the pass each stage runs
    left = 3 * m * p
    now = 0.0

    def pick(s: int) -> str | None:
        b_ready = next_b[s] < next_f[s] and (s == p - 1 or next_b[s] in grad_at[s])
        f_ready = next_f[s] < m and next_f[s] in act_at[s] and next_f[s] - next_b[s] < forwards_ahead(p, s, m)
        if b_ready:
            return "B"
        if pending_w[s] > w_limit(p, s):
            return "W"
        if f_ready:
            return "F"
        if not pending_w[s]:
            return None
        downstream = running[s + 1] if s < p - 1 else None
        if wait_for_grad and downstream and downstream[:2] == ("B", next_b[s]) and next_b[s] < next_f[s]:
            if downstream[2] < now + cost[s]["W"] - EPS:
                return None
        return "W"

    while left:
        for s in range(p):  # passes that have ended deliver their outputs
            if running[s] is not None and running[s][2] <= now + EPS:
                kind, mb, end = running[s]
                if kind == "F" and s < p - 1:
                    act_at[s + 1][mb] = end
                elif kind == "B" and s > 0:
                    grad_at[s - 1][mb] = end
                running[s] = None
        for s in range(p):
            kind = pick(s) if running[s] is None else None
            if kind is None:
                continue
            mb = -1
            if kind == "F":
                mb = next_f[s]
                next_f[s] += 1
                ops = [("RA", mb)] * (s > 0) + [("LOAD", mb)] * (s in (0, p - 1)) + [("F", mb)]
                streams[s] += ops + [("SA", mb)] * (s < p - 1)
            elif kind == "B":
                mb = next_b[s]
                next_b[s] += 1
                pending_w[s] += 1
                streams[s] += [("RG", mb)] * (s < p - 1) + [("B", mb)] + [("SG", mb)] * (s > 0)
            else:
                pending_w[s] -= 1
                streams[s].append(("W",))
            running[s] = (kind, mb, now + cost[s][kind])
            left -= 1
        ends = [r[2] for r in running if r is not None]
        if not ends:
            if left:  # unreachable: with nothing running, the stage furthest behind has its inputs
                raise RuntimeError(f"the ZB-H2 order stalls at p={p}, m={m}")
            break
        now = min(ends)
    return tuple(tuple(stream) for stream in streams)


def pair_links(streams: tuple[tuple[tuple, ...], ...], receive_early: bool) -> tuple[tuple[tuple, ...], ...]:
    """``streams`` with each stage's gradient sends and activation receives ordered as NCCL's p2p can take them
    (``pipeline_parallel.rendezvous``); the compute order and the upstream stages' p2p order unchanged.

    NCCL runs the sends and receives between two ranks in posting order on one stream, and a send of a real
    activation or gradient completes only when the peer posts its receive; so both ranks of a link must post its
    messages in one order.  The list schedule places each send right after the pass that produced it, which gloo
    runs but NCCL may not: stage s runs F(k) (sending activation k) before B(j) (receiving gradient j) while stage
    s + 1 runs B(j) (sending gradient j) before F(k) (receiving activation k): both sends wait for receives queued
    behind the other's send, and neither rank moves.  The upstream stage's order is the link's order here: stage
    s + 1 receives every activation that stage s sends before asking for gradient j before it sends gradient j,
    either by sending gradient j later, after the receive where the order has it (``receive_early`` False: the
    stage computes on, but stage s may wait for the gradient), or by receiving those activations earlier, right
    after B(j) (True: stage s gets the gradient as soon as both are there, but stage s + 1 waits for the
    activation before it computes on).  Neither is a cycle: stage s sent those activations before it asks for
    gradient j, and an isend holds back neither the compute nor the other link.  Which costs less depends on the
    costs: :func:`zb_h2_streams` times both (the third way, stage s sending activation k after the gradients that
    stage s + 1 sends before receiving it, won no case over 728 cost sets and shapes at pp 2-8, m 4-32).  Neither
    always matches the unpaired order's time under free transfers: with F 1, B 0.875, W 0.625 at pp 2, m 4, stage
    1 sends gradient 0 while stage 0 still runs F(2) with activation 1 sent, and that gradient cannot leave before
    stage 0 asks for it, so activation 1 (queued behind it) arrives late: 11.125 against 11.0."""
    out = list(streams)
    for s in range(len(streams) - 1):
        acts_sent = 0  # activations stage s sent so far; they go in micro-batch order
        acts_before = []  # [j]: activations stage s sends before asking for gradient j
        for op in streams[s]:
            acts_sent += op[0] == "SA"
            if op[0] == "RG":
                acts_before.append(acts_sent)
        ops = [op for op in streams[s + 1] if op[0] != "SG" and not (receive_early and op[0] == "RA")]
        stream: list[tuple] = []
        received = backward = sent = 0  # activations received, B passes run, gradients sent by stage s + 1
        for op in ops:
            while receive_early and op[0] in ("LOAD", "F") and received <= op[1]:
                stream.append(("RA", received))  # where the list schedule receives it, unless received earlier
                received += 1
            stream.append(op)
            received += op[0] == "RA"
            backward += op[0] == "B"
            while sent < backward and (receive_early or acts_before[sent] <= received):
                while received < acts_before[sent]:
                    stream.append(("RA", received))
                    received += 1
                stream.append(("SG", sent))
                sent += 1
        out[s + 1] = tuple(stream)
    return tuple(out)


def num_buffers(stream: tuple[tuple, ...]) -> int:
    """Micro-batches a stage's ``stream`` keeps at once, from its first op on one (load or receive) to its last
    (backward or sending the gradient): the pipe buffers it needs, micro-batch i in buffer i % that."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(stream):
        if len(op) == 2:
            first.setdefault(op[1], i)
            last[op[1]] = i
    return max(2, max(sum(1 for mb in first if first[mb] <= i <= last[mb]) for i in range(len(stream))))


def peak_in_flight(stream: tuple[tuple, ...]) -> tuple[int, int]:
    """(forwards not yet backward, W passes queued) at their peaks over ``stream``: the stage's activations in
    flight, and the deferred W passes it holds beside them."""
    forwarded = held = peak_f = peak_w = 0
    for op in stream:
        if op[0] == "F":
            forwarded += 1
        elif op[0] == "B":
            forwarded -= 1
            held += 1
        elif op[0] == "W":
            held -= 1
        peak_f, peak_w = max(peak_f, forwarded), max(peak_w, held)
    return peak_f, peak_w


def one_f_one_b_order(p: int, m: int, s: int) -> tuple[tuple, ...]:
    """Stage ``s``'s passes under DeepSpeed's 1F1B (``TrainSchedule``, the step rule of :func:`zb_h1_streams`):
    ("F" | "BW", stage, micro-batch), each backward whole."""
    order = []
    for t in range(2 * (m + p - 1)):
        forward = (t - s) % 2 == 0
        mb = (t - s) // 2 if forward else (t + s + 1) // 2 - p
        if 0 <= mb < m:
            order.append(("F" if forward else "BW", s, mb))
    return tuple(order)


def stream_passes(stream: tuple[tuple, ...], s: int) -> tuple[tuple, ...]:
    """The compute passes of stage ``s``'s ``stream``: ("F" | "B" | "W", stage, micro-batch), a W pass that of the
    oldest B whose W has not run."""
    order, queued = [], []
    for op in stream:
        if op[0] in ("F", "B"):
            order.append((op[0], s, op[1]))
            queued += [op[1]] * (op[0] == "B")
        elif op[0] == "W":
            order.append(("W", s, queued.pop(0)))
    return tuple(order)


def bubble(h2: bool, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1's (or with ``h2`` ZB-H2's) part of one step's critical path spent filling and draining the pipeline,
    for a stage whose F, B and W passes take ``t_f``, ``t_b`` and ``t_w`` seconds per micro-batch: its order's
    :func:`makespan` (the engines' async sends) less m (T_F + T_B + T_W)."""
    if p == 1:
        return 0.0
    scale = max(t_f, t_b, t_w)
    return scale * _unit_bubble(h2, p, m, (t_f / scale, t_b / scale, t_w / scale))


@functools.lru_cache(maxsize=4096)
def _unit_bubble(h2: bool, p: int, m: int, shares: tuple[float, float, float]) -> float:
    """:func:`bubble` for costs at most 1 (the orders and makespans scale with the costs), cached: a ZB-H2 build at
    p 8, m 64 takes about 0.03 s (ZB-H1's order and three list schedules, each timed), and the time model rounds
    its W share so that a search builds a few orders."""
    streams = zb_h2_streams(p, m, shares) if h2 else zb_h1_streams(p, m)
    return makespan(streams, shares) - m * sum(shares)
