"""The instruction order of ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1), pure Python:
built here, mapped to DeepSpeed instructions by ``parallel.zero_bubble`` and timed by the tuner (``tune.schedules``).

ZB-H2 lets stage s run up to 2(p - s) - 1 forwards ahead of its backwards (1F1B: p - s), so the first stages keep
computing where 1F1B waits for the first gradient, and defers the weight gradients (W) into whatever idle time is
left, above all the cooldown.  The published schedule also moves the optimizer step's synchronisation out of the
way; DeepSpeed's step (the tied-embedding all-reduce, the gradient norm) synchronises every stage at the end, so
here the last stage still waits (p - 1) T_F for its first activation and the bubble's floor is (p - 1) T_F
(1F1B's is (p - 1)(T_F + T_B + T_W)).

DeepSpeed's sends and receives block until the other stage is there, and a stream of blocking sends either finishes
or deadlocks whatever the timing.  So the order is made by running the stages against each other: a list schedule
of the compute (B first, then F within its limit, then a W when nothing else can run, or when the stage holds more
than its limit of them) in which a send and its receive happen together, when both stages have stopped for them.
Every stream thus has one global order of its sends and receives that is valid: it cannot deadlock, and
:func:`makespan` times it under any costs.

An op is a tuple: ("F" | "B" | "LOAD" | "SA" | "RA" | "SG" | "RG", micro-batch) or ("W",).  SA/RA: send and
receive an activation (downstream), SG/RG: a gradient (upstream); LOAD: the first and last stages' input or labels.
"""

from __future__ import annotations

import functools

# The costs the order is built with (T_F, T_B, T_W): equal, the paper's assumption and what a GPU's GEMMs give.
# Any costs give a valid (deadlock-free) order; these decide only where the Ws land.  Everywhere here ``costs`` is
# one (T_F, T_B, T_W) for every stage or one per stage (the last stage also runs the output layer and the loss).
BUILD_COSTS = (1.0, 1.0, 1.0)
Costs = tuple  # (T_F, T_B, T_W) or ((T_F, T_B, T_W), ...) per stage
# Times closer than this (relative to the costs, which the callers scale to at most 1) are the same instant, so
# that float sums of equal costs (0.1 + 0.2 against 0.3) do not decide the order.
EPS = 1e-9


def stage_costs(costs: Costs, p: int) -> list[dict[str, float]]:
    """``costs`` as one {"F": T_F, "B": T_B, "W": T_W} per stage."""
    rows = costs if isinstance(costs[0], tuple | list) else (costs,) * p
    if len(rows) != p:
        raise ValueError(f"{len(rows)} stages' costs for {p} stages")
    return [dict(zip("FBW", map(float, row))) for row in rows]


ZB_H2_FORWARDS_AHEAD = 2  # ZB-H2's factor k of forwards_ahead (config.schema's zb-h2 row carries the same)


def forwards_ahead(p: int, stage: int, m: int, k: int = ZB_H2_FORWARDS_AHEAD) -> int:
    """The most micro-batches stage ``stage`` keeps forwarded and not yet backward: k (p - s) - (k - 1), at most m
    (1F1B, k 1: p - s; ZB-H2, k 2: 2(p - s) - 1)."""
    return min(m, k * (p - stage) - (k - 1))


# The most W passes stage s holds before it must run one, as (a, b): a (p - s) + b.  Which is best depends on the
# costs (the last stage must keep enough W passes to cover the drain, while its B passes, on the critical path, go
# upstream first; holding more delays nothing but costs memory), so :func:`zb_h2_streams` builds all and keeps the
# fastest under the costs given (the first of equals: the least memory).
W_LIMITS = ((1, 0), (1, 1), (2, 0))


def max_w_held(p: int, stage: int) -> int:
    """The most W passes stage ``stage`` can hold under any of :data:`W_LIMITS`: one more than the limit, between
    the B that passes it and the W that follows."""
    return max(a * (p - stage) + b for a, b in W_LIMITS) + 1


@functools.lru_cache(maxsize=256)
def zb_h2_streams(p: int, m: int, costs: Costs = BUILD_COSTS) -> tuple[tuple[tuple, ...], ...]:
    """Every stage's ZB-H2 ops, in order (see the module docstring): of the orders :data:`W_LIMITS` allows, the
    one :func:`makespan` finds fastest under ``costs``."""
    built = [_build(p, m, costs, limit) for limit in W_LIMITS]
    return min(built, key=lambda streams: makespan(streams, costs))


