"""Whether every rank's sequence of pipeline sends and receives completes under NCCL's point-to-point semantics, pure
Python (the schedules' tests, the zero-bubble order builder ``schedules.zb_order`` and the tuner use it).

gloo runs an order as long as no receive waits, through a chain of receives, on itself: a send never waits (the
engines' sends are ``isend``, ``parallel.p2p``).  NCCL is stricter, and an order that gloo runs can hang there:

- single ``isend``/``irecv`` between two ranks run on that pair's communicator, one stream per rank, so they execute
  in posting order, sends and receives of both directions queued behind each other;
- a message above NCCL's p2p buffer (a few MiB: any real activation) completes only when the peer has posted the
  matching receive (a rendezvous), and a receive only when the peer has posted the matching send; so a send at the
  head of the pair's stream holds back every later receive from that peer until the peer receives it;
- the n-th send from a to b matches the n-th receive at b from a (on the same communicator), whatever they carry;
- a ``batch_isend_irecv`` group posts all its operations at once and they progress together; torch runs a group
  on its process group's communicator (one stream per rank, shared with the rank's other groups), not the pair's;
- a rank that waits for an operation (a blocking receive, a commit that waits for its batch) posts nothing after
  it until that operation has completed; an ``isend`` nobody waits for blocks only its stream.

:func:`check` plays a set of per-rank sequences of :class:`Batch` under those rules, every message taken as larger
than NCCL's buffer, and returns ``None`` when every operation completes, else a :class:`Stuck` naming the ranks and the
operations they wait on (or the first pair of operations that match but carry different messages: wrong data rather
than a hang).  Not modelled: transfer times, compute, collectives (every rank reaches the step's reductions after its
last p2p operation), CUDA streams other than the communicators'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field

SEND, RECV = "send", "recv"
WORLD = "world"  # the communicator of batched operations (the process group's)


@dataclass(frozen=True)
class Op:
    """One send or receive: ``kind`` SEND or RECV, ``peer`` the other rank, ``message`` what it carries (two ops match
    only if both carry the same message)."""

    kind: str
    peer: int
    message: Hashable


@dataclass(frozen=True)
class Batch:
    """Operations a rank posts at once: one ``isend``/``irecv`` (``batched`` False: the pair's communicator) or one
    ``batch_isend_irecv`` group (``batched`` True: the group's communicator).  ``wait`` says which of them the rank
    waits for before it posts anything later: "none", "recv" (its receives) or "all"."""

    ops: tuple[Op, ...]
    wait: str = "none"
    batched: bool = False

    def waits_for(self, op: Op) -> bool:
        return self.wait == "all" or (self.wait == "recv" and op.kind == RECV)


def send(peer: int, message: Hashable) -> Batch:
    """An ``isend`` that nobody waits for before the end of the step."""
    return Batch((Op(SEND, peer, message),))


def recv(peer: int, message: Hashable) -> Batch:
    """A blocking receive."""
    return Batch((Op(RECV, peer, message),), wait="all")


def _describe(ops: list[Op]) -> str:
    return ", ".join(f"{op.kind} {op.message!r} {'to' if op.kind == SEND else 'from'} {op.peer}" for op in ops)


@dataclass
class Stuck:
    """Why a set of sequences does not complete: ``waiting`` maps each rank that cannot finish to the operations it
    waits on (the ones its next post waits for, else those at the heads of its streams), ``behind`` to the
    incomplete operations queued before them on their streams; ``mismatch`` is (src, message sent, dst, message
    expected) when two operations matched by order carry different messages."""

    waiting: dict[int, list[Op]] = field(default_factory=dict)
    behind: dict[int, list[Op]] = field(default_factory=dict)
    mismatch: tuple | None = None

    def __str__(self) -> str:
        if self.mismatch:
            return "messages matched out of order: {} sends {!r} where {} receives {!r}".format(*self.mismatch)
        return "deadlock: " + "; ".join(
            f"rank {r} waits on {_describe(ops)}"
            + (f" (behind {_describe(self.behind[r])})" if self.behind.get(r) else "")
            for r, ops in sorted(self.waiting.items())
        )


def _stream(rank: int, batch: Batch, op: Op) -> tuple:
    return (WORLD,) if batch.batched else ("pair", min(rank, op.peer), max(rank, op.peer))


def check(ranks: list[list[Batch]]) -> Stuck | None:
    """Play ``ranks`` (rank r's batches in posting order) under the module docstring's rules: ``None`` when every
    operation completes, else what is stuck."""
    n = len(ranks)
    posted = [0] * n  # batches posted so far, per rank
    done = [[[False] * len(batch.ops) for batch in rank] for rank in ranks]  # [rank][batch][op] completed
    # (communicator, src, dst) -> ([sends], [receives]) as (rank, batch, op), in posting order: the n-th send from
    # src to dst matches the n-th receive at dst from src on one communicator
    links: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    matched: dict[tuple, int] = defaultdict(int)  # link -> messages completed on it
    streams: list[dict[tuple, list[int]]] = [defaultdict(list) for _ in range(n)]  # stream -> its batches, in order
    heads: list[dict[tuple, int]] = [defaultdict(int) for _ in range(n)]  # stream -> index of its first incomplete

    def complete(r: int, b: int) -> bool:
        return all(done[r][b])

    def active(r: int, b: int) -> bool:
        """Batch b of rank r has reached the head of each of its streams (every earlier batch there completed)."""
        batch = ranks[r][b]
        for op in batch.ops:
            stream, queue = _stream(r, batch, op), streams[r][_stream(r, batch, op)]
            while heads[r][stream] < len(queue) and complete(r, queue[heads[r][stream]]):
                heads[r][stream] += 1
            if queue[heads[r][stream]] != b:
                return False
        return True

    waited = [0] * n  # operations posted that their rank waits for and that have not completed

    def can_post(r: int) -> bool:
        return posted[r] < len(ranks[r]) and not waited[r]

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while can_post(r):
                b = posted[r]
                batch = ranks[r][b]
                for i, op in enumerate(batch.ops):
                    stream = _stream(r, batch, op)
                    if b not in streams[r][stream]:
                        streams[r][stream].append(b)
                    src, dst = (r, op.peer) if op.kind == SEND else (op.peer, r)
                    links[(stream, src, dst)][op.kind == RECV].append((r, b, i))
                    waited[r] += batch.waits_for(op)
                posted[r] += 1
                progress = True
        for link, (sends, recvs) in links.items():
            while matched[link] < min(len(sends), len(recvs)):
                s_key, r_key = sends[matched[link]], recvs[matched[link]]
                if not (active(*s_key[:2]) and active(*r_key[:2])):
                    break  # later messages on this link queue behind this one
                sent, got = (ranks[k[0]][k[1]].ops[k[2]].message for k in (s_key, r_key))
                if sent != got:
                    return Stuck(mismatch=(link[1], sent, link[2], got))
                for rank, b, i in (s_key, r_key):
                    done[rank][b][i] = True
                    waited[rank] -= ranks[rank][b].waits_for(ranks[rank][b].ops[i])
                matched[link] += 1
                progress = True
    waiting, behind = {}, {}
    for r in range(n):
        if posted[r] == len(ranks[r]) and all(complete(r, b) for b in range(posted[r])):
            continue
        pending = [(b, i, op) for b in range(posted[r]) for i, op in enumerate(ranks[r][b].ops) if not done[r][b][i]]
        blocking = [(b, op) for b, i, op in pending if ranks[r][b].waits_for(op)]
        if not blocking:
            waiting[r] = [op for b, i, op in pending if active(r, b)]
            continue
        waiting[r] = [op for _, op in blocking]
        ahead = sorted(
            {streams[r][_stream(r, ranks[r][b], op)][heads[r][_stream(r, ranks[r][b], op)]] for b, op in blocking}
            - {b for b, _ in blocking}
        )
        behind[r] = [op for h in ahead for i, op in enumerate(ranks[r][h].ops) if not done[r][h][i]]
    return Stuck(waiting, behind) if waiting else None
