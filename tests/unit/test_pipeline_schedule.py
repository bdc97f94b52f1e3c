"""Pipeline schedules (``ds_megatron.parallel.pipeline_schedule``): what each refuses before launch, the layout
table's rank -> layers under each, the DeepSpeed settings and hooks each needs.  No process group: the training
parity of DualPipeV with 1F1B (both families, tp 1 and tp 2 with SP, recompute, dropout replay) and its checkpoints,
export, sampling and bf16 run in the parity launches (test_parity.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import ForwardPass, ReduceTiedGrads
from tiny import tiny_model

from ds_megatron.checkpoint.layout import stage_param_layers
from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.facts import needs_resharding
from ds_megatron.config.schema import PIPELINE_SCHEDULES, pipeline_schedule
from ds_megatron.engine import deepspeed_config_for, install_step_sp_grad_sync
from ds_megatron.model import model_config

BASE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "ds_megatron": {
        "model": tiny_model(),
        "parallel": {"tp": 1, "pp": 2, "pipeline_schedule": "dualpipev"},
    },
}


def cfg(tp: int = 1, pp: int = 2, schedule: str = "dualpipev", **top) -> dict:
    out = copy.deepcopy(BASE)
    out["ds_megatron"]["parallel"].update(tp=tp, pp=pp, pipeline_schedule=schedule)
    for key, value in top.items():
        node = out
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def test_default_is_1f1b_and_the_values_are_one_table():
    c = copy.deepcopy(BASE)
    del c["ds_megatron"]["parallel"]["pipeline_schedule"]
    assert resolve(c, 2).section.parallel.pipeline_schedule == "1f1b"
    assert [s.name for s in PIPELINE_SCHEDULES] == [
        "1f1b",
        "dualpipev",
        "zb-h1",
        "zb-h2",
        "dualpipev-zb",
        "interleaved-1f1b",
        "interleaved-zb",
    ]
    assert resolve(cfg(), 2).section.parallel.pipeline_schedule == "dualpipev"


REFUSED = [
    ("unknown", cfg(schedule="gpipe"), "error: ds_megatron.parallel.pipeline_schedule: unknown schedule (got 'gpipe')"),
    (
        "pp 1",
        cfg(pp=1, train_batch_size=8, gradient_accumulation_steps=4),
        "error: ds_megatron.parallel.pipeline_schedule: schedules other than 1f1b reorder pipeline stages, and pp 1 "
        "has one stage (pipeline_schedule='dualpipev', pp=1); set pp >= 2",
    ),
    (
        "too few micro-batches",
        cfg(train_batch_size=6, gradient_accumulation_steps=3),
        "error: gradient_accumulation_steps: the dualpipev schedule needs at least 2 x pp micro-batches per step (it "
        "fills the pipeline from both ends) (gradient_accumulation_steps=3, pp=2, pipeline_schedule='dualpipev'); "
        "set gradient_accumulation_steps >= 4",
    ),
    (
        "fewer blocks than stages",
        cfg(ds_megatron__model__num_layers=3),
        "error: ds_megatron.parallel.pp: fewer layers than pipeline stages (num_layers=3, pp=2, dualpipev: 2 stages "
        'per rank); use at least 4 layers for dualpipev, or pipeline_schedule "1f1b" with pp <= 3',
    ),
    (
        "full recompute of more blocks than a stage holds",
        cfg(ds_megatron__recompute={"policy": "full", "num_layers": 2}),
        "error: ds_megatron.recompute.num_layers: more recomputed layers than a pipeline stage holds (num_layers=2, "
        "4 layers / 4 stages (dualpipev: 2 per rank) = at most 1 per stage)",
    ),
    (
        "TP-partitioned boundary tensors",
        cfg(tp=2, pipeline={"pipe_partitioned": True}),
        "error: pipeline.pipe_partitioned: DeepSpeed's dualpipev engine sends whole stage-boundary tensors",
    ),
    ("dynamic shapes", cfg(pipeline={"dynamic_shape": True}), "error: pipeline.dynamic_shape: DeepSpeed's dualpipev"),
    ("fp16", cfg(fp16={"enabled": True}), "error: fp16.enabled: fp16 under the dualpipev schedule gives other"),
]


@pytest.mark.parametrize("config,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_before_launch_in_one_line(config, message):
    tp = config["ds_megatron"]["parallel"]["tp"]
    with pytest.raises(ConfigError) as err:
        resolve(config, tp * config["ds_megatron"]["parallel"]["pp"])
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_what_runs_is_accepted():
    """bf16 + ZeRO-1, fp32 ZeRO 0 and ZeRO-1, tied and untied, SP: all measured to train like 1F1B."""
    for extra in (
        {},
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
        {"zero_optimization": {"stage": 1}},
    ):
        resolve({**cfg(tp=2, ds_megatron__parallel__sequence_parallel=True), **extra}, 4)
    resolve(cfg(ds_megatron__recompute={"policy": "full", "num_layers": 1}), 2)


def test_deepspeed_boundary_partitioning_is_turned_off_at_tp_2():
    """DeepSpeed's DualPipeV engine asserts pipe_partitioned and grad_partitioned off; DeepSpeed's default is on."""
    notes: list[str] = []
    ds = deepspeed_config_for(resolve(cfg(tp=2), 4), notes)
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert notes == ["dualpipev: pipeline.pipe_partitioned and grad_partitioned turned off"]
    assert "pipeline" not in deepspeed_config_for(resolve(cfg(tp=2, schedule="1f1b"), 4))


def test_a_schedule_change_reshards_on_load():
    """The optimizer files hold another rank's layers under another schedule."""
    dv, f1 = resolve(cfg(), 2).ds_config, resolve(cfg(schedule="1f1b"), 2).ds_config
    assert needs_resharding(dv, f1) and needs_resharding(f1, dv) and not needs_resharding(dv, dv)
    legacy = copy.deepcopy(f1)
    del legacy["ds_megatron"]["parallel"]["pipeline_schedule"]  # a checkpoint from before the key: 1F1B
    assert not needs_resharding(legacy, f1)


