"""The tuner's pipeline schedules (training.schedules): each bubble formula against a simulation of the schedule's own
instruction stream (1F1B and ZB-H1: parallel.zb_order.makespan, the engines' async sends; DualPipeV: DeepSpeed's
DualPipeVSchedule, instantiated without a process group, simulated here with its batched p2p), the memory terms
(ZB-H1's queued W passes, DualPipeV's two chunks per rank and its in-flight chunks), the search (1f1b only unless
--schedule says otherwise) and the refusals of pins no schedule can run.  Fast, in-process."""

from __future__ import annotations

import dataclasses
import json

import pytest
from deepspeed.runtime.pipe import schedule as ds
from test_zero_bubble import makespan, streams

from ds_megatron.memory import deferred_weight_grad_bytes_per_layer
from ds_megatron.pipeline_parallel.schedules.dualpipev import peak_bytes as dualpipev_peak_bytes
from ds_megatron.pipeline_parallel.schedules.dualpipev import simulate as simulate_dualpipev
from ds_megatron.pipeline_parallel.schedules.dualpipev import slots as dualpipev_slots
from ds_megatron.pipeline_parallel.schedules.simulate import makespan as simulate_makespan
from ds_megatron.pipeline_parallel.schedules.v_order import dualpipev_order
from ds_megatron.pipeline_parallel.zero_bubble import WeightGradPass, ZeroBubbleH1Schedule, ZeroBubbleH2Schedule
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.memory_model import (
    deferred_weight_grad_bytes,
    output_activation_bytes,
    rank_param_counts,
    recompute_transient_bytes,
    stage_activation_bytes,
    stage_memory,
    stage_param_counts,
    stored_activation_bytes,
)
from ds_megatron.tune.training.schedules import DEFAULT_SCHEDULES, SCHEDULES
from ds_megatron.tune.training.time_model import StageTime, schedule_slots, stage_times, step_time
from ds_megatron.tune.training.written import ds_config

P2P = (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad)


def _cand(**kw) -> Candidate:
    base = dict(tp=2, pp=4, dp=1, sequence_parallel=True, micro_batch_size=1, num_micro_batches=16)
    base.update(recompute="selective", attention="sdpa", recompute_modules=("mlp_act",))
    base.update(kw)
    return Candidate(**base)


def _model():
    return build_model_shape("gpt3-1.3b", None, None, None, None, None)  # 24 layers: 4 ranks x 2 chunks x 3 blocks


def _stage(t_mb: float, t_w: float) -> StageTime:
    return StageTime(compute_s=t_mb, tp_comm_s=0.0, p2p_s=0.0, weight_grad_s=t_w)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 16)])
def test_1f1b_and_zb_h1_slots_are_their_simulated_makespans(p, m):
    # 1F1B with F 1 and B 2 (B and W together): m + p - 1 slots of 3, exactly.
    slots, bubble = schedule_slots(_cand(pp=p, num_micro_batches=m), _stage(3.0, 1.0))
    assert slots * 3 == makespan(streams(ds.TrainSchedule, m, p), {"F": 1, "B": 2})
    assert bubble == (p - 1) * 3
    # ZB-H1: (p-1)(T_F + T_B - T_W) at equal costs and at the costs measured on CPU (F 1.6, B 1.4, W 1).
    for f, b, w in ((1, 1, 1), (1.6, 1.4, 1.0)):
        slots, bubble = schedule_slots(_cand(pp=p, num_micro_batches=m, schedule="zb-h1"), _stage(f + b + w, w))
        simulated = makespan(streams(ZeroBubbleH1Schedule, m, p), {"F": f, "B": b, "W": w})
        assert slots * (f + b + w) == pytest.approx(simulated)
        assert bubble == pytest.approx((p - 1) * (f + b - w))


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 16)])
def test_zb_h2_slots_are_its_simulated_makespan(p, m):
    """The tuner's ZB-H2 bubble is the makespan of the DeepSpeed instructions the engine runs, built for the tuner's
    costs (T_F a third of the micro-batch, W its weight-GEMM share, rounded to 0.05 of it: here exact), under
    the engines' async sends."""
    for t_mb, t_w in ((3.0, 0.75), (3.0, 0.6)):
        costs = (t_mb / 3, 2 * t_mb / 3 - t_w, t_w)
        slots, bubble = schedule_slots(_cand(pp=p, num_micro_batches=m, schedule="zb-h2"), _stage(t_mb, t_w))
        simulated = makespan(streams(ZeroBubbleH2Schedule, m, p, costs=costs), dict(zip("FBW", costs)))
        assert slots * t_mb == pytest.approx(simulated)
        assert bubble == pytest.approx(simulated - m * t_mb)


