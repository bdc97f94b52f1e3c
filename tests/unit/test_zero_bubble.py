"""ZB-H1 and ZB-H2 on DeepSpeed's pipeline engine: the schedules (unit tier) and the trained result (one launcher run).

Unit tier: with the W passes removed, the ZB-H1 stream of every stage is DeepSpeed's 1F1B stream, instruction for
instruction (same communication order, so no new deadlock); every backward pass gets exactly one W pass, no W pass
runs before its backward, stage s holds at most s when it runs a forward, and all have run before the step's
reductions.  The timing model of the streams is ``parallel.zb_order.makespan`` (the engines' async sends: a send
returns at once, a receive waits for its send), the one the order builder and the tuner use: it shows the bubble
going from 1F1B's (p-1)(T_F+T_B+T_W) to ZB-H1's (p-1)(T_F+T_B-T_W) at T_F = T_B = T_W, and, with the costs
measured on CPU (T_F 1.6, T_B 1.4, T_W 1), halving.  The schedule key is validated before anything starts.  The
engine's W instruction frames each W pass for DeepSpeed's BF16 optimizer like a backward pass, and its optimizer
step refuses to run with W passes queued; a gradient received stays what it was when the next one arrives (a W
pass may still hold it).  ZB-H2's streams (built by ``parallel.zb_order``) are valid DeepSpeed programs (each pass
once and in order, each receive before the pass that needs it and matching its send's micro-batch, within
2(p - s) - 1 forwards ahead and the memory model's W passes, pipe buffers never reused early, no deadlock), never
slower than ZB-H1's under the same costs, at the (p - 1) T_F floor at equal costs, and below ZB-H1 (at the floor at
pp 2) where ZB-H1 cannot reach it: the CPU's costs and T_F 0.8, T_B 1, T_W 0.9.

Launcher tier (one run, 2 processes, pp 2): GPT-2 (tied embeddings across the two stages) and Llama (untied) in
fp32, and GPT-2 with DeepSpeed's BF16 optimizer (ZeRO-1, fp32 accumulators), each train three steps with 1F1B,
ZB-H1 and ZB-H2: losses, step-1 gradients (bf16: the fp32 accumulators) and the weights after three steps agree
within fp32 rounding (measured: bit for bit), each zero-bubble schedule ran one W pass with deferred work per
micro-batch, and ZB-H2 rebuilt its order after the first step for the costs all ranks timed alike.  (tp 2 and SP
need 4 processes at pp 2; the deferred W passes are exact there in-process, tests/unit/test_weight_grad.py, and
the schedules only reorder whole passes.)
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds
from tiny import gpt_tiny

from ds_megatron.pipeline_parallel.schedules.simulate import makespan as zb_makespan
from ds_megatron.pipeline_parallel.zero_bubble import KINDS, WeightGradPass, ZeroBubbleH1Schedule, ZeroBubbleH2Schedule


def streams(cls, m: int, p: int, **kw) -> list[list]:
    return [[cmd for step in cls(micro_batches=m, stages=p, stage_id=s, **kw) for cmd in step] for s in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_zb_h1_is_1f1b_plus_one_w_per_backward(m, p):
    for stage, (zb, ref) in enumerate(zip(streams(ZeroBubbleH1Schedule, m, p), streams(ds.TrainSchedule, m, p))):
        assert [repr(c) for c in zb if not isinstance(c, WeightGradPass)] == [repr(c) for c in ref]
        pending, reduced = 0, False
        for cmd in zb:
            if isinstance(cmd, ds.BackwardPass):
                pending += 1
            elif isinstance(cmd, WeightGradPass):
                assert not reduced, f"stage {stage}: a W pass after the reductions began"
                pending -= 1
                assert pending >= 0, f"stage {stage}: a W pass before its backward"
            elif isinstance(cmd, ds.ReduceTiedGrads):
                assert pending == 0, f"stage {stage}: {pending} W passes left at the reductions"
                reduced = True
            if isinstance(cmd, ds.ForwardPass):  # where memory grows: at most `stage` W passes held
                assert pending <= stage, f"stage {stage} holds {pending} W passes at a forward"
        assert reduced


OPS = {instruction: kind for kind, instruction in KINDS.items()} | {WeightGradPass: "W"}


def makespan(per_stage: list[list], cost: dict) -> float:
    """Finish time of the stages' DeepSpeed instruction streams when compute takes ``cost`` ("F", "B", "W"; 1F1B's
    whole backward is its "B"), timed by ``parallel.zb_order.makespan`` (the engines' async sends)."""
    ops = tuple(tuple((OPS[type(cmd)], 0) for cmd in stream if type(cmd) in OPS) for stream in per_stage)
    return zb_makespan(ops, tuple(float(cost.get(kind, 0.0)) for kind in "FBW"))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    one_f_one_b = makespan(streams(ds.TrainSchedule, m, p), {"F": 1, "B": 2})
    zb = makespan(streams(ZeroBubbleH1Schedule, m, p), {"F": 1, "B": 1, "W": 1})
    assert one_f_one_b - 3 * m == (p - 1) * 3
    assert zb - 3 * m == (p - 1) * 1
    # Forward dearer than B, as measured on CPU (tests/workers/zero_bubble.py --measure): the bubble still halves.
    one_f_one_b = makespan(streams(ds.TrainSchedule, m, p), {"F": 1.6, "B": 2.4})
    zb = makespan(streams(ZeroBubbleH1Schedule, m, p), {"F": 1.6, "B": 1.4, "W": 1.0})
    assert zb - 4 * m == pytest.approx((one_f_one_b - 4 * m) / 2)


@pytest.mark.parametrize(
    "schedule,fp16,message",
    [
        (
            "zb",
            False,
            "error: ds_megatron.parallel.pipeline_schedule: unknown schedule (got 'zb'); "
            "use one of ['1f1b', 'dualpipev', 'zb-h1', 'zb-h2', 'dualpipev-zb', 'interleaved-1f1b', 'interleaved-zb']",
        ),
        (
            "zb-h1",
            True,
            "error: ds_megatron.parallel.pipeline_schedule: zb-h1 is not supported with fp16 "
            "(pipeline_schedule='zb-h1', fp16.enabled=true); use bf16 or fp32, or pipeline_schedule \"1f1b\"",
        ),
        (
            "zb-h2",
            True,
            "error: ds_megatron.parallel.pipeline_schedule: zb-h2 is not supported with fp16 "
            "(pipeline_schedule='zb-h2', fp16.enabled=true); use bf16 or fp32, or pipeline_schedule \"1f1b\"",
        ),
    ],
    ids=["unknown", "fp16", "fp16-zb-h2"],
)
def test_pipeline_schedule_is_validated(schedule, fp16, message):
    from ds_megatron.config import ConfigError, resolve

    model = gpt_tiny()
    cfg = {"train_micro_batch_size_per_gpu": 1, "ds_megatron": {"model": model}}
    cfg["ds_megatron"]["parallel"] = {"pipeline_schedule": schedule, "pp": 2}
    if fp16:
        cfg["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 2)
    assert str(err.value) == message
    cfg.pop("fp16", None)
    for name in ("zb-h1", "zb-h2"):
        cfg["ds_megatron"]["parallel"] = {"pipeline_schedule": name, "pp": 2}
        assert resolve(cfg, 2).section.parallel.pipeline_schedule == name
    cfg["ds_megatron"]["parallel"] = {"pipeline_schedule": "zb-h2", "pp": 1}
    with pytest.raises(ConfigError, match="pp 1 has one stage"):
        resolve(cfg, 1)


class _FakeBF16Optimizer:
    """Records the calls DeepSpeed's BF16 optimizer gets around a W pass."""

    def __init__(self, calls: list):
        self.calls = calls

    def clear_lp_grads(self):
        self.calls.append("clear")

    def update_hp_grads(self, clear_lp_grads=False):
        self.calls.append("update")


def _fake_engine(calls: list, queue, bf16: bool):
    from types import SimpleNamespace

    from ds_megatron.pipeline_parallel.zero_bubble import ZeroBubblePipelineEngine

    engine = ZeroBubblePipelineEngine.__new__(ZeroBubblePipelineEngine)  # no DeepSpeed initialisation needed here
    engine.weight_grad_queue = queue
    engine.using_bf16_optimizer = bf16
    engine.optimizer = _FakeBF16Optimizer(calls)
    engine._config = SimpleNamespace(bfloat16_config=SimpleNamespace(immediate_grad_update=False))
    return engine


def test_w_pass_moves_bf16_gradients_once_and_the_step_refuses_leftovers():
    """Under the BF16 optimizer each W pass is framed like a backward pass (16-bit gradients zeroed before, added to
    the fp32 accumulators after), one W pass per instruction, all of them at the reductions; an optimizer step that
    finds W passes queued raises instead of stepping on partial gradients."""
    import torch

    from ds_megatron.pipeline_parallel.zero_bubble import ZeroBubblePipelineEngine
    from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue

    calls: list = []
    queue = WeightGradQueue()
    p = torch.zeros(1, requires_grad=True)
    for i in range(3):
        queue.defer((p,), lambda i=i: (calls.append(f"W{i}") or torch.ones(1),))
        queue.seal()
    engine = _fake_engine(calls, queue, bf16=True)
    engine._exec_weight_grad_pass()
    assert calls == ["clear", "W0", "update"] and len(queue) == 2
    with pytest.raises(RuntimeError, match="2 W pass"):
        ZeroBubblePipelineEngine._exec_optimizer_step(engine)
    engine._run_weight_grads(all_of_them=True)  # what ReduceTiedGrads runs first
    assert calls == ["clear", "W0", "update", "clear", "W1", "update", "clear", "W2", "update"]
    assert len(queue) == 0 and p.grad.item() == 3.0
    plain: list = []
    queue.defer((p,), lambda: (plain.append("W") or torch.ones(1),))
    _fake_engine(plain, queue, bf16=False)._exec_weight_grad_pass()  # fp32: .grad directly, no framing
    assert plain == ["W"] and p.grad.item() == 4.0


CPU_COSTS = (1.44, 1.48, 1.0)  # T_F, T_B, T_W per micro-batch measured on CPU at h 256, s 128 (39, 40, 27 ms)


SLOW_W_COSTS = (0.8, 1.0, 0.9)  # T_F < T_W < T_B, relative: measured on CPU for GPT-2 at h 1024, s 64


def _check_dependencies(ops: tuple[tuple[tuple, ...], ...]) -> None:
    """The zb_order ops a ZB-H2 schedule maps one to one onto DeepSpeed instructions: each receive comes before
    the pass that needs it (a gradient between the previous backward and its own: the engine keeps one), each send
    after the pass that produced it, and the n-th send on a link carries the micro-batch the n-th receive there
    expects (DeepSpeed matches them in order)."""
    p = len(ops)
    for stage, stream in enumerate(ops):
        received, grad, done = set(), None, set()
        for op in stream:
            kind, mb = op[0], op[1] if len(op) == 2 else None
            if kind == "RA":
                received.add(mb)
            elif kind == "RG":
                assert grad is None, (stage, op, "a second gradient before the backward of the first")
                grad = mb
            elif kind == "F":
                assert stage == 0 or mb in received, (stage, op)
                done.add(("F", mb))
            elif kind == "B":
                assert ("F", mb) in done and (stage == p - 1 or grad == mb), (stage, op)
                grad = None
                done.add(("B", mb))
            elif kind in ("SA", "SG"):
                assert ("F" if kind == "SA" else "B", mb) in done, (stage, op)
    for stage in range(p - 1):
        sent = [op[1] for op in ops[stage] if op[0] == "SA"]
        assert sent == [op[1] for op in ops[stage + 1] if op[0] == "RA"] == list(range(len(sent)))
        sent = [op[1] for op in ops[stage + 1] if op[0] == "SG"]
        assert sent == [op[1] for op in ops[stage] if op[0] == "RG"] == list(range(len(sent)))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), CPU_COSTS, SLOW_W_COSTS], ids=["equal", "cpu", "slow-w"])
