"""The tuner's interleaved schedules and uneven pipeline layouts: the space offers virtual stages v only where the
layers split into pp x v equal chunks and m is a multiple of pp; a candidate's bubble is its record's simulator's,
its activations the record's, its p2p v times 1F1B's; interleaving wins with many stages and few micro-batches
(Llama 3 70B on 64 H100 at a small batch) and loses on its messages at a large one; the uneven layout moves blocks
off the last stage where the output layer is costly (Llama 3 8B's 128,256-token vocabulary at pp 4) and only there;
the written config names v, the schedule and the layout and loads; bad pins are refused in one line.  Fast,
in-process."""

from __future__ import annotations

import dataclasses

import pytest

from ds_megatron.config import resolve
from ds_megatron.pipeline_parallel.schedules import ActivationTerms, schedule_named
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.memory_model import (
    embedding_activation_bytes,
    output_activation_bytes,
    recompute_transient_bytes,
    stage_activation_bytes,
    stored_activation_bytes,
)
from ds_megatron.tune.training import layout
from ds_megatron.tune.training.space import layout_candidates
from ds_megatron.tune.training.time_model import slowest_stage, stage_time, step_time
from ds_megatron.tune.training.written import ds_config


def _model(name: str = "gpt3-1.3b"):
    return build_model_shape(name, None, None, None, None, None)


def _cand(**kw) -> Candidate:
    base = dict(tp=2, pp=4, dp=1, sequence_parallel=True, micro_batch_size=1, num_micro_batches=16)
    base.update(recompute="none", attention="sdpa", schedule="interleaved-1f1b", virtual_stages=3)
    base.update(kw)
    return Candidate(**base)


def test_space_offers_v_only_where_the_layers_split_evenly_and_m_is_a_multiple_of_pp():
    model = _model()  # 24 layers
    pins = Pins(schedule="interleaved-1f1b", attention="sdpa", recompute="none", sequence_parallel=True)
    found, _ = layout_candidates(model, 64, 2, 4, 1, pins)
    assert {c.virtual_stages for c in found} == {2, 3, 6}  # 24 = 4 x v x (3, 2, 1) blocks
    found, _ = layout_candidates(model, 48, 2, 3, 1, pins)
    assert {c.virtual_stages for c in found} == {2, 4, 8}
    # m = 64 / b is never a multiple of pp 3: every micro-batch size refused with the record's reason
    found, rejected = layout_candidates(model, 64, 2, 3, 1, pins)
    assert not found and any("multiple of pp" in r.reason for r in rejected)
    found, _ = layout_candidates(model, 64, 2, 4, 1, dataclasses.replace(pins, virtual_stages=3))
    assert {c.virtual_stages for c in found} == {3}
    plain, _ = layout_candidates(model, 64, 2, 4, 1, Pins(attention="sdpa", recompute="none"))
    assert {(c.schedule, c.virtual_stages) for c in plain} == {("1f1b", None)}


@pytest.mark.parametrize(
    "schedule,v,m", [("interleaved-1f1b", 2, 8), ("interleaved-1f1b", 3, 16), ("interleaved-zb", 2, 8)]
)
def test_bubble_is_the_records_simulator_and_p2p_v_times_1f1bs(schedule, v, m):
    model, cluster = _model(), build_cluster("h100-sxm", 8, 8)
    cand = _cand(schedule=schedule, virtual_stages=v, num_micro_batches=m)
    slowest = slowest_stage(model, cluster, cand)
    record = schedule_named(schedule, v)
    assert record.stages_per_rank == v
    t = step_time(model, cluster, cand, m)
    if schedule == "interleaved-1f1b":
        exact = record.critical_path(4, m, slowest.total_s, slowest.weight_grad_s)[1]
        assert t.bubble_s == pytest.approx(exact, rel=1e-9)
        assert t.bubble_s == pytest.approx(3 * slowest.total_s / v, rel=1e-9)  # (p - 1) t_mb / v
    else:  # simulated at the W share rounded to two decimals
        share = round(slowest.weight_grad_s / slowest.total_s, 2)
        exact = record.critical_path(4, m, 1.0, share)[1] * slowest.total_s
        assert t.bubble_s == pytest.approx(exact, rel=1e-9)
        true = record.critical_path(4, m, slowest.total_s, slowest.weight_grad_s)[1]
        assert t.bubble_s == pytest.approx(true, rel=0.02)
    plain = stage_time(model, cluster, dataclasses.replace(cand, schedule="1f1b", virtual_stages=None), 6, "first")
    assert slowest.p2p_s == pytest.approx(v * plain.p2p_s)  # v p - 1 boundaries crossed per micro-batch


def test_activations_are_the_records_at_v():
    model = _model()
    for v in (2, 3, 6):
        cand = _cand(virtual_stages=v)
        n = 24 // (4 * v)
        terms = ActivationTerms(
            stored_activation_bytes(model, cand, n),
            recompute_transient_bytes(model, cand, n),
            embedding_activation_bytes(model, cand),
            output_activation_bytes(model, cand),
            lambda last: 0.0,
        )
        assert stage_activation_bytes(model, cand) == schedule_named("interleaved-1f1b", v).activation_peaks(
            4, 16, terms
        )
    # rank 0 holds (p - 1) 2 + (v - 1) p + 1 chunks of 24 / (4 v) blocks: 33 blocks at v 2, 27 at v 6, more than
    # 1F1B's 4 stages of 6 blocks
    first = {v: stage_activation_bytes(model, _cand(virtual_stages=v))[0] for v in (2, 6)}
    one = stage_activation_bytes(model, _cand(schedule="1f1b", virtual_stages=None))[0]
    assert one < first[6] < first[2]


