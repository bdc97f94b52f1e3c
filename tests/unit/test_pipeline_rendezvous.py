"""Every pipeline schedule's per-rank p2p order completes under NCCL's semantics (``parallel.p2p_rendezvous``), not
only under gloo's.

The model first, on hand-made orders: two sends that cross between a pair of ranks hang (each waits for a receive
queued behind the other's send), the same operations in one ``batch_isend_irecv`` each, or in matching order,
complete; a blocking receive holds back what its rank posts after it; messages matched out of order are reported.
Then every schedule of the registry as its engine posts it (``AsyncSendSteps.p2p_posts`` over the instructions the
engine's own ``_train_schedule`` yields): pp 2-8, sampled m from 2 to 32 (each schedule's minimum up), and for
ZB-H2 the first step's order and the orders rebuilt from a sweep of measured costs (equal, the CPU's, F and W cheap,
W dear, per stage).  ZB-H2's list schedule as built before its links were paired (``zb_order._build``) hangs at
pp 2, m 8, costs 0.5:1:0.5: stage 0 sends activations 1 and 2 before it receives gradient 0, stage 1 sends
gradient 0 before it receives activation 1.
"""

from __future__ import annotations

import types

import pytest

from ds_megatron.config.schema import PIPELINE_SCHEDULES
from ds_megatron.pipeline_parallel import rendezvous as rv
from ds_megatron.pipeline_parallel.schedules import DEFAULT, RunFacts, zb_order
from ds_megatron.pipeline_parallel.zero_bubble import ZeroBubbleH2Schedule

ENGINE_CLASSES = {s.name: s.engine_class() for s in PIPELINE_SCHEDULES}
MICRO_BATCHES = (2, 3, 4, 8, 13, 32)
COSTS = (  # (T_F, T_B, T_W) as agreed_costs hands them over (the largest 1), or one row per stage
    (1.0, 1.0, 1.0),
    (0.5, 1.0, 0.5),
    (1.0, 0.875, 0.625),  # CPU-measured 1.6 : 1.4 : 1
    (0.3, 1.0, 0.6),
    (1.0, 0.5, 0.2),
    (0.9, 0.35, 0.65),
)


def rank_posts(name: str, p: int, m: int, costs: tuple | None = None) -> list[list[rv.Batch]]:
    """Each rank's p2p posts for schedule ``name`` as its engine runs it (``costs``: ZB-H2's order after step 1)."""
    cls = ENGINE_CLASSES[name]
    posts = []
    for stage in range(p):
        engine = types.SimpleNamespace(micro_batches=m, num_stages=p, stage_id=stage, _zb_timing=None, virtual_stages=2)
        engine.zb_costs = costs if costs is not None else getattr(cls, "zb_costs", None)
        posts.append(cls.p2p_posts(cls._train_schedule(engine)))
    return posts


def test_crossing_sends_hang_and_a_batch_or_a_matching_order_completes():
    crossing = [[rv.send(1, "a"), rv.recv(1, "b")], [rv.send(0, "b"), rv.recv(0, "a")]]
    stuck = rv.check(crossing)
    assert stuck is not None and set(stuck.waiting) == {0, 1}, stuck
    assert "rank 0 waits on recv 'b' from 1" in str(stuck) and "behind send 'a' to 1" in str(stuck)

    def batch(peer, out, into):
        return rv.Batch((rv.Op(rv.SEND, peer, out), rv.Op(rv.RECV, peer, into)), wait="all", batched=True)

    assert rv.check([[batch(1, "a", "b")], [batch(0, "b", "a")]]) is None
    assert rv.check([[rv.send(1, "a"), rv.recv(1, "b")], [rv.recv(0, "a"), rv.send(0, "b")]]) is None


def test_a_blocking_receive_holds_back_what_its_rank_posts_after_it():
    assert rv.check([[rv.recv(1, "b"), rv.send(1, "a")], [rv.recv(0, "a"), rv.send(0, "b")]]) is not None
    # over two links: rank 1 waits for rank 2 before it forwards rank 0's message, rank 2 waits for that message
    ring = [[rv.send(1, "x")], [rv.recv(2, "y"), rv.recv(0, "x"), rv.send(2, "x")], [rv.recv(1, "x"), rv.send(1, "y")]]
    stuck = rv.check(ring)
    assert stuck.waiting == {0: [rv.Op(rv.SEND, 1, "x")], 1: [rv.Op(rv.RECV, 2, "y")], 2: [rv.Op(rv.RECV, 1, "x")]}


def test_messages_matched_out_of_order_are_reported():
    stuck = rv.check([[rv.send(1, "a"), rv.send(1, "b")], [rv.recv(0, "b"), rv.recv(0, "a")]])
    assert stuck.mismatch == (0, "a", 1, "b"), stuck


def test_every_schedule_has_its_engine():
    assert set(ENGINE_CLASSES) == {s.name for s in PIPELINE_SCHEDULES}


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("p", range(2, 9))
def test_every_schedule_completes_under_nccl_rendezvous(schedule, p):
    costs = (None,) + (COSTS + ((COSTS[2],) * (p - 1) + ((1.0, 0.9, 0.6),),) if schedule.name == "zb-h2" else ())
    for m in MICRO_BATCHES:
        if m < schedule.micro_batches_per_rank * p or schedule.refuse(RunFacts(1, p, m, "fp32", {}, DEFAULT.name)):
            continue
        for cost in costs:
            stuck = rv.check(rank_posts(schedule.name, p, m, cost))
            assert stuck is None, f"{schedule.name} pp {p} m {m} costs {cost}: {stuck}"


def test_zb_h2_rebuilt_order_at_pp2_m8_completes_and_its_unpaired_list_schedule_hangs():
    p, m, costs = 2, 8, (0.5, 1.0, 0.5)
    chosen = zb_order.zb_h2_streams(p, m, costs)
    assert chosen != zb_order.zb_h1_streams(p, m)  # the list schedule's order, not ZB-H1's fallback
    assert rv.check(rank_posts("zb-h2", p, m, costs)) is None
    unpaired = zb_order._build(p, m, costs, wait_for_grad=True)
    assert zb_order.makespan(unpaired, costs) == zb_order.makespan(chosen, costs)  # pairing cost nothing here
    posts = []
    for stage in range(p):
        sched = ZeroBubbleH2Schedule(micro_batches=m, stages=p, stage_id=stage, costs=costs)
        sched.ops, sched.buffers = unpaired[stage], zb_order.num_buffers(unpaired[stage])
        posts.append(ENGINE_CLASSES["zb-h2"].p2p_posts(sched))
    stuck = rv.check(posts)
    assert stuck is not None and set(stuck.waiting) == {0, 1}, stuck