def _dualpipev_streams(p: int, m: int) -> list[list]:
    return [[cmd for step in ds.DualPipeVSchedule(m, p, r).steps() for cmd in step] for r in range(p)]


def _channel(cmd, rank: int) -> tuple:
    """The n-less key of a p2p op: (activation | grad, phase, sending rank).  Phase 0 flows towards the last rank,
    phase 1 back; gradients flow the other way."""
    kind = "act" if isinstance(cmd, (ds.SendActivation, ds.RecvActivation)) else "grad"
    down = 1 if cmd.phase == 0 else -1
    if isinstance(cmd, (ds.SendActivation, ds.SendGrad)):
        return kind, cmd.phase, rank
    return kind, cmd.phase, rank - down if kind == "act" else rank + down


def batched_p2p_makespan(per_rank: list[list], cost: dict) -> float:
    """Finish time of DeepSpeed's DualPipeV instruction streams under its batched p2p, timed by the schedules' one
    timing model (``schedules.simulate.makespan``): a CommitP2P launches the queued sends and receives at once and
    waits until every op's partner (the n-th op of its channel on the other side) has been launched, so each op
    posts its launch ("S") and then waits for its partner's ("R"); ``cost`` gives each compute instruction class
    (ForwardPass, BackwardPass, WeightGradPass) its time, transfers take none."""
    kinds = {ds.ForwardPass: "F", ds.BackwardPass: "B", WeightGradPass: "W"}
    timed = []
    for r, stream in enumerate(per_rank):
        ops: list[tuple] = []
        queued: list[tuple] = []
        counts: dict = {}
        for cmd in stream:
            if isinstance(cmd, ds.CommitP2P):
                ops += [("S", (channel, n, send)) for channel, n, send in queued]
                ops += [("R", (channel, n, not send)) for channel, n, send in queued]
                queued = []
            elif isinstance(cmd, P2P):
                n = counts.get((type(cmd), cmd.phase), 0)
                counts[(type(cmd), cmd.phase)] = n + 1
                queued.append((_channel(cmd, r), n, isinstance(cmd, (ds.SendActivation, ds.SendGrad))))
            elif type(cmd) in kinds:
                ops.append((kinds[type(cmd)],))
        timed.append(ops)
    return simulate_makespan(timed, tuple(float(cost.get(kind, 0.0)) for kind in kinds))


DUALPIPEV_CASES = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p)]


