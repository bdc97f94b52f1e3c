"""The interleaved 1F1B order (virtual pipeline stages; Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", sec. 2.2.2), pure Python: each rank's passes, the p2p operations its
engine posts for them (``pipeline_parallel.interleaved.InterleavedEngine`` runs exactly these) and a timing model.

The model's layers are cut into v p stages ("chunks"); pipeline rank r holds chunks r, r + p, ..., r + (v-1) p, so a
micro-batch visits every rank v times and the output of chunk c p + p - 1 (on rank p - 1) is the input of chunk
(c + 1) p (on rank 0).  Each rank runs v m forwards and v m backwards, one chunk each, in Megatron's order:

- the k-th forward of a rank (k < v m) is of its local chunk (k mod v p) // p and micro-batch
  (k // v p) p + k mod p: p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p;
- the k-th backward is of local chunk v - 1 - (k mod v p) // p (the chunks in reverse), micro-batch as above;
- warm-up: (p - 1 - r) 2 + (v - 1) p forwards (all v m of them when m = p, where nothing is left for a steady
  state), then one forward and one backward at a time, then the remaining backwards.

m must be a multiple of p: the order walks p micro-batches through each chunk in turn, and a smaller last group
would leave a rank waiting on a forward that the order has not reached (:func:`valid_micro_batches`).

Bubble: the passes are 1/v of a 1F1B stage's, and the warm-up idles (p - 1) of them per rank, so the step takes
m (T_F + T_B) + (p - 1)(T_F + T_B) / v, a bubble of (p - 1) / (v m) of the ideal (1F1B's: (p - 1) / m), for
v - 1 more boundary crossings per micro-batch and direction and, on rank 0, (1 + (p - 1)/(v p)) times 1F1B's
activations in flight (:func:`peak_in_flight`).

A pass is ("F" | "B", local chunk, micro-batch); its stage (global chunk) is local chunk x p + rank.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from ds_megatron.pipeline_parallel.schedules import simulate

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"  # W: a deferred weight-gradient pass (``deferred_w``)


def stage_of(rank: int, chunk: int, p: int) -> int:
    """The global stage (model chunk, in layer order) that local ``chunk`` of pipeline rank ``rank`` holds."""
    return chunk * p + rank


def stages_of(rank: int, p: int, v: int) -> tuple[int, ...]:
    """The stages rank ``rank`` holds, in the order it registers their parameters: r, r + p, ..., r + (v-1) p."""
    return tuple(stage_of(rank, c, p) for c in range(v))


def rank_of(stage: int, p: int) -> int:
    """The pipeline rank holding global ``stage``."""
    return stage % p


def valid_micro_batches(p: int, upto: int = 64) -> list[int]:
    """The micro-batch counts per step the order runs at pipeline size ``p`` (multiples of p up to ``upto``)."""
    return list(range(p, upto + 1, p))


def warmup_forwards(p: int, v: int, m: int, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward: (p - 1 - r) 2 + (v - 1) p, all v m when m = p."""
    total = v * m
    return total if m == p else min(total, (p - 1 - rank) * 2 + (v - 1) * p)


def _chunk_and_micro_batch(k: int, p: int, v: int) -> tuple[int, int]:
    group = p * v
    return (k % group) // p, (k // group) * p + k % p