def test_only_a_schedule_that_moves_layers_reshards_on_load():
    """1F1B, ZB-H1 and ZB-H2 hold stage r on rank r (the same module, the same optimizer files), as DualPipeV and
    its zero-bubble variant hold stages r and 2p-1-r: a resume between two of a kind is DeepSpeed's own load, and
    the decision agrees with the layout table the resharding reads, pair by pair, in fp32 and bf16 + ZeRO-1."""
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
    names = [s.name for s in PIPELINE_SCHEDULES]
    for extra in ({}, bf16):
        runs = {name: resolve({**cfg(schedule=name), **extra}, 2) for name in names}
        ds = {name: run.ds_config for name, run in runs.items()}
        layers = {name: stage_param_layers(model_config(run.model), run, 2) for name, run in runs.items()}
        for a in names:
            for b in names:
                assert needs_resharding(ds[a], ds[b]) == (layers[a] != layers[b]), (a, b, extra)
        for a, b in (("1f1b", "zb-h1"), ("zb-h1", "zb-h2"), ("1f1b", "zb-h2"), ("dualpipev", "dualpipev-zb")):
            assert not needs_resharding(ds[a], ds[b]) and not needs_resharding(ds[b], ds[a]), (a, b)
        assert needs_resharding(ds["1f1b"], ds["dualpipev"]) and needs_resharding(ds["zb-h1"], ds["dualpipev-zb"])
    # Another data axis still reshards a partitioned optimizer's files, whichever schedule of a kind resumes.
    dp2 = resolve({**cfg(schedule="zb-h1", train_batch_size=16), **bf16}, 4).ds_config
    assert needs_resharding(ds["1f1b"], dp2)
    unknown = copy.deepcopy(ds["1f1b"])
    unknown["ds_megatron"]["parallel"]["pipeline_schedule"] = "gpipe"  # written by another version: not ours to read
    assert needs_resharding(unknown, ds["1f1b"]) and not needs_resharding(unknown, unknown)


@pytest.mark.parametrize(
    "family,expected",
    [
        # GPT-2: 0 wte (tied), 1 wpe, 2..5 blocks, 6 ln_f, 7 the tied wte again (no parameters of its own)
        ("gpt2", {"1f1b": [[0, 1, 2, 3], [0, 4, 5, 6]], "dualpipev": [[0, 1, 2, 5, 6], [3, 4]]}),
        # Llama untied: 0 embed_tokens, 1..4 blocks, 5 norm, 6 lm_head
        ("llama", {"1f1b": [[0, 1, 2], [3, 4, 5, 6]], "dualpipev": [[0, 1, 4, 5, 6], [2, 3]]}),
    ],
)
def test_layout_table_knows_which_rank_holds_which_layers(family, expected):
    """DualPipeV cuts the layers into 2p stages and rank r holds stages r and 2p-1-r: rank 0 the embedding, the
    first and last blocks, the final norm and the output layer; the tied embedding is one module there."""
    for schedule, ranks in expected.items():
        c = cfg(schedule=schedule)
        if family == "llama":
            c["ds_megatron"]["model"].update(family="llama", num_kv_heads=2, intermediate_size=96)
        run = resolve(c, 2)
        assert stage_param_layers(model_config(run.model), run, 2) == ranks, schedule
    v = pipeline_schedule("dualpipev")
    assert [v.stages_of(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)] and v.loss_rank(4) == 0
    assert pipeline_schedule("1f1b").stages_of(2, 4) == (2,) and pipeline_schedule("1f1b").loss_rank(4) == 3


class _Topology:
    tp, tp_group = 2, None