LLAMA70 = Pins(tp=8, pp=4, micro_batch_size=1, sequence_parallel=True, attention="sdpa", recompute="none")


def test_interleaving_wins_at_few_micro_batches_and_loses_on_messages_at_many():
    model, cluster = _model("llama3-70b"), build_cluster("h100-sxm", 64, 8)
    # m = 32 and 512 at dp 2 (at 512, v 2 only: the fewest extra messages, and a cheap simulation)
    for batch, v, wins in ((64, None, True), (1024, 2, False)):
        plain = search(model, cluster, batch, dataclasses.replace(LLAMA70, schedule="1f1b")).winner
        pins = dataclasses.replace(LLAMA70, schedule="interleaved-1f1b", virtual_stages=v)
        inter = search(model, cluster, batch, pins).winner
        assert inter.candidate.virtual_stages >= 2 and inter.time.bubble_s < plain.time.bubble_s
        assert inter.time.p2p_s > plain.time.p2p_s  # the extra boundaries, across nodes
        assert (inter.time.step_s < plain.time.step_s) == wins
    assert inter.first.activation_bytes > plain.first.activation_bytes  # more chunks in flight on rank 0


def test_schedule_all_ranks_interleaving_with_its_v(capsys):
    args = ["--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm", "--global-batch-size", "64", "--tp", "8"]
    args += ["--pp", "4", "--micro-batch-size", "1", "--attention", "sdpa", "--recompute", "none"]
    args += ["--sequence-parallel", "--schedule", "interleaved-1f1b", "--virtual-stages", "5", "--top", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "interleaved-1f1b v5" in out and "schedule interleaved-1f1b v5" in out


def test_uneven_layout_moves_blocks_off_the_output_layers_stage():
    model, cluster = _model("llama3-8b"), build_cluster("h100-sxm", 16, 8)  # 32 layers, V 128,256
    pins = Pins(tp=1, pp=4, micro_batch_size=1, attention="sdpa", recompute="none")
    result = search(model, cluster, 512, pins)
    winner = result.winner
    assert winner.candidate.pipeline_layout == (8, 8, 9, 7)
    even = dataclasses.replace(winner.candidate, pipeline_layout=None)
    assert winner.time.step_s < step_time(model, cluster, even, 512).step_s
    # the last stage's output layer is about 2.4 blocks of matmuls: 7 blocks + it <= 9 blocks
    assert slowest_stage(model, cluster, winner.candidate).total_s == pytest.approx(
        stage_time(model, cluster, winner.candidate, 9, "middle").total_s
    )
    assert layout.middle_ranks_bounded(model, winner.candidate, (8, 8, 9, 7))
    config = ds_config(result, winner)
    assert config["ds_megatron"]["parallel"]["pipeline_layout"] == [8, 8, 9, 7]
    assert winner.candidate.settings()["pipeline_layout"] == [8, 8, 9, 7]
    assert tuple(resolve(config, 16).section.parallel.pipeline_layout) == (8, 8, 9, 7)
    # at pp 2 the layout puts a block more on the first stage: where only the even split fits, the search keeps it
    small = build_cluster("h100-sxm", 8, 8)
    pins = Pins(tp=1, pp=2, micro_batch_size=1, attention="sdpa", recompute="selective")
    ranked = {e.candidate.recompute_modules: e for e in search(model, small, 512, pins).ranked}
    assert ranked["mlp_act", "layernorm"].candidate.pipeline_layout == (17, 15)
    assert ranked["mlp_act",].candidate.pipeline_layout is None  # 17/15 needs 81.5 GiB, the even split 77.2
    assert ranked["mlp_act", "layernorm"].time.step_s < ranked["mlp_act",].time.step_s
    # GPT-3 175B's output layer (V 50,257, h 12,288) costs a third of a block: the even split stays
    gpt, cluster = _model("gpt3-175b"), build_cluster("a100-80gb", 1024, 8)
    cand = Candidate(8, 8, 16, True, 1, 96, "selective", attention="eager")
    assert layout.balanced(gpt, cluster, cand) is cand
    # the interleaved schedules keep the even split
    assert not layout.balances(_cand())


def test_written_config_names_v_and_the_schedule():
    model, cluster = _model(), build_cluster("h100-sxm", 8, 8)
    pins = Pins(tp=2, pp=4, attention="sdpa", recompute="none", schedule="interleaved-1f1b", virtual_stages=3)
    result = search(model, cluster, 64, pins)
    parallel = ds_config(result, result.winner)["ds_megatron"]["parallel"]
    assert parallel["pipeline_schedule"] == "interleaved-1f1b" and parallel["virtual_stages"] == 3
    assert resolve(ds_config(result, result.winner), 8).section.parallel.virtual_stages == 3


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--virtual-stages", "3"], "error: --virtual-stages: only a schedule with virtual stages reads it"),
        (["--schedule", "zb-h1", "--virtual-stages", "3"], "error: --virtual-stages: only a schedule with virtual"),
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"], "error: --virtual-stages: must be at least 2"),
        (
            ["--schedule", "interleaved-1f1b", "--virtual-stages", "4", "--pp", "4"],
            "error: --virtual-stages: the layers do not split into pp x v equal model chunks",
        ),
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "5"], "error: --virtual-stages: no pp >= 2 splits"),
    ],
)
def test_bad_virtual_stage_pins_are_refused_in_one_line(capsys, extra, message):
    args = ["--model", "gpt3-1.3b", "--global-batch-size", "64", "--gpus", "8", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1