@functools.lru_cache(maxsize=512)
def rank_passes(p: int, v: int, m: int, rank: int, forward_only: bool = False) -> tuple[tuple[str, int, int], ...]:
    """Rank ``rank``'s passes in order: (kind, local chunk, micro-batch); ``forward_only``: the forwards alone (an
    evaluation or generation step)."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m a multiple of p (m={m}, p={p})")
    total = v * m
    warmup = total if forward_only else warmup_forwards(p, v, m, rank)

    def forward(k: int) -> tuple[str, int, int]:
        chunk, mb = _chunk_and_micro_batch(k, p, v)
        return (FORWARD, chunk, mb)

    def backward(k: int) -> tuple[str, int, int]:
        chunk, mb = _chunk_and_micro_batch(k, p, v)
        return (BACKWARD, v - 1 - chunk, mb)

    out = [forward(k) for k in range(warmup)]
    if forward_only:
        return tuple(out)
    for i in range(total - warmup):
        out += [forward(warmup + i), backward(i)]
    out += [backward(i) for i in range(total - warmup, total)]
    return tuple(out)


# What a p2p message carries: an activation (towards later stages) or an input gradient (towards earlier ones).
ACT, GRAD = "act", "grad"
COMM = "comm"  # a program item: one batch of p2p operations (batch_isend_irecv), then a wait for all of it


def timeline(
    p: int, v: int, m: int, t_f: Fraction = 1, t_b: Fraction = 2, forward_only: bool = False
) -> list[list[tuple]]:
    """Every rank's passes with their (start, end) under :func:`makespan`'s model: [(start, end, pass), ...]."""
    f, b = Fraction(t_f) / v, Fraction(t_b) / v
    passes = [rank_passes(p, v, m, r, forward_only) for r in range(p)]
    position, clock = [0] * p, [Fraction(0)] * p
    done: dict[tuple[str, int, int], Fraction] = {}  # (kind, stage, mb) -> when it ended
    out: list[list[tuple]] = [[] for _ in range(p)]
    last = v * p - 1
    while any(position[r] < len(passes[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(passes[r]):
                kind, chunk, mb = passes[r][position[r]]
                stage = stage_of(r, chunk, p)
                if kind == FORWARD:
                    need = (FORWARD, stage - 1, mb) if stage > 0 else None
                else:
                    need = (BACKWARD, stage + 1, mb) if stage < last else (FORWARD, stage, mb)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need]) if need is not None else clock[r]
                clock[r] = start + (f if kind == FORWARD else b)
                done[(kind, stage, mb)] = clock[r]
                out[r].append((start, clock[r], passes[r][position[r]]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the interleaved order deadlocks at p={p}, v={v}, m={m}")
    return out


@functools.lru_cache(maxsize=512)
def rank_program(
    p: int, v: int, m: int, rank: int, forward_only: bool = False, deferred_w: bool = False
) -> tuple[tuple, ...]:
    """Rank ``rank``'s passes and p2p batches, in the order its engine runs them (``forward_only``: the forwards;
    ``deferred_w``: each backward B only, its W pass placed by :func:`deferred_w_timeline`).

    A pass is (kind, local chunk, micro-batch).  A batch is (COMM, ops): every message the rank sends or receives
    that :func:`timeline` produces at one instant t (with T_F 1 and T_B 2 per 1F1B stage), posted as one
    ``batch_isend_irecv`` after the rank's passes that start before t and before those that start at t or later,
    then waited for whole.  An op is (``"send"`` | ``"recv"``, what, sending stage, receiving stage,
    micro-batch), sorted by (what, stages, micro-batch): both ends of a link post its messages in one order.

    Why a batch per instant: NCCL runs a rank's batches one after the other on one stream and a message above its
    buffer completes only when both ends have posted it (``rendezvous``).  A send placed right after the pass that
    produced it, with a blocking receive right before the pass that needs it, hangs at every p (at p 2, v 2: rank 0
    sends activation 1 of stage 0 before it receives the shape of stage 1's output, rank 1 sends that shape before
    it receives activation 1); so does sending with the next receive, Megatron's batching, without its exact
    pairing.  Here both ends of every message post it at the same instant t, and every batch of instant t holds
    messages of instant t only, so by induction over t all of instant t's batches are posted once those before
    have completed: no rank waits on a batch that a peer posts after one of its own waits."""
    last = v * p - 1
    items: list[tuple[tuple, tuple]] = []  # (sort key, item)
    batches: dict[Fraction, list[tuple]] = {}
    rows_of = deferred_w_timeline(p, v, m) if deferred_w and not forward_only else timeline(p, v, m, 1, 2, forward_only)
    for r, rows in enumerate(rows_of):
        for _, end, (kind, chunk, mb) in rows:
            stage = stage_of(r, chunk, p)
            if kind == FORWARD and stage < last:
                message = (ACT, stage, stage + 1, mb)
            elif kind == BACKWARD and stage > 0:
                message = (GRAD, stage, stage - 1, mb)
            else:
                continue
            if r == rank:
                batches.setdefault(end, []).append(("send", *message))
            if rank_of(message[2], p) == rank:
                batches.setdefault(end, []).append(("recv", *message))
        if r == rank:
            items += [((start, 1), (kind, chunk, mb)) for start, _, (kind, chunk, mb) in rows]
    items += [((t, 0), (COMM, tuple(sorted(ops, key=lambda op: (op[1:], op[0]))))) for t, ops in batches.items()]
    return tuple(item for _, item in sorted(items, key=lambda pair: pair[0]))


def p2p_posts(
    p: int, v: int, m: int, rank: int, forward_only: bool = False, deferred_w: bool = False
) -> list[tuple[tuple, ...]]:
    """The point-to-point batches rank ``rank``'s engine posts, in order: each a tuple of (``"send"`` | ``"recv"``,
    peer rank, message).  A batch of one ("meta") op is a plain isend or blocking recv of a boundary's shape: the
    first activation a stage sends to the next is preceded by it, and its receiver reads it before it queues its
    first receive of that activation.  ``rendezvous.check`` plays these (tests/unit/test_interleaved.py)."""
    posts: list[tuple[tuple, ...]] = []
    meta_sent, meta_received = set(), set()
    for item in rank_program(p, v, m, rank, forward_only, deferred_w):
        if item[0] != COMM:
            continue
        batch = []
        for direction, what, src, dst, mb in item[1]:
            peer = rank_of(dst if direction == "send" else src, p)
            if what == ACT and direction == "send" and src not in meta_sent:
                meta_sent.add(src)
                posts.append((("send", peer, ("meta", src)),))
            if what == ACT and direction == "recv" and src not in meta_received:
                meta_received.add(src)
                posts.append((("recv", peer, ("meta", src)),))
            batch.append((direction, peer, (what, src, dst, mb)))
        posts.append(tuple(batch))
    return posts


def makespan(p: int, v: int, m: int, t_f: Fraction = 1, t_b: Fraction = 2) -> Fraction:
    """The step's finish time when every rank runs :func:`rank_passes` and a chunk's forward takes ``t_f`` / v and its
    backward ``t_b`` / v (the passes of a 1F1B stage take t_f and t_b); transfers are free: a pass starts when its
    rank is free and its input (the previous stage's output, the next stage's input gradient) has been produced."""
    return max(rows[-1][1] for rows in timeline(p, v, m, t_f, t_b))


def bubble_fraction(p: int, v: int, m: int, t_f: float | Fraction = 1, t_b: float | Fraction = 2) -> Fraction:
    """The step's idle time over its ideal m (t_f + t_b), under :func:`makespan`: (p - 1) / (v m)."""
    ideal = m * (Fraction(t_f) + Fraction(t_b))
    return (Fraction(makespan(p, v, m, t_f, t_b)) - ideal) / ideal


