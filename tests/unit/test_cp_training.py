"""Context parallelism wired into training: the settings and their refusals, the batch arithmetic handed to
DeepSpeed, the data split, and whole-model parity in-process.

The parity tier spawns one gloo group per world size (2 and 4 processes) and runs every layout there: the training
path's own pipeline layers (embedding, positions, blocks with their ``BlockHooks``, final norm, vocabulary-parallel
output and loss), built by ``pipeline.layer_specs`` for a topology with a CP axis, are run on each rank's
``split_window`` of the micro-batch; gradients are then averaged over DeepSpeed's data axis (dp x cp ranks), as
DeepSpeed's engine does.  Each rank compares, in fp32 within 1e-5, with the single-device model on the whole batch:
the loss (averaged over the data axis once), every gradient (this rank's shard) and the global gradient norm
(``optim.global_grad_norm``: CP ranks are replicas of the weights and must not be counted twice).  Layouts cover
both families, ring and a2a, eager and sdpa, grouped-query attention, TP with sequence parallelism, dp 2, cp 4,
selective and full recompute, and a sequence length that is not a power of two (24).  With packed documents
(``docs``: ``data.document_mask``, restart positions, EOS tokens whose documents cross chunk and rank boundaries)
the reference is the single-device model given the whole window's ``document_layout``, at cp 1 (tp 1, tp 2 + SP)
and cp 2 (ring, a2a, SP), both families; ``stages`` cuts the layers into two stages at the second block and
passes the boundary tuple the way DeepSpeed's pipeline engine does (received tensors detached, ``requires_grad``
for floating ones only; backward of the floating outputs only).  The DeepSpeed engine path
(its gradient average, its norm, the pipeline) is checked by the launcher parity run (tests/launcher/test_parity.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from inprocess import Pairs, failures, run_checks, spawn_reports
from torch import nn

from ds_megatron.config import ConfigError, resolve
from ds_megatron.context_parallel.layout import unslice
from ds_megatron.data.stream import MicroBatchStream
from ds_megatron.model import build_model, model_config

SEQ = 24  # not a power of two; divisible by 2 cp (cp 2, 4) and by cp tp (cp 2, tp 2: sequence parallel)
LLAMA = {"family": "llama", "num_kv_heads": 2, "intermediate_size": 48, "rope_theta": 10000.0}


def config(
    tp=1, cp=1, dp=1, *, seq=SEQ, sp=False, comm="ring", attention="eager", llama=False, tied=True, docs=False, **kw
):
    model = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_heads": 4,
        "vocab_size": 101,
        "seq_length": seq,
        "dropout": kw.pop("dropout", 0.0),
        "attention": attention,
    }
    if llama:
        model.update(LLAMA, tie_word_embeddings=tied)
    return {
        "train_batch_size": 2 * dp,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "ds_megatron": {
            "model": model,
            "parallel": {"tp": tp, "cp": cp, "cp_comm": comm, "sequence_parallel": sp},
            "recompute": kw.pop("recompute", {"policy": "none"}),
            "train": {"seed": 1234},
            "data": {"document_mask": docs},
        },
    }


# ---- settings, refusals, batch arithmetic ------------------------------------------------------------------------


def test_cp_sets_dp_and_keeps_the_batch_in_sequences():
    from ds_megatron.engine import deepspeed_config_for

    run = resolve(config(tp=2, cp=2, dp=2), 8)
    assert (run.tp, run.cp, run.dp, run.global_batch_size) == (2, 2, 2, 4)
    # DeepSpeed's data axis holds dp x cp ranks and checks train_batch_size == micro x accumulation x (dp x cp)
    ds = deepspeed_config_for(run)
    assert ds["train_batch_size"] == 8 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    assert deepspeed_config_for(resolve(config(dp=2), 2))["train_batch_size"] == 4  # cp 1: unchanged


@pytest.mark.parametrize(
    "cfg, world, message",
    [
        (
            config(cp=2, seq=18),
            2,
            "error: ds_megatron.parallel.cp: seq_length divisible by 2 x cp = 4: rank i holds chunks i and "
            "2 x cp - 1 - i (seq_length=18, cp=2); use seq_length 16 or 20 (any multiple of 4) or another cp",
        ),
        (config(tp=4, cp=2, sp=True, seq=20), 8, "divisible by 2 x cp = 4 and by cp x tp = 8 (sequence parallel)"),
        (config(tp=2, cp=4, comm="a2a"), 8, "error: ds_megatron.parallel.cp_comm: a2a needs the num_heads per TP rank"),
        (config(tp=2, cp=2, llama=True, comm="a2a"), 4, "a2a needs the num_kv_heads per TP rank divisible by cp"),
        (config(cp=2, dropout=0.1), 2, "error: ds_megatron.parallel.cp: attention dropout cannot run with cp > 1"),
        (config(cp=2, comm="ulysses"), 2, "error: ds_megatron.parallel.cp_comm: unknown exchange (got 'ulysses')"),
        (config(cp=0), 2, "error: ds_megatron.parallel.cp: must be a positive integer (got 0)"),
        (
            config(tp=2, cp=2),
            6,
            "tp x cp x pp does not divide the world size (tp(2) x cp(2) x pp(1) = 4, world size 6)",
        ),
    ],
)
def test_cp_refusals(cfg, world, message):
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world)
    assert message in str(err.value)


def test_cli_flags():
    from ds_megatron.cli.train import apply_overrides, build_parser

    args = build_parser().parse_args(["--deepspeed_config", "x.json", "--cp", "2", "--cp_comm", "a2a"])
    cfg = apply_overrides({"ds_megatron": {}}, args)
    assert cfg["ds_megatron"]["parallel"] == {"cp": 2, "cp_comm": "a2a"}


def test_resharding_counts_deepspeeds_data_axis_and_takes_cp(monkeypatch, tmp_path):
    from ds_megatron.checkpoint import manifest
    from ds_megatron.config.facts import data_axis, needs_resharding
    from ds_megatron.preflight import check_resume_shape

    zero1 = {"zero_optimization": {"stage": 1}}
    cp2_dp1 = {**resolve(config(cp=2), 2).ds_config, **zero1}
    cp1_dp2 = {**resolve(config(dp=2), 2).ds_config, **zero1}
    cp1_dp1 = {**resolve(config(), 1).ds_config, **zero1}
    assert [data_axis(c) for c in (cp2_dp1, cp1_dp2, cp1_dp1)] == [2, 2, 1]
    assert not needs_resharding(cp2_dp1, cp1_dp2)  # ZeRO-1 partitions over dp x cp = 2 in both
    assert needs_resharding(cp2_dp1, cp1_dp1)
    monkeypatch.setattr(manifest, "tag_config", lambda load, tag: cp2_dp1)
    check_resume_shape(resolve(cp1_dp2, 2), tmp_path, "step00000002")  # no resharding needed: allowed
    # Another dp x cp: the partitions are resharded on load (one per rank of the data axis), as for another dp.
    check_resume_shape(resolve(cp1_dp1, 1), tmp_path, "step00000002")
    check_resume_shape(resolve({**resolve(config(cp=4), 4).ds_config, **zero1}, 4), tmp_path, "step00000002")
    # fp16's loss scaler is not resharded: it resumes only where the partitions are the saved ones.
    fp16 = {"fp16": {"enabled": True}}
    monkeypatch.setattr(manifest, "tag_config", lambda load, tag: {**cp2_dp1, **fp16})
    check_resume_shape(resolve({**cp1_dp2, **fp16}, 2), tmp_path, "step00000002")
    with pytest.raises(ConfigError) as err:
        check_resume_shape(resolve({**cp1_dp1, **fp16}, 1), tmp_path, "step00000002")
    assert "fp16 run resumes only at the tp, pp and dp x cp it was saved at" in str(err.value)
    assert "(tp 1 x cp 2 x pp 1 x dp 1 in" in str(err.value) and "resume with --tp 1 --cp 2 --pp 1 on 2" in str(
        err.value
    )


def test_positions_are_the_chunks_global_indices():
    from ds_megatron.context_parallel.layout import token_indices
    from ds_megatron.model.layers import positions_tensor
    from ds_megatron.parallelize import ParallelContext, parallelize_model
    from ds_megatron.topology import Group

    cfg = model_config(resolve(config(cp=2), 2).model)
    for cp in (1, 2, 4):
        for rank in range(cp):
            ctx = ParallelContext(cfg, Group(), False, None, cp=Group(None, rank, cp))
            assert torch.equal(positions_tensor(ctx.positions(SEQ // cp)), token_indices(SEQ, rank, cp))
    with pytest.raises(ValueError, match="cp > 1 runs through the pipeline layers"):
        parallelize_model(build_model(cfg), ParallelContext(cfg, Group(), False, None, cp=Group(None, 0, 2)))


def test_stream_splits_each_window_with_labels_over_the_whole_sequence():
    tokens = torch.arange(1000)

    class Samples:
        def __getitem__(self, k):
            return tokens[k * SEQ : k * SEQ + SEQ + 1]

    def batches(cp_rank, cp, dp_rank=1):
        stream = MicroBatchStream(Samples(), 2, 2, dp_rank, 2, 3, cp_rank, cp)
        return [next(stream) for _ in range(4)]

    whole = batches(0, 1)
    for cp in (2, 4):
        pieces = [batches(r, cp) for r in range(cp)]  # the same samples on every CP rank of a replica
        for i, (ids, labels) in enumerate(whole):
            assert torch.equal(unslice([p[i][0] for p in pieces], 1), ids)
            assert torch.equal(unslice([p[i][1] for p in pieces], 1), labels)  # incl. each chunk's last label


# ---- whole-model parity, in-process ------------------------------------------------------------------------------


class Layout(NamedTuple):
    tp: int
    cp: int
    dp: int
    options: tuple[str, ...] = ()  # llama, untied, sp, a2a, sdpa, selective, full, docs, stages

    @property
    def name(self) -> str:
        return "-".join([f"tp{self.tp}", f"cp{self.cp}", f"dp{self.dp}", *self.options])


LAYOUTS = {
    2: [
        Layout(1, 2, 1),
        Layout(1, 2, 1, ("a2a", "sdpa")),
        Layout(1, 2, 1, ("llama", "sdpa")),
        Layout(1, 2, 1, ("llama", "untied", "a2a")),
        Layout(1, 2, 1, ("selective",)),
        Layout(1, 2, 1, ("llama", "full")),
        Layout(1, 1, 2, ("docs",)),
        Layout(1, 1, 2, ("docs", "llama", "sdpa")),
        Layout(1, 2, 1, ("docs",)),
        Layout(1, 2, 1, ("docs", "llama", "a2a")),
        Layout(1, 2, 1, ("docs", "a2a", "selective")),
        Layout(1, 2, 1, ("docs", "stages")),
        Layout(1, 2, 1, ("docs", "llama", "stages", "full")),
    ],
    4: [
        Layout(2, 2, 1, ("sp",)),
        Layout(2, 2, 1, ("llama", "sp", "sdpa")),
        Layout(2, 2, 1, ("a2a", "sp")),
        Layout(1, 2, 2),
        Layout(1, 2, 2, ("llama", "a2a", "sdpa")),
        Layout(1, 4, 1, ("llama",)),
        Layout(1, 4, 1, ("a2a", "sdpa")),
        Layout(2, 1, 2, ("docs", "sp")),
        Layout(2, 1, 2, ("docs", "sp", "llama", "selective")),
        Layout(2, 2, 1, ("docs", "sp", "a2a")),
        Layout(2, 2, 1, ("docs", "sp", "llama", "stages")),
    ],
}


def layout_run(layout: Layout, world: int):
    o = layout.options
    recompute = {"policy": "selective"} if "selective" in o else {"policy": "none"}
    if "full" in o:
        recompute = {"policy": "full", "num_layers": 1}
    cfg = config(
        layout.tp,
        layout.cp,
        layout.dp,
        sp="sp" in o,
        comm="a2a" if "a2a" in o else "ring",
        attention="sdpa" if "sdpa" in o else "eager",
        llama="llama" in o,
        tied="untied" not in o,
        recompute=recompute,
        docs="docs" in o,
    )
    return resolve(cfg, world)


EOS = 0
EOS_AT = ((4, 9, 10, 17), (2, 13, 20))  # per batch row: documents crossing chunks (cp 2: 6 tokens) and ranks


def packed_windows(n: int, seq: int, vocab: int) -> torch.Tensor:
    """[n, seq + 1] windows of random non-EOS tokens with EOS at ``EOS_AT`` (by row parity)."""
    windows = torch.randint(1, vocab, (n, seq + 1))
    for row in range(n):
        windows[row, list(EOS_AT[row % 2])] = EOS
    return windows


def through_boundary(x):
    """What the next stage receives from DeepSpeed's pipeline engine: each tensor a detached copy, ``requires_grad``
    set for floating ones only (``_exec_recv_activations``)."""
    xs = x if isinstance(x, tuple) else (x,)
    got = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in xs)
    return got if isinstance(x, tuple) else got[0]


@contextlib.contextmanager
def document_work(cp_group) -> Iterator[Counter[str]]:
    """Counts what packed documents cost besides attention itself: attention plans made (``plan_documents``),
    all-gathers over the CP group, ``.cpu()`` copies (each a device sync on a GPU) and per-token rotary tables."""
    from ds_megatron.context_parallel import attention as cp_comm
    from ds_megatron.model.llama import model as llama_model

    counts: Counter[str] = Counter()
    patched = [
        (cp_comm, "plan_documents", "plans", None),
        (dist, "all_gather", "all-gathers over the CP group", lambda *a, group=None, **k: group is cp_group),
        (torch.Tensor, "cpu", ".cpu() copies", None),
        (llama_model, "_rotary_rows", "rotary rows built", None),
    ]
    saved = []
    for owner, attr, name, counted_if in patched:
        real = getattr(owner, attr, None)
        saved.append((owner, attr, real))
        if real is None:  # nothing to count under that name
            continue

        def counting(*args, _real=real, _name=name, _if=counted_if, **kwargs):
            counts[_name] += _if is None or _if(*args, **kwargs)
            return _real(*args, **kwargs)

        setattr(owner, attr, counting)
    try:
        yield counts
    finally:
        for owner, attr, real in saved:
            if real is not None:
                setattr(owner, attr, real)


def parity_check(layout: Layout, world: int, _ctx: None) -> Pairs:
    from ds_megatron.data.document_mask import document_layout
    from ds_megatron.data.stream import DocumentMasking, split_batch
    from ds_megatron.optim import global_grad_norm
    from ds_megatron.parallelize import ParallelContext, shard_rule
    from ds_megatron.pipeline_parallel.module import (
        PipelineLayout,
        VocabParallelLoss,
        checkpoint_segment,
        layer_specs,
        lm_head_forward,
    )
    from ds_megatron.tensor_parallel import shard
    from ds_megatron.topology import ParallelTopology

    run = layout_run(layout, world)
    topo = ParallelTopology.build(run.tp, 1, run.dp, run.cp)
    # DeepSpeed's data axis (dp x cp ranks of one TP coordinate): what its engine averages gradients over.
    data_group = None
    for line in topo.ds_topology.get_axis_comm_lists("data"):
        group = dist.new_group(line)
        data_group = group if topo.rank in line else data_group
    cfg = model_config(run.model)
    ctx = ParallelContext(
        cfg,
        topo.tp_axis,
        run.section.parallel.sequence_parallel,
        None,
        recompute=run.section.recompute,
        cp=topo.cp_axis,
        cp_comm=run.section.parallel.cp_comm,
    )
    seed = run.section.train.seed
    specs = layer_specs(cfg, ctx, seed)
    layers = nn.ModuleList(spec.build() for spec in specs[:-1])
    tied = PipelineLayout.of(cfg).tied
    if not tied:
        layers.append(specs[-1].build())
    blocks = [i for i, m in enumerate(layers) if type(m).__name__ == "BlockPipe"]

    data = run.section.data
    documents = DocumentMasking(EOS, data.document_positions) if data.document_mask else None
    if documents is None:
        windows = torch.randint(0, cfg.vocab_size, (run.global_batch_size, run.model.seq_length + 1))
    else:
        windows = packed_windows(run.global_batch_size, run.model.seq_length, cfg.vocab_size)
    mine = windows.chunk(run.dp)[topo.dp_rank]  # the CP ranks of one replica read the same samples
    x, labels = split_batch(mine, topo.cp_rank, topo.cp, documents)
    cut = blocks[1] if "stages" in layout.options else None  # the second stage starts at the second block
    sent = received = None
    with document_work(topo.cp_group if topo.cp > 1 else object()) as work:
        for i, layer in enumerate(layers):
            if i == cut:
                sent, received = x, through_boundary(x)
                x = received
            x = checkpoint_segment(layer, x, None) if "full" in layout.options and i in blocks else layer(x)
        logits = x if not tied else lm_head_forward(layers[0], x)
        loss = VocabParallelLoss(ctx)(logits, labels)
        loss.backward()
        if cut is not None:  # the first stage's backward, from the gradients of the floating tensors it sent
            floats = [(s, r) for s, r in zip(sent, received) if s.is_floating_point()]
            torch.autograd.backward([s for s, _ in floats], [r.grad for _, r in floats])
    pairs: Pairs = []
    if documents is not None:  # one micro-batch, forward and backward (recompute included), on every layer
        stages = 1 + (cut is not None)
        per_stage = stages if topo.cp > 1 else 0  # cp 1: the single-device core builds its mask from the ids
        want = {"plans": per_stage, "all-gathers over the CP group": per_stage, ".cpu() copies": per_stage,
                "rotary rows built": stages if cfg.family == "llama" else 0}  # fmt: skip
        for name, n in want.items():
            pairs.append((f"{name} per micro-batch", torch.tensor(work[name]), torch.tensor(n)))
    if cut is not None:
        local_s, b = run.model.seq_length // run.cp, run.micro_batch_size
        hidden_s = local_s // run.tp if run.section.parallel.sequence_parallel else local_s
        shapes = [(str(t.dtype), tuple(t.shape)) for t in received]
        want = [
            ("torch.float32", (hidden_s, b, cfg.n_embd)),
            ("torch.int64", (b, local_s)),
            ("torch.int64", (b, local_s)),
        ]
        pairs.append(("boundary dtypes and shapes", torch.tensor(int(shapes == want)), torch.tensor(1)))
        pairs.append(
            ("no gradient on the ids", torch.tensor(sum(t.grad is not None for t in received[1:])), torch.tensor(0))
        )
    for p in layers.parameters():  # DeepSpeed's data-parallel average, over dp x cp ranks
        dist.all_reduce(p.grad, group=data_group)
        p.grad /= run.dp * run.cp
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=data_group)
    mean_loss /= run.dp * run.cp
    norm = global_grad_norm(list(layers.parameters()), topo)

    ref = build_model(cfg, seed=seed)
    if documents is None:
        ref_logits = ref(windows[:, :-1])
    else:  # the same mask and positions, on the whole window
        ref_logits = ref(windows[:, :-1], *document_layout(windows[:, :-1], EOS, documents.positions))
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, ref_logits.shape[-1]), windows[:, 1:].reshape(-1))
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))

    layout_names = PipelineLayout.of(cfg)
    pairs += [("loss", mean_loss, ref_loss), ("grad norm", norm.reshape(()), ref_norm)]
    seen = set()
    for name, p in layers.named_parameters():
        full = layout_names.full_name(name)
        seen.add(full)
        expected = shard(ref_grads[full].grad, shard_rule(full, ctx), topo.tp_rank, topo.tp)
        pairs.append((f"grad {full}", p.grad, expected))
    missing = set(ref_grads) - seen
    pairs.append(("every parameter compared", torch.tensor(len(missing)), torch.tensor(0)))
    return pairs


def topology_check(world: int, _ctx: None) -> Pairs:
    """The CP axis inside DeepSpeed's data axis: tp innermost, then cp, then dp; the groups' members."""
    from ds_megatron.topology import ParallelTopology

    tp, cp, dp = (2, 2, 1) if world == 4 else (1, 2, 1)
    topo = ParallelTopology.build(tp, 1, dp, cp)
    rank = dist.get_rank()
    expected_cp = [r for r in range(world) if r % tp == rank % tp]  # ranks (tp 2, cp 2): cp pairs {0, 2} and {1, 3}
    got = [torch.zeros(1) for _ in range(cp)]
    dist.all_gather(got, torch.tensor([float(rank)]), group=topo.cp_group)
    return [
        ("cp group members", torch.cat(got), torch.tensor(expected_cp, dtype=torch.float32)),
        ("coords", torch.tensor([topo.tp_rank, topo.cp_rank, topo.dp_rank]), torch.tensor([rank % tp, rank // tp, 0])),
        ("dp group (true replicas only)", torch.tensor(int(topo.dp_group is None)), torch.tensor(1)),
    ]


def _run_rank(group, rank: int, world: int) -> dict[str, str]:
    checks = {layout.name: functools.partial(parity_check, layout, world) for layout in LAYOUTS[world]}
    checks["topology"] = functools.partial(topology_check, world)
    return run_checks(checks, None)


@pytest.fixture(scope="module")
def reports():
    cache: dict[int, list[dict[str, str]]] = {}  # one spawn per world size, for all its layouts

    def get(world: int) -> list[dict[str, str]]:
        if world not in cache:
            cache[world] = spawn_reports(_run_rank, world)
        return cache[world]

    return get


@pytest.mark.parametrize(
    "world, name",
    [(w, lay.name) for w, lays in LAYOUTS.items() for lay in lays] + [(2, "topology"), (4, "topology")],
)
def test_cp_training_matches_single_device(reports, world, name):
    message = failures(reports(world), name, name)
    assert not message, message


# ---- a checkpoint saved at cp 2 resumes at cp 1, reshards to another dp x cp, and exports ---------------------------