def test_zb_h2_streams_are_valid_deepspeed_programs(m, p, costs):
    """Every stage forwards and backwards each micro-batch once, in order, with one W pass per backward, all before
    the reductions; never more than 2(p - s) - 1 forwards ahead nor more W passes queued than the memory model
    counts; every dependency met (:func:`_check_dependencies`); a pipe buffer is never reused while its micro-batch
    still needs it; and the timing model runs the streams to the end (no receives waiting on each other).  Whether
    the order is a list schedule or ZB-H1's fallback."""
    from ds_megatron.config.schema import pipeline_schedule
    from ds_megatron.memory import stage_activations_in_flight, stage_deferred_w_passes

    per_stage = streams(ZeroBubbleH2Schedule, m, p, costs=costs)
    _check_dependencies(tuple(ZeroBubbleH2Schedule(m, p, stage, costs=costs).ops for stage in range(p)))
    h2 = pipeline_schedule("zb-h2")
    for stage, stream in enumerate(per_stage):
        buffers = ZeroBubbleH2Schedule(m, p, stage, costs=costs).num_pipe_buffers()
        forwards, backwards, pending, live, peak_f, peak_w = [], [], 0, {}, 0, 0
        for i, cmd in enumerate(stream):
            if isinstance(cmd, ds.ForwardPass):
                forwards.append(i)
            elif isinstance(cmd, ds.BackwardPass):
                backwards.append(i)
                pending += 1
            elif isinstance(cmd, WeightGradPass):
                pending -= 1
                assert pending >= 0
            elif isinstance(cmd, ds.ReduceTiedGrads):
                assert pending == 0
            peak_f = max(peak_f, len(forwards) - len(backwards))
            peak_w = max(peak_w, pending)
            buffer = getattr(cmd, "buffer_id", None)
            if buffer is not None:  # micro-batch of this op: F/B/RA/SA/... count in order per kind
                kind = type(cmd)
                n = live.setdefault(("n", kind), 0)
                live[("n", kind)] = n + 1
                assert buffer == n % buffers, (stage, i, cmd)
                owner = live.get(("buffer", buffer))
                if owner is not None and owner != n:  # a new micro-batch takes the buffer: the old one is done
                    assert owner < n and ("done", owner) in live, (stage, i, cmd, owner)
                live[("buffer", buffer)] = n
                if kind is (ds.BackwardPass if stage == 0 else ds.SendGrad):
                    live[("done", n)] = True
        assert len(forwards) == len(backwards) == m
        assert peak_f <= stage_activations_in_flight(h2, p, stage, m) == min(m, 2 * (p - stage) - 1)
        assert peak_w <= stage_deferred_w_passes(h2, p, stage, m)
    makespan(per_stage, dict(zip("FBW", costs)))