@pytest.mark.parametrize("p,m", DUALPIPEV_CASES)
def test_dualpipev_order_and_makespan_are_deepspeeds(p, m):
    per_rank = _dualpipev_streams(p, m)
    for r, stream in enumerate(per_rank):
        compute = [c for c in stream if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        passes = [("F" if isinstance(c, ds.ForwardPass) else "B", c.phase) for c in compute]
        assert passes == dualpipev_order(p, m, r)
        held = [0, 0]
        peak = 0
        for kind, phase in passes:
            held[phase] += 1 if kind == "F" else -1
            peak = max(peak, sum(held))
        assert dualpipev_peak_bytes(p, m, r, (1.0, 1.0)) == peak == 2 * p + 1  # every rank: 2p + 1 chunks at most
    for forward, backward in ((1.0, 2.0), (1.0, 1.0), (1.6, 2.4)):
        assert simulate_dualpipev(p, m, forward, backward) == pytest.approx(
            batched_p2p_makespan(per_rank, {ds.ForwardPass: forward, ds.BackwardPass: backward})
        )
    # fewer bubble slots than 1F1B's p - 1 at the time model's F : B = 1 : 2
    assert m < dualpipev_slots(p, m) < m + p - 1


def test_deferred_w_keeps_each_linears_input_and_output_gradient():
    s, b, h, t = 2048, 2, 1024, 2
    # GPT per token: qkv h + 3h/t, projection h/t + h, fc1 h + 4h/t, fc2 4h/t + h (the input whole under SP)
    expected = s * b * (4 * h + 12 * h // t) * 2
    assert deferred_weight_grad_bytes_per_layer(s, b, h, 16, t) == expected
    assert deferred_weight_grad_bytes_per_layer(s, b, h, 16, t, cp=2) == expected / 2
    model, cand = _model(), _cand(schedule="zb-h1")
    n = 6
    per_block = deferred_weight_grad_bytes(model, cand, n, last=False) / n
    m = model
    assert per_block == deferred_weight_grad_bytes_per_layer(m.seq_length, 1, m.hidden_size, m.num_heads, 2)
    vocab = 50432 // 2  # the output layer's gradient [s, b, V/t] (V padded to 256 = 128 t), its input [s, b, h]
    output = deferred_weight_grad_bytes(model, cand, n, last=True) - n * per_block
    assert output == m.seq_length * (m.hidden_size + vocab) * 2


def test_zb_h1_memory_adds_p_minus_1_w_passes_on_the_last_stage_only():
    model = _model()
    base, zb = _cand(), _cand(schedule="zb-h1")
    first, last = stage_activation_bytes(model, base)
    zb_first, zb_last = stage_activation_bytes(model, zb)
    assert zb_first == first  # stage 0 holds no W pass back
    held = deferred_weight_grad_bytes(model, zb, 6, last=True)
    one = stored_activation_bytes(model, base, 6) + output_activation_bytes(model, base)
    assert zb_last == pytest.approx(max(one, held) + 3 * held + recompute_transient_bytes(model, base, 6))
    assert zb_last > last
    assert rank_param_counts(model, zb) == stage_param_counts(model, 2, 4)


def test_zb_h2_memory_twice_the_forwards_and_its_w_passes():
    """ZB-H2's first stage keeps 2p - 1 micro-batches (1F1B: p) and up to memory.stage_deferred_w_passes W passes."""
    from ds_megatron.pipeline_parallel.schedules.zb_order import max_w_held

    model = _model()
    base, zb = _cand(), _cand(schedule="zb-h2")
    first, _ = stage_activation_bytes(model, base)
    zb_first, zb_last = stage_activation_bytes(model, zb)
    transient = recompute_transient_bytes(model, base, 6)
    per_mb = (first - transient) / 4
    w_first = deferred_weight_grad_bytes(model, zb, 6, last=False)
    assert zb_first == pytest.approx(7 * per_mb + transient + max_w_held(4, 0) * w_first)
    one = stored_activation_bytes(model, base, 6) + output_activation_bytes(model, base) + transient
    assert zb_last == pytest.approx(one + max_w_held(4, 3) * deferred_weight_grad_bytes(model, zb, 6, last=True))


def test_dualpipev_memory_two_chunks_per_rank():
    model, cand = _model(), _cand(schedule="dualpipev")
    first, last = rank_param_counts(model, cand)
    # the same parameters as the whole model (a tied embedding once: both ends live on rank 0)
    assert first + 3 * last == stage_param_counts(model, 2, 1)[0]
    chunk = stored_activation_bytes(model, cand, 3)
    transient = recompute_transient_bytes(model, cand, 3)
    _, busiest = stage_activation_bytes(model, cand)
    assert busiest == pytest.approx(9 * chunk + transient)  # 2p + 1 chunks of L/(2p) blocks in flight
    # 1F1B's first stage keeps p micro-batches of L/p blocks, 8 chunks' worth: DualPipeV's last rank one chunk more
    assert 2 * chunk == stored_activation_bytes(model, cand, 6)
    mem = stage_memory(model, cand)
    assert mem[1].params_bytes == 2 * last


def test_step_times_per_schedule():
    model, cluster = _model(), build_cluster("h100-sxm", 8, 8)
    base = _cand(dp=2)
    times = {s: step_time(model, cluster, dataclasses.replace(base, schedule=s), 32) for s in SCHEDULES}
    first, last = stage_times(model, cluster, base)
    slowest = max(first, last, key=lambda st: st.total_s)
    assert times["1f1b"].bubble_s == pytest.approx(3 * slowest.total_s)
    assert times["zb-h1"].bubble_s == pytest.approx(3 * (slowest.total_s - 2 * slowest.weight_grad_s))
    assert 0 < slowest.weight_grad_s < slowest.compute_s / 3  # the W share: a third of the weight GEMMs' runs
    assert times["zb-h1"].step_s < times["1f1b"].step_s
    assert times["dualpipev"].bubble_s < times["1f1b"].bubble_s
    assert times["zb-h2"].bubble_s <= times["1f1b"].bubble_s
    assert "schedule" not in times["1f1b"].as_dict() and times["zb-h1"].as_dict()["schedule"] == "zb-h1"


ARGS = ["--model", "gpt3-1.3b", "--global-batch-size", "64", "--gpus", "8", "--tp", "2", "--attention", "sdpa"]


def test_search_ranks_1f1b_only_unless_asked():
    model, cluster = _model(), build_cluster("h100-sxm", 8, 8)
    pins = Pins(tp=2, pp=4, attention="sdpa", recompute="none")
    default = search(model, cluster, 64, pins)
    assert DEFAULT_SCHEDULES == ("1f1b",)
    assert {e.candidate.schedule for e in default.evaluations} == {"1f1b"}
    every = search(model, cluster, 64, dataclasses.replace(pins, schedule="all"))
    assert {e.candidate.schedule for e in every.evaluations} == set(SCHEDULES)
    # dualpipev needs m >= 2p = 8: b 16 (m 4) and b 8 (m 8 is allowed) at dp 1
    refused = [r for r in every.rejections if r.family.get("pipeline_schedule") == "dualpipev"]
    assert refused and all("m >= 2 x pp" in r.reason for r in refused)
    assert every.winner.candidate.schedule != "1f1b"  # the models give both others a smaller bubble


def test_schedule_all_shows_the_column_and_writes_the_winners_schedule(capsys):
    assert main([*ARGS, "--pp", "4", "--schedule", "zb-h1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert header.endswith("schedule") and "schedule zb-h1" in out
    assert main([*ARGS, "--pp", "4"]) == 0
    assert "schedule" not in capsys.readouterr().out  # a 1f1b report is what it was


def test_written_config_names_the_schedule():
    model, cluster = _model(), build_cluster("h100-sxm", 8, 8)
    result = search(model, cluster, 64, Pins(tp=2, pp=4, attention="sdpa", recompute="none", schedule="zb-h1"))
    assert ds_config(result, result.winner)["ds_megatron"]["parallel"]["pipeline_schedule"] == "zb-h1"
    assert result.winner.candidate.settings()["pipeline_schedule"] == "zb-h1"
    plain = search(model, cluster, 64, Pins(tp=2, pp=4, attention="sdpa", recompute="none"))
    assert "pipeline_schedule" not in ds_config(plain, plain.winner)["ds_megatron"]["parallel"]
    assert "pipeline_schedule" not in json.dumps(plain.winner.candidate.settings())


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--schedule", "dualpipe"], "error: --schedule: unknown pipeline schedule ('dualpipe'); use one of"),
        (["--schedule", "dualpipev", "--pp", "1"], "error: --schedule: dualpipev needs pp > 1"),
        (["--schedule", "zb-h1", "--pp", "1"], "error: --schedule: zb-h1 needs pp > 1"),
        (["--schedule", "zb-h2", "--pp", "1"], "error: --schedule: zb-h2 needs pp > 1"),
        (
            ["--schedule", "dualpipev", "--pp", "8", "--dp", "1", "--global-batch-size", "8"],
            "error: --schedule: dualpipev needs m >= 2 x pp",
        ),
    ],
)
def test_pins_no_schedule_can_run_are_refused_in_one_line(capsys, extra, message):
    args = ["--model", "gpt3-1.3b", "--global-batch-size", "64", "--gpus", "8", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1