def peak_in_flight(p: int, v: int, m: int, rank: int) -> int:
    """The most chunk forwards rank ``rank`` holds without their backward at once (each keeps one chunk's
    activations, 1/v of a 1F1B stage's): its warm-up forwards and the steady state's first, (p - 1 - r) 2 +
    (v - 1) p + 1 at m > p (rank 0: v p + p - 1 chunks, (1 + (p - 1)/(v p)) times 1F1B's p stages), v m at m = p."""
    held = peak = 0
    for kind, _, _ in rank_passes(p, v, m, rank):
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def deferred_w_makespan(
    p: int, v: int, m: int, t_f: Fraction = 1, t_b: Fraction = 1, t_w: Fraction = 1, defer: bool = True
) -> Fraction:
    """The step's finish time of :func:`deferred_w_timeline` (``defer`` False: each W right after its B, the
    order as interleaved-1f1b runs it with a backward of T_B + T_W)."""
    return max(rows[-1][1] for rows in deferred_w_timeline(p, v, m, t_f, t_b, t_w, defer) if rows)


@functools.lru_cache(maxsize=256)
def deferred_w_timeline(
    p: int, v: int, m: int, t_f: Fraction = 1, t_b: Fraction = 1, t_w: Fraction = 1, defer: bool = True
) -> list[list[tuple]]:
    """Every rank's passes with their (start, end) when each backward is split into B (input gradients, ``t_b`` / v)
    and W (weight gradients, ``t_w`` / v), under free transfers: with ``defer`` a rank whose next pass's input is not
    there yet runs its oldest pending W instead of idling, and the rest at the end (a greedy list schedule, as
    ZB-H2's builder places W passes); without, each W right after its B.  A W row is (WEIGHT, chunk, micro-batch)
    of the B it completes (the oldest pending: the engine's queue runs them in that order)."""
    f, b, w = Fraction(t_f) / v, Fraction(t_b) / v, Fraction(t_w) / v
    passes = [rank_passes(p, v, m, r) for r in range(p)]
    position, clock = [0] * p, [Fraction(0)] * p
    pending: list[list[tuple]] = [[] for _ in range(p)]  # each rank's B passes whose W has not run, oldest first
    done: dict[tuple[str, int, int], Fraction] = {}
    out: list[list[tuple]] = [[] for _ in range(p)]
    last = v * p - 1

    def need(r: int) -> tuple[str, int, int] | None:
        kind, chunk, mb = passes[r][position[r]]
        stage = stage_of(r, chunk, p)
        if kind == FORWARD:
            return (FORWARD, stage - 1, mb) if stage > 0 else None
        return (BACKWARD, stage + 1, mb) if stage < last else (FORWARD, stage, mb)

    def ready(r: int) -> bool:
        n = need(r)
        return n is None or (n in done and done[n] <= clock[r])

    def run(r: int, item: tuple, cost: Fraction) -> None:
        out[r].append((clock[r], clock[r] + cost, item))
        clock[r] += cost

    while True:
        active = [r for r in range(p) if position[r] < len(passes[r]) or pending[r]]
        if not active:
            return out
        now = min(clock[r] for r in active)
        front = [r for r in active if clock[r] == now]
        runnable = [r for r in front if position[r] < len(passes[r]) and ready(r)]
        if runnable:
            r = runnable[0]
            kind, chunk, mb = item = passes[r][position[r]]
            run(r, item, f if kind == FORWARD else b)
            if kind == BACKWARD:
                pending[r].append((WEIGHT, chunk, mb))
                if not defer:  # the whole backward, its input gradient sent after both
                    run(r, pending[r].pop(0), w)
            done[(kind, stage_of(r, chunk, p), mb)] = clock[r]
            position[r] += 1
            continue
        holding = [r for r in front if pending[r] and (defer or position[r] == len(passes[r]))]
        if holding:  # nothing else can run now: a deferred W fills the wait
            run(holding[0], pending[holding[0]].pop(0), w)
            continue
        arrived = [r for r in front if position[r] < len(passes[r]) and need(r) in done]
        if arrived:
            clock[arrived[0]] = done[need(arrived[0])]
            continue
        later = [clock[r] for r in active if clock[r] > now]
        if not later:
            raise RuntimeError(f"the interleaved order deadlocks at p={p}, v={v}, m={m}")
        for r in front:
            clock[r] = min(later)