def _bubbles(p: int, m: int, costs: tuple) -> tuple[float, float]:
    """(ZB-H1's, ZB-H2's) tuner bubbles at ``costs``, each checked against the makespan of the instructions the
    engine runs (the order ZB-H2's engine builds for those costs)."""
    from ds_megatron.tune.training.schedules import bubble_s

    work, cost = m * sum(costs), dict(zip("FBW", costs))
    h1, h2 = bubble_s("zb-h1", p, m, *costs), bubble_s("zb-h2", p, m, *costs)
    assert makespan(streams(ZeroBubbleH1Schedule, m, p), cost) - work == pytest.approx(h1)
    assert makespan(streams(ZeroBubbleH2Schedule, m, p, costs=costs), cost) - work == pytest.approx(h2)
    return h1, h2


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_zb_h2_never_behind_zb_h1_when_the_forward_is_cheapest(p, m):
    """T_F 0.8, T_B 1, T_W 0.9: a W no longer fits where a forward would, and ZB-H1's order idles (p - 1) T_B.
    ZB-H2's is never predicted slower (at m = p, where its extra forwards have no room, it is ZB-H1's order), and
    from m = 2p its list schedule reaches the (p - 1) T_F floor.  (Its order built under blocking sends left
    T_F + T_B per stage under the async ones.)"""
    t_f, t_b, _ = SLOW_W_COSTS
    h1, h2 = _bubbles(p, m, SLOW_W_COSTS)
    assert h2 <= h1 + 1e-9
    assert h1 == pytest.approx((p - 1) * t_b)
    if m >= 2 * p:
        assert h2 == pytest.approx((p - 1) * t_f)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zb_h2_reaches_its_floor_at_equal_costs(p, m):
    """The paper's ZB-H2 bubble, (p - 1)(T_F + T_B - 2 T_W), zero at equal costs, is its steady state with the
    optimizer step's synchronisation moved out of the way; DeepSpeed's step synchronises every stage at its end
    and the last stage cannot start before (p - 1) T_F, so within one step the value is (p - 1) T_F (a third of
    1F1B's): reached at T_F = T_B = T_W = 1, as ZB-H1 does (ZB-H2 then runs ZB-H1's order, the first of equals;
    the order built under blocking sends was a slot longer at pp 4)."""
    h1, h2 = _bubbles(p, m, (1.0, 1.0, 1.0))
    assert h2 == pytest.approx(p - 1) and h1 == pytest.approx(p - 1)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (2, 16), (4, 8), (4, 16)])