@pytest.mark.parametrize("engine_class", [PipelineEngine, DualPipeVEngine])
def test_step_sp_grad_sum_keeps_the_schedules_instructions(engine_class):
    """The once-per-step SP gradient sum replaces one instruction in the engine's table; the rest must stay the
    engine's own class's (DualPipeV's forward, backward and p2p take a phase)."""
    engine = engine_class.__new__(engine_class)  # no process group: only the instruction table is looked at
    torch.nn.Module.__init__(engine)
    engine.module = torch.nn.Linear(2, 2)
    run = resolve(cfg(tp=2, ds_megatron__parallel__sequence_parallel=True), 4)
    assert install_step_sp_grad_sync(engine, _Topology(), run)
    table = engine._INSTRUCTION_MAP
    assert table[ForwardPass] is engine_class._INSTRUCTION_MAP[ForwardPass]
    assert set(table) == set(engine_class._INSTRUCTION_MAP)
    assert table[ReduceTiedGrads] is not engine_class._INSTRUCTION_MAP[ReduceTiedGrads]


class _Masters:
    """A checkpoint's optimizer files, by the stage that holds each layer (what ``MasterWeights.stage_of`` finds)."""

    def __init__(self, stage_of_layer: dict[int, int]):
        self.stage_of_layer = stage_of_layer

    def stage_of(self, idx: int, key: str, start: int = 0) -> int | None:
        stage = self.stage_of_layer[idx]
        return stage if stage >= start else None


def test_export_finds_masters_that_return_to_an_earlier_rank():
    """Export walks the layers in order; under DualPipeV the last ones live on rank 0 again."""
    from pathlib import Path

    from ds_megatron.checkpoint.export import _stage_holding

    masters = _Masters({0: 0, 3: 1, 6: 0})  # GPT-2 at pp 2: wte on rank 0, block 1 on rank 1, ln_f on rank 0
    assert _stage_holding(masters, 3, "block.x", 0, Path("f")) == 1
    assert _stage_holding(masters, 6, "ln_f.weight", 1, Path("f")) == 0


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_activations_in_flight_count_deepspeeds_schedules(pp, m):
    """The memory model's in-flight count against DeepSpeed's own instruction streams (forwards not yet backward,
    in micro-batches of a 1F1B stage: DualPipeV's stages are half as deep)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, DualPipeVSchedule, TrainSchedule

    from ds_megatron.memory import stage_activations_in_flight
    from ds_megatron.pipeline_parallel.dualpipev_zb import DualPipeVZeroBubbleSchedule
    from ds_megatron.pipeline_parallel.schedules.zb_order import peak_in_flight, zb_h2_candidates

    for rank in range(pp):
        # ZB-H2 runs whichever of its candidate orders is fastest at the costs a run measures: the most any keeps
        peak = max(peak_in_flight(order[rank])[0] for order in zb_h2_candidates(pp, m))
        assert stage_activations_in_flight(pipeline_schedule("zb-h2"), pp, rank, m) == peak, ("zb-h2", rank)
        for name, sched, depth in (
            ("1f1b", TrainSchedule(m, pp, rank), 1.0),
            ("dualpipev", DualPipeVSchedule(m, pp, rank), 0.5),
            ("dualpipev-zb", DualPipeVZeroBubbleSchedule(m, pp, rank), 0.5),  # no W pass keeps a forward's inputs
        ):
            live = peak = 0
            for step in sched.steps():
                for cmd in step:
                    live += isinstance(cmd, ForwardPass) - isinstance(cmd, BackwardPass)
                    peak = max(peak, live)
            assert stage_activations_in_flight(pipeline_schedule(name), pp, rank, m) == peak * depth, (name, rank)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_records_order_runs_each_micro_batch_on_the_stages_its_placement_gives(p):
    """Each record's per-rank order (``Schedule.order``) holds exactly the stages its placement puts on the rank,
    runs every micro-batch's forward before its backward (whole, or B before its W) on each, and the one timing model
    runs all ranks' orders to the end with every pass costing 1 (a pass waiting on a later one would deadlock) no
    sooner than the busiest rank's work.  A looping placement of v stages per rank (interleaved 1F1B) is r + k p."""
    from ds_megatron.pipeline_parallel.schedules import DEFAULT, RunFacts, schedule_named, simulate

    for schedule in PIPELINE_SCHEDULES:
        m = max(5, schedule.micro_batches_per_rank * p)
        while schedule.refuse(RunFacts(1, p, m, "fp32", {}, DEFAULT.name)):  # interleaving's multiple of p
            m += 1
        orders = [schedule.order(p, m, rank) for rank in range(p)]
        for rank, order in enumerate(orders):
            assert {stage for _, stage, _ in order} == set(schedule.stages_of(rank, p)), (schedule.name, rank)
            for stage in schedule.stages_of(rank, p):
                for mb in range(m):
                    kinds = [kind for kind, s, b in order if (s, b) == (stage, mb)]
                    assert kinds in (["F", "BW"], ["F", "B", "W"]), (schedule.name, rank, stage, mb, kinds)
        streams = simulate.pass_streams(orders, p * schedule.stages_per_rank)
        assert simulate.makespan(streams, (1.0, 1.0, 1.0)) >= 3 * m * schedule.stages_per_rank, schedule.name
    interleaved = schedule_named("interleaved-1f1b")
    assert [interleaved.stages_of(r, 4) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert interleaved.per_rank(type("Parallel", (), {"virtual_stages": 3})()) == 3
    assert interleaved.stages_of(1, 4, per_rank=3) == (1, 5, 9)
