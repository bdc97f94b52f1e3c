"""The one timing model of every schedule: each rank runs its ops in order, a compute pass takes its cost, a send
never waits (its message is there from the moment it is posted: the engines' async sends, ``pipeline_parallel.p2p``;
transfers are free), a receive waits until its message has been posted.  Standard library only.

An op is a tuple.  Compute: ("F" | "B" | "W" | "BW", ...) costing the rank's cost of that kind ("BW": a whole
backward, B and W together); any other op that is not a message ("LOAD") costs nothing.  Messages between
neighbouring stages of a one-stage-per-rank pipeline (the zero-bubble orders, ``schedules.zb_order``): ("SA" | "RA",
micro-batch) an activation sent downstream / received from upstream, ("SG" | "RG", micro-batch) a gradient sent
upstream / received from downstream, the n-th send of a link matched with its n-th receive.  Messages of any
placement of stages (:func:`pass_streams`): ("S" | "R", key), matched by key.
"""

from __future__ import annotations

from collections.abc import Sequence

Costs = tuple  # (T_F, T_B, T_W) for every rank, or one such row per rank
Pass = tuple  # ("F" | "B" | "BW" | "W", stage, micro-batch): one compute pass of a rank's order

LINKS = {"SA": ("act", 0), "RA": ("act", -1), "SG": ("grad", -1), "RG": ("grad", 0)}
SENDS = ("SA", "SG", "S")


def rank_costs(costs: Costs, p: int) -> list[dict[str, float]]:
    """``costs`` as one {"F": T_F, "B": T_B, "W": T_W, "BW": T_B + T_W} per rank."""
    rows = costs if isinstance(costs[0], tuple | list) else (costs,) * p
    if len(rows) != p:
        raise ValueError(f"{len(rows)} stages' costs for {p} stages")
    out = []
    for row in rows:
        cost = dict(zip("FBW", map(float, row)))
        cost["BW"] = cost["B"] + cost["W"]
        out.append(cost)
    return out


def makespan(streams: Sequence[Sequence[tuple]], costs: Costs) -> float:
    """The finish time of every rank's ``streams`` (see the module docstring) when F, B and W take what ``costs``
    says.  The zero-bubble order builder, the tuner's bubbles and the tests all call it; a set of streams whose
    receives wait on each other in a cycle is refused."""
    p = len(streams)
    cost = rank_costs(costs, p)
    clock, position = [0.0] * p, [0] * p
    posted: dict = {}  # message key -> when it was posted
    count: list[dict] = [{} for _ in range(p)]
    while any(position[s] < len(streams[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(streams[s]):
                op = streams[s][position[s]]
                kind = op[0]
                if kind in LINKS:
                    link, offset = LINKS[kind]
                    n = count[s].get(kind, 0)
                    key = (link, s + offset, n)
                elif kind in ("S", "R"):
                    key, n = op[1], None
                else:
                    clock[s] += cost[s].get(kind, 0.0)
                    position[s] += 1
                    progressed = True
                    continue
                if kind in SENDS:
                    posted[key] = clock[s]
                elif key in posted:
                    clock[s] = max(clock[s], posted.pop(key))
                else:
                    break  # the receive waits for its send
                if n is not None:
                    count[s][kind] = n + 1
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the streams deadlock (receives waiting on each other)")
    return max(clock)


def pass_streams(orders: Sequence[Sequence[Pass]], num_stages: int) -> list[list[tuple]]:
    """Every rank's passes (``Schedule.order``) with the messages between stages made explicit, for any placement
    of stages on ranks: a forward of stage k waits for stage k-1's forward of its micro-batch, a backward of stage k
    (B, or BW: the whole pass) for stage k+1's backward (the last stage's for its own forward), which sends its
    gradient when that pass ends; a W pass waits for nothing (its own B ran before it on the same rank)."""
    last = num_stages - 1
    streams = []
    for order in orders:
        stream: list[tuple] = []
        for kind, stage, mb in order:
            if kind == "F":
                stream += [("R", ("F", stage - 1, mb))] * (stage > 0) + [(kind, stage, mb), ("S", ("F", stage, mb))]
            elif kind in ("B", "BW"):
                needs = ("B", stage + 1, mb) if stage < last else ("F", stage, mb)
                stream += [("R", needs), (kind, stage, mb), ("S", ("B", stage, mb))]
            else:
                stream.append((kind, stage, mb))
        streams.append(stream)
    return streams


def peak_held(order: Sequence[Pass], held_bytes, queued_bytes=None) -> float:
    """The most a rank keeps over its ``order``: each stage's forward not yet backward (``held_bytes(stage)``) and,
    with ``queued_bytes``, each B whose W has not run yet (``queued_bytes(stage)``)."""
    held: dict[int, int] = {}
    queued: dict[int, int] = {}
    peak = 0.0
    for kind, stage, _ in order:
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
        elif kind in ("B", "BW"):
            held[stage] -= 1
            queued[stage] = queued.get(stage, 0) + (kind == "B")
        else:
            queued[stage] -= 1
        total = 0.0
        for s, n in held.items():
            total += n * held_bytes(s) + (queued.get(s, 0) * queued_bytes(s) if queued_bytes is not None else 0)
        peak = max(peak, total)
    return peak