def test_zb_h2_halves_1f1b_bubble_with_cpu_costs(p, m):
    """With the costs measured on CPU (T_F about T_B + T_W), ZB-H1's bubble is at best half of 1F1B's; ZB-H2, built
    for those costs, reaches (p - 1) T_F from m = 2p (the floor under DeepSpeed's synchronised step: the last stage
    waits that long for its first activation).  The tuner's bubbles are these simulated makespans
    (tune.training.schedules.bubble_s)."""
    from ds_megatron.tune.training.schedules import bubble_s

    t_f, t_b, t_w = CPU_COSTS
    work = m * (t_f + t_b + t_w)
    one_f_one_b = makespan(streams(ds.TrainSchedule, m, p), {"F": t_f, "B": t_b + t_w}) - work
    h1, h2 = _bubbles(p, m, CPU_COSTS)
    assert one_f_one_b == pytest.approx(bubble_s("1f1b", p, m, *CPU_COSTS))
    assert h2 <= h1 + 1e-9
    assert h2 == pytest.approx((p - 1) * t_f) and h2 <= one_f_one_b / 2


@pytest.mark.parametrize("p", [2, 3])
def test_zb_h2_order_built_per_stage_costs(p):
    """The last stage also runs the output layer and the loss: built for each stage's own costs (the engine's agreed
    costs), the order still reaches the floor, the first p - 1 stages' forwards, with the CPU's costs and a last
    stage about 10% heavier; the engine's agreed costs are each stage's own means, the same on every rank (one
    all-reduce)."""
    from ds_megatron.pipeline_parallel.schedules.simulate import makespan as zb_makespan
    from ds_megatron.pipeline_parallel.schedules.zb_order import zb_h2_streams

    per_stage = (CPU_COSTS,) * (p - 1) + ((1.67, 1.6, 1.1),)
    work = 8 * sum(per_stage[-1])
    assert zb_makespan(zb_h2_streams(p, 8, per_stage), per_stage) - work == pytest.approx((p - 1) * CPU_COSTS[0])