def _build(p: int, m: int, costs: Costs, w_limit: tuple[int, int]) -> tuple[tuple[tuple, ...], ...]:
    """The list schedule of the module docstring, stage s holding at most w_limit[0] (p - s) + w_limit[1] W passes."""
    cost = stage_costs(costs, p)
    streams: list[list[tuple]] = [[] for _ in range(p)]
    next_f, next_b, pending_w = [0] * p, [0] * p, [0] * p
    acts = [set(range(m))] + [set() for _ in range(p - 1)]  # activations held (stage 0 loads its own)
    grad_in = [False] * p  # the gradient of next_b received (a single buffer, as DeepSpeed's grad_layer)
    to_send_act: list[list[int]] = [[] for _ in range(p)]
    to_send_grad: list[list[int]] = [[] for _ in range(p)]
    busy = [0.0] * p
    current = [""] * p  # the op each stage runs until busy[s]
    now = 0.0

    def done(s: int) -> bool:
        return next_b[s] == m and pending_w[s] == 0 and not to_send_act[s] and not to_send_grad[s]

    def match() -> bool:  # one send/receive between two stopped neighbours; True if one happened
        for s in range(p - 1):
            if busy[s] > now + EPS or busy[s + 1] > now + EPS:
                continue
            if to_send_act[s]:
                mb = to_send_act[s].pop(0)
                streams[s].append(("SA", mb))
                streams[s + 1].append(("RA", mb))
                acts[s + 1].add(mb)
                return True
            if to_send_grad[s + 1] and to_send_grad[s + 1][0] == next_b[s] and not grad_in[s]:
                mb = to_send_grad[s + 1].pop(0)
                streams[s + 1].append(("SG", mb))
                streams[s].append(("RG", mb))
                grad_in[s] = True
                return True
        return False

    def pick(s: int) -> str | None:
        b_ready = next_b[s] < next_f[s] and (grad_in[s] or s == p - 1)
        f_ready = next_f[s] < m and next_f[s] in acts[s] and next_f[s] - next_b[s] < forwards_ahead(p, s, m)
        if b_ready:
            return "B"
        if pending_w[s] > w_limit[0] * (p - s) + w_limit[1]:
            return "W"
        kind = "F" if f_ready else "W" if pending_w[s] else None
        # Blocking p2p: the next stage stops at busy[s + 1] to send this stage a gradient or take an activation
        # from it, and waits there until this stage stops too; an F or W that would end later makes it wait.
        meets = s < p - 1 and (current[s + 1] == "B" or (to_send_act[s] and to_send_act[s][0] == next_f[s + 1]))
        if kind and meets and busy[s + 1] > now + EPS and now + cost[s][kind] > busy[s + 1] + EPS:
            return None
        return kind

    while not all(done(s) for s in range(p)):
        while match():
            pass
        started = False
        for s in range(p):
            if busy[s] > now + EPS:
                continue
            kind = pick(s)
            if kind is None:
                continue
            if kind == "F":
                mb = next_f[s]
                if s in (0, p - 1):
                    streams[s].append(("LOAD", mb))
                streams[s].append(("F", mb))
                next_f[s] += 1
                if s < p - 1:
                    to_send_act[s].append(mb)
            elif kind == "B":
                mb = next_b[s]
                streams[s].append(("B", mb))
                next_b[s] += 1
                grad_in[s] = False
                pending_w[s] += 1
                if s > 0:
                    to_send_grad[s].append(mb)
            else:
                streams[s].append(("W",))
                pending_w[s] -= 1
            busy[s], current[s] = now + cost[s][kind], kind
            started = True
        later = [t for t in busy if t > now + EPS]
        if not later and not started:
            raise RuntimeError(f"the ZB-H2 order stalls at p={p}, m={m}")  # unreachable: every stage can progress
        if later:
            now = min(later)
            for s in range(p):
                if busy[s] <= now + EPS:
                    current[s] = ""
    return tuple(tuple(stream) for stream in streams)


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


LINKS = {"SA": ("act", 0), "RA": ("act", -1), "SG": ("grad", -1), "RG": ("grad", 0)}


def makespan(streams: tuple[tuple[tuple, ...], ...], costs: Costs) -> float:
    """The finish time of ``streams`` when F, B and W take what ``costs`` says and a send and its receive (the n-th
    on a link) both wait until the other side is there, as DeepSpeed's blocking p2p does; transfers and loads
    free."""
    p = len(streams)
    cost = stage_costs(costs, p)
    clock, position = [0.0] * p, [0] * p
    posted: dict = {}  # (link, upstream stage, n) -> (stage waiting, since when)
    count: list[dict] = [{} for _ in range(p)]
    waiting = [False] * p
    while any(position[s] < len(streams[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(streams[s]) and not waiting[s]:
                op = streams[s][position[s]]
                progressed = True
                if op[0] in LINKS:
                    link, offset = LINKS[op[0]]
                    n = count[s].get(op[0], 0)
                    count[s][op[0]] = n + 1
                    key = (link, s + offset, n)
                    if key not in posted:
                        posted[key] = (s, clock[s])
                        waiting[s] = True
                        break
                    other, since = posted.pop(key)
                    clock[s] = clock[other] = max(clock[s], since)
                    position[other] += 1
                    waiting[other] = False
                else:
                    clock[s] += cost[s].get(op[0], 0.0)
                position[s] += 1
        if not progressed:
            raise RuntimeError("the streams deadlock")
    return max(clock)
