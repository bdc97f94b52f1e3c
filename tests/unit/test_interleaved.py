"""Interleaved 1F1B (``interleaved-1f1b``, v virtual stages per rank): the order, its NCCL safety and its bubble
(unit tier, pure Python: ``pipeline_parallel.schedules.interleaved_order``).

- The order: each rank runs v m forwards and v m backwards, one per (chunk, micro-batch); Megatron's warm-up of
  (p - 1 - r) 2 + (v - 1) p forwards (all at m = p); every forward of stage s after stage s - 1's of the same
  micro-batch, every backward after stage s + 1's; micro-batches go through each chunk in groups of p.
- NCCL: every rank's p2p batches complete under ``rendezvous`` (pp 2-8, v 2-4, m p to 3p; 2p at pp 5-8), and the
  two placements that look natural (send after the pass, receive before it; sends batched with the next receive)
  hang.
- Bubble: under free transfers the step idles (p - 1) / (v m) of the ideal, for T_B = T_F and T_B = 2 T_F.
- The config (one-line refusals), the record's placement r + c p and the layout table that follows it, the engine's
  instruction stream (the order's, one for one; forward-only without backwards) and its posts under ``rendezvous``.
- ``interleaved-zb``: the same passes with each W after its B, its posts and its engine's NCCL-safe, and the model
  of its gain (the bubble to a third at m >= 2p).
The trained results (single-device parity, 1F1B's gradients bit for bit, checkpoints, sampling) ride in
tests/launcher/test_parity.py's launches.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from tiny import tiny_model

from ds_megatron.pipeline_parallel import rendezvous as rv
from ds_megatron.pipeline_parallel.schedules import interleaved_order as order

SHAPES = [(p, v, m) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def as_batches(posts: list[tuple[tuple, ...]], wait: str = "recv") -> list[rv.Batch]:
    """``interleaved_order.p2p_posts`` as the rendezvous model's batches: a shape message a plain isend or blocking
    receive, everything else one ``batch_isend_irecv`` whose receives the engine waits for (``wait`` "all": the
    whole batch, as on NCCL, which returns one handle for it)."""
    out = []
    for batch in posts:
        if len(batch) == 1 and batch[0][2][0] == "meta":
            direction, peer, message = batch[0]
            out.append(rv.send(peer, message) if direction == "send" else rv.recv(peer, message))
        else:
            ops = tuple(rv.Op(rv.SEND if d == "send" else rv.RECV, peer, msg) for d, peer, msg in batch)
            out.append(rv.Batch(ops, wait=wait, batched=True))
    return out


@pytest.mark.parametrize("p, v, m", SHAPES)
def test_every_pass_runs_once_after_its_inputs(p, v, m):
    passes = [order.rank_passes(p, v, m, r) for r in range(p)]
    for r, rank in enumerate(passes):
        expected = {(k, c, mb) for k in "FB" for c in range(v) for mb in range(m)}
        assert len(rank) == 2 * v * m and set(rank) == expected
        forwards_first = next(i for i, x in enumerate(rank) if x[0] == "B")
        assert forwards_first == order.warmup_forwards(p, v, m, r) + (m > p)  # steady state starts with a forward
        assert order.warmup_forwards(p, v, m, r) == (v * m if m == p else (p - 1 - r) * 2 + (v - 1) * p)
        # each chunk's micro-batches in order; forwards through the chunks in groups of p, backwards in reverse
        forwards = [x for x in rank if x[0] == "F"]
        backwards = [x for x in rank if x[0] == "B"]
        assert [(c, mb) for _, c, mb in forwards[:p]] == [(0, mb) for mb in range(p)]
        assert [(c, mb) for _, c, mb in backwards[:p]] == [(v - 1, mb) for mb in range(p)]
        for c in range(v):
            assert [mb for _, cc, mb in forwards if cc == c] == list(range(m))
            assert [mb for _, cc, mb in backwards if cc == c] == list(range(m))
    # the dependencies, from the simulated times
    ends = {}
    for r, rows in enumerate(order.timeline(p, v, m)):
        for start, end, (kind, chunk, mb) in rows:
            ends[(kind, order.stage_of(r, chunk, p), mb)] = (start, end)
    last = v * p - 1
    for (kind, stage, mb), (start, _) in ends.items():
        if kind == "F" and stage > 0:
            assert start >= ends[("F", stage - 1, mb)][1]
        if kind == "B":
            assert start >= ends[("B", stage + 1, mb) if stage < last else ("F", stage, mb)][1]


def test_rank_r_holds_chunks_r_plus_multiples_of_p():
    assert order.stages_of(1, 4, 3) == (1, 5, 9)
    assert [order.rank_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert order.valid_micro_batches(4, 16) == [4, 8, 12, 16]
    with pytest.raises(ValueError, match="multiple of p"):
        order.rank_passes(4, 2, 6, 0)


@pytest.mark.parametrize("p, v, m", SHAPES)
def test_bubble_is_p_minus_1_over_v_m(p, v, m):
    for t_f, t_b in ((1, 1), (1, 2)):
        assert order.bubble_fraction(p, v, m, t_f, t_b) == Fraction(p - 1, v * m)
    assert order.makespan(p, v, m) == 3 * m + Fraction(3 * (p - 1), v)


@pytest.mark.parametrize("p", range(2, 9))
def test_every_rank_posts_complete_under_nccl_rendezvous(p):
    for v in (2, 3, 4):
        for m in (p, 2 * p, 3 * p) if p <= 4 else (p, 2 * p):
            posts = [as_batches(order.p2p_posts(p, v, m, r)) for r in range(p)]
            stuck = rv.check(posts)
            assert stuck is None, f"pp {p} v {v} m {m}: {stuck}"
            whole = rv.check([as_batches(order.p2p_posts(p, v, m, r), wait="all") for r in range(p)])
            assert whole is None, f"pp {p} v {v} m {m}, batches waited for whole: {whole}"
            # every message is sent once and received once
            sent = [op.message for rank in posts for b in rank for op in b.ops if op.kind == rv.SEND]
            got = [op.message for rank in posts for b in rank for op in b.ops if op.kind == rv.RECV]
            assert sorted(sent) == sorted(got) and len(set(sent)) == len(sent)
            assert sum(1 for msg in sent if msg[0] == "act") == (v * p - 1) * m


def _naive_posts(p: int, v: int, m: int, rank: int, batched: bool) -> list[rv.Batch]:
    """Send right after the pass that produced the message, receive right before the pass that needs it (blocking;
    shapes first), or (``batched``) every pending send posted with the next receive in one batch."""
    posts, pending, meta = [], [], set()
    last = v * p - 1
    for kind, chunk, mb in order.rank_passes(p, v, m, rank):
        stage = order.stage_of(rank, chunk, p)
        source = stage - 1 if kind == "F" else stage + 1
        if 0 <= source <= last and not (kind == "B" and stage == last):
            what = "act" if kind == "F" else "grad"
            if what == "act" and not batched and source not in meta:
                meta.add(source)
                posts.append(rv.recv(order.rank_of(source, p), ("meta", source)))
            op = rv.Op(rv.RECV, order.rank_of(source, p), (what, source, stage, mb))
            posts.append(rv.Batch((*pending, op), wait="all", batched=batched))
            pending = []
        target = stage + 1 if kind == "F" else stage - 1
        if 0 <= target <= last:
            what = "act" if kind == "F" else "grad"
            if what == "act" and not batched and stage not in meta:
                meta.add(stage)
                posts.append(rv.send(order.rank_of(target, p), ("meta", stage)))
            op = rv.Op(rv.SEND, order.rank_of(target, p), (what, stage, target, mb))
            if batched:
                pending.append(op)
            else:
                posts.append(rv.Batch((op,)))
    return posts + ([rv.Batch(tuple(pending), wait="all", batched=True)] if pending else [])


@pytest.mark.parametrize("batched", [False, True])
def test_the_natural_placements_hang(batched):
    for p, v in ((2, 2), (4, 2)):
        stuck = rv.check([_naive_posts(p, v, 2 * p, r, batched) for r in range(p)])
        assert stuck is not None and not stuck.mismatch, (p, v, batched)


def test_peak_activations_in_flight():
    p, v, m = 4, 2, 8
    # rank r holds its warm-up forwards plus the steady state's first: (p - 1 - r) 2 + (v - 1) p + 1 chunks
    assert [order.peak_in_flight(p, v, m, r) for r in range(p)] == [11, 9, 7, 5]
    assert order.peak_in_flight(p, v, p, 0) == v * p  # m = p: every forward first


# The config: refused before launch in one line, and what a run resolves to.


def _config(pp: int = 2, gas: int = 4, layers: int = 4, **parallel) -> dict:
    return {
        "train_batch_size": 2 * gas,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "ds_megatron": {
            "model": tiny_model(num_layers=layers),
            "parallel": {"pp": pp, "pipeline_schedule": "interleaved-1f1b", **parallel},
        },
    }


@pytest.mark.parametrize(
    "config, message",
    [
        (
            _config(pp=2, gas=6, layers=8, virtual_stages=3),
            None,  # accepted: 6 micro-batches, a multiple of pp 2
        ),
        (
            _config(pp=4, gas=6, layers=8),
            "gradient_accumulation_steps: the interleaved-1f1b schedule needs a multiple of pp micro-batches per step "
            "(gradient_accumulation_steps=6, pp=4, pipeline_schedule='interleaved-1f1b'); use one of [4, 8, 12, 16]",
        ),
        (
            _config(pp=4, gas=2, layers=8),  # fewer than pp: the same refusal, the same valid counts
            "gradient_accumulation_steps: the interleaved-1f1b schedule needs a multiple of pp micro-batches per step "
            "(gradient_accumulation_steps=2, pp=4, pipeline_schedule='interleaved-1f1b'); use one of [4, 8, 12, 16]",
        ),
        (
            _config(virtual_stages=1),
            "ds_megatron.parallel.virtual_stages: model chunks per pipeline rank must be an integer >= 2",
        ),
        (
            {
                **_config(virtual_stages=2),
                "ds_megatron": {**_config()["ds_megatron"], "parallel": {"pp": 2, "virtual_stages": 2}},
            },
            "ds_megatron.parallel.virtual_stages: only a schedule with virtual stages reads it (virtual_stages=2, "
            "pipeline_schedule='1f1b'); remove it, or set pipeline_schedule to one of ['interleaved-1f1b', "
            "'interleaved-zb']",
        ),
        (
            _config(virtual_stages=4),
            "ds_megatron.parallel.pp: fewer layers than pipeline stages (num_layers=4, pp=2, interleaved-1f1b: 4 "
            "stages per rank)",
        ),
        (
            {**_config(), "fp16": {"enabled": True}},
            "fp16.enabled: fp16 loss scaling is not verified under interleaved-1f1b",
        ),
        (_config(pp=1), "ds_megatron.parallel.pipeline_schedule: schedules other than 1f1b reorder pipeline stages"),
    ],
)
def test_the_config_is_checked_before_launch(config, message):
    from ds_megatron.config import ConfigError, resolve

    pp = config["ds_megatron"]["parallel"]["pp"]
    if message is None:
        run = resolve(config, pp)
        assert run.grad_accum_steps == 6
        return
    with pytest.raises(ConfigError) as err:
        resolve(config, pp)
    text = str(err.value).removeprefix("error: ")
    assert text.startswith(message) and "\n" not in text, text


def test_the_record_places_v_chunks_per_rank_and_the_layout_follows():
    from ds_megatron.checkpoint.layout import stage_param_layers
    from ds_megatron.config import resolve
    from ds_megatron.config.facts import stage_placement
    from ds_megatron.config.schema import pipeline_schedule
    from ds_megatron.model import model_config

    assert pipeline_schedule("interleaved-1f1b").stages_per_rank == 2  # the default v
    record = pipeline_schedule("interleaved-1f1b", 3)
    assert record.stages_of(1, 4) == order.stages_of(1, 4, 3) == (1, 5, 9) and record.loss_rank(4) == 3
    run = resolve(_config(pp=2, layers=8, virtual_stages=4), 2)
    assert stage_placement(run.ds_config) == ((0, 2, 4, 6), (1, 3, 5, 7))
    # GPT-2, 8 blocks over 8 stages: wte, wpe and block 0 on stage 0; block 7, ln_f and the tied output layer (its
    # parameters are the embedding's, registered first, under layer 0) on stage 7
    layers = stage_param_layers(model_config(run.model), run, 2)
    assert layers == [[0, 1, 2, 4, 6, 8], [0, 3, 5, 7, 9, 10]], layers


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 4)])
def test_the_engine_runs_the_order_and_its_posts_complete(p, v, m):
    """The engine's instructions are the order's, one for one; its posts (read off those instructions as the engine
    runs them) pass the rendezvous model, for training and for a forward-only step."""
    from deepspeed.runtime.pipe import schedule as ds

    from ds_megatron.pipeline_parallel.interleaved import InterleavedEngine, InterleavedSchedule

    for forward_only in (False, True):
        streams = [InterleavedSchedule(m, p, r, v, forward_only) for r in range(p)]
        assert rv.check([InterleavedEngine.p2p_posts(s) for s in streams]) is None, (p, v, m, forward_only)
        for r, sched in enumerate(streams):
            cmds = [c for step in sched.steps() for c in step]
            passes = [
                ("F" if isinstance(c, ds.ForwardPass) else "B", c.phase, c.buffer_id % m)
                for c in cmds
                if isinstance(c, ds.ForwardPass | ds.BackwardPass)
            ]
            assert passes == list(order.rank_passes(p, v, m, r, forward_only))
            assert len(passes) == (1 if forward_only else 2) * v * m  # a forward-only step runs no backward
            assert all(c.buffer_id // m == c.phase for c in cmds if hasattr(c, "phase"))
            loads = [c.buffer_id for c in cmds if isinstance(c, ds.LoadMicroBatch)]
            chunk = {0: 0, p - 1: v - 1}.get(r)
            assert loads == ([chunk * m + mb for mb in range(m)] if chunk is not None else []), (r, loads)
            assert sched.num_pipe_buffers() == v * m
            reductions = [type(c) for c in cmds[-3:]]
            assert (reductions == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]) != forward_only
    with pytest.raises(ValueError, match="multiple of p"):
        InterleavedSchedule(6, 4, 0, 2)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_deferred_w_would_cut_the_bubble_to_a_third(p, v):
    """The model behind the docs' decision on zero-bubble deferral inside interleaving: with each W right after its
    B it is the order's own timing (T_B + T_W of a whole backward), and with the W passes filling the waits the
    bubble at T_F = T_B = T_W falls to a third at m >= 2p (two thirds at m = p)."""
    for m in (p, 2 * p, 4 * p) if p <= 4 else (p, 2 * p):
        ideal = 3 * m
        plain = order.deferred_w_makespan(p, v, m, defer=False)
        assert plain == order.makespan(p, v, m, 1, 2)
        ratio = (order.deferred_w_makespan(p, v, m) - ideal) / (plain - ideal)
        assert ratio == (Fraction(2, 3) if m == p else Fraction(1, 3)), (m, ratio)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 4)])
def test_deferred_w_order_is_the_order_with_each_w_after_its_b(p, v, m):
    """``interleaved-zb``: with the W passes removed each rank's stream is ``interleaved-1f1b``'s passes; the k-th W
    runs after the k-th B (the queue runs the oldest); its posts and its engine's complete under the rendezvous
    model; the W passes held and the step time come from the same timeline."""
    from deepspeed.runtime.pipe import schedule as ds

    from ds_megatron.pipeline_parallel.interleaved import InterleavedSchedule, InterleavedZeroBubbleEngine
    from ds_megatron.pipeline_parallel.zero_bubble import WeightGradPass

    rows = order.deferred_w_timeline(p, v, m)
    for r in range(p):
        program = order.rank_program(p, v, m, r, deferred_w=True)
        passes = [x for x in program if x[0] in "FBW"]
        assert [x for x in passes if x[0] != "W"] == list(order.rank_passes(p, v, m, r))
        backwards = [x for x in passes if x[0] == "B"]
        weights = [i for i, x in enumerate(passes) if x[0] == "W"]
        assert [passes[i][1:] for i in weights] == [x[1:] for x in backwards]
        assert all(weights[k] > passes.index(backwards[k]) for k in range(len(backwards)))
        assert order.peak_w_held(p, v, m, r) == max(
            sum(1 for x in passes[: i + 1] if x[0] == "B") - sum(1 for x in passes[: i + 1] if x[0] == "W")
            for i in range(len(passes))
        )
        cmds = [c for step in InterleavedSchedule(m, p, r, v, deferred_w=True).steps() for c in step]
        assert sum(isinstance(c, WeightGradPass) for c in cmds) == v * m
        assert [type(c) for c in cmds[-3:]] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]
    assert max(row[-1][1] for row in rows) == order.deferred_w_makespan(p, v, m)
    assert rv.check([as_batches(order.p2p_posts(p, v, m, r, deferred_w=True)) for r in range(p)]) is None
    engine_posts = [
        InterleavedZeroBubbleEngine.p2p_posts(InterleavedSchedule(m, p, r, v, deferred_w=True)) for r in range(p)
    ]
    assert rv.check(engine_posts) is None


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 4)])
def test_the_records_terms_are_their_orders(p, v, m):
    """The records (``schedules.interleaved_1f1b``, ``interleaved_zb``) at v chunks per rank: their bubble is the
    one simulator's makespan of their order, which is the order's own timing model ((p - 1)(T_F + T_B + T_W) / v;
    with deferred W its list schedule's at 1 : 1 : 1), and the memory formulas' counts are the order's peaks."""
    import math

    from ds_megatron.config.schema import pipeline_schedule
    from ds_megatron.memory import stage_activations_in_flight, stage_deferred_w_passes

    plain, zb = pipeline_schedule("interleaved-1f1b", v), pipeline_schedule("interleaved-zb", v)
    assert plain.stages_per_rank == zb.stages_per_rank == v
    for t_f, t_b, t_w in ((1.0, 2.0, 0.0), (1.0, 0.5, 0.5), (0.8, 1.0, 0.9)):
        ideal = m * (t_f + t_b + t_w)
        timed = float(order.makespan(p, v, m, t_f, t_b + t_w))
        assert plain.bubble(p, m, t_f, t_b, t_w) == pytest.approx(timed - ideal)
        assert plain.bubble(p, m, t_f, t_b, t_w) == pytest.approx((p - 1) * (t_f + t_b + t_w) / v)
    assert zb.bubble(p, m, 1.0, 1.0, 1.0) == pytest.approx(float(order.deferred_w_makespan(p, v, m)) - 3 * m)
    assert zb.bubble(p, m, 1.0, 1.0, 1.0) < plain.bubble(p, m, 1.0, 1.0, 1.0)
    slots, fill = plain.critical_path(p, m, 3.0, 1.0)
    assert fill == pytest.approx(3.0 * (p - 1) / v) and slots == pytest.approx(m + (p - 1) / v)
    for r in range(p):
        held = order.peak_in_flight(p, v, m, r) / v
        assert stage_activations_in_flight(plain, p, r, m) == held == stage_activations_in_flight(zb, p, r, m)
        assert stage_deferred_w_passes(plain, p, r, m) == 0
        assert stage_deferred_w_passes(zb, p, r, m) == math.ceil(order.peak_w_held(p, v, m, r) / v)