def test_agreed_costs_are_each_stages_medians_on_every_rank(monkeypatch):
    import torch

    from ds_megatron.pipeline_parallel import zero_bubble

    other = torch.zeros(2, 6, dtype=torch.float64)
    other[1] = torch.tensor([2.0, 1, 1.5, 1, 1.0, 1], dtype=torch.float64)  # stage 1's rank: F 2, B 1.5, W 1 s
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.add_(other))
    # stage 0: medians F 1, B 1, W 0.5 s (one F the machine delayed does not move them)
    mine = {"F": [1.0, 9.0, 1.0], "B": [1.0, 1.0], "W": [0.5, 0.5, 0.4]}
    assert zero_bubble.agreed_costs(mine, 0, 2) == ((0.5, 0.5, 0.25), (1.0, 0.75, 0.5))


def test_agreed_costs_all_reduce_runs_on_the_engines_device(monkeypatch):
    """NCCL has no CPU tensors ("No backend type associated with device type cpu"): the table the engine hands to
    the all-reduce after step 1 lives on the device the engine declares (``meta`` stands in for a GPU here)."""
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ds_megatron.pipeline_parallel.zero_bubble import ZeroBubbleH2PipelineEngine

    class Reached(Exception):
        pass

    devices = []

    def all_reduce(table, *args, **kwargs):
        devices.append(table.device)
        raise Reached  # a meta tensor cannot come back; the device is what is checked

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(PipelineEngine, "_exec_optimizer_step", lambda self, lr_kwargs=None: None)
    engine = ZeroBubbleH2PipelineEngine.__new__(ZeroBubbleH2PipelineEngine)
    engine.weight_grad_queue, engine.stage_id, engine.num_stages = [], 0, 2
    engine.device = torch.device("meta")
    engine._zb_timing = {"F": [1.0], "B": [1.0], "W": [0.5]}
    with pytest.raises(Reached):
        engine._exec_optimizer_step()
    assert devices == [torch.device("meta")]


def test_received_gradients_are_not_overwritten_by_the_next_receive(monkeypatch):
    """DeepSpeed receives every gradient into one buffer; a W pass queued across the next receive (ZB-H2, and ZB-H1
    at pp > 2) keeps the gradient it was given, so the engine hands DeepSpeed its own buffer back, never the copy."""
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ds_megatron.pipeline_parallel.zero_bubble import ZeroBubblePipelineEngine

    def receive(self, buffer_id):  # DeepSpeed's: allocate once, then receive in place into grad_layer
        if self.grad_layer is None:
            self.grad_layer = torch.zeros(3)
        self.grad_layer.fill_(float(buffer_id))

    monkeypatch.setattr(PipelineEngine, "_exec_recv_grads", receive)
    engine = ZeroBubblePipelineEngine.__new__(ZeroBubblePipelineEngine)
    engine.grad_layer = None
    engine._exec_recv_grads(1)
    kept = engine.grad_layer  # what the stage's last linear's W pass holds
    engine._exec_recv_grads(2)
    assert kept.tolist() == [1.0] * 3 and engine.grad_layer.tolist() == [2.0] * 3