def peak_w_held(p: int, v: int, m: int, rank: int) -> int:
    """The most W passes rank ``rank`` holds queued at once under :func:`deferred_w_timeline`'s order (each keeps its
    linears' inputs and output gradients of one chunk until it runs)."""
    held = peak = 0
    for _, _, (kind, _, _) in deferred_w_timeline(p, v, m)[rank]:
        held += {BACKWARD: 1, WEIGHT: -1}.get(kind, 0)
        peak = max(peak, held)
    return peak


# The record's terms (``schedules.interleaved_1f1b``, ``schedules.interleaved_zb``), timed by the one simulator.

WHOLE_BACKWARD = "BW"  # a backward with its W pass (``simulate``'s "BW")


def passes(p: int, v: int, m: int, rank: int, deferred_w: bool = False) -> tuple[tuple[str, int, int], ...]:
    """Rank ``rank``'s passes as ``Schedule.order`` has them: (kind, global stage, micro-batch); each backward
    whole ("BW"), or with ``deferred_w`` B and W where :func:`deferred_w_timeline` places them (the order its
    engine runs)."""
    if deferred_w:
        rows = [item for _, _, item in deferred_w_timeline(p, v, m)[rank]]
    else:
        rows = [(WHOLE_BACKWARD if k == BACKWARD else k, c, mb) for k, c, mb in rank_passes(p, v, m, rank)]
    return tuple((kind, stage_of(rank, chunk, p), mb) for kind, chunk, mb in rows)


@functools.lru_cache(maxsize=1024)
def bubble(p: int, v: int, m: int, deferred_w: bool, t_f: float, t_b: float, t_w: float) -> float:
    """The step's fill and drain: the makespan of :func:`passes` under ``simulate.makespan`` (a chunk's passes
    cost 1/v of a stage's ``t_f``, ``t_b``, ``t_w``; the messages between stages from ``simulate.pass_streams``)
    less m (t_f + t_b + t_w).  The simulator is :func:`timeline`'s model (a pass starts when its rank is free and its
    input has been produced), so without deferred W it is (p - 1)(t_f + t_b + t_w) / v."""
    orders = [passes(p, v, m, r, deferred_w) for r in range(p)]
    span = simulate.makespan(simulate.pass_streams(orders, v * p), (t_f / v, t_b / v, t_w / v))
    return span - m * (t_f + t_b + t_w)
