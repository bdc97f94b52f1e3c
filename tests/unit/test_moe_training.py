"""The mixture-of-experts families trained through the pipeline layers, against the single-device model.

In-process gloo, as ``test_cp_training.py``'s parity tier: the training path's own pipeline layers (``layer_specs``:
embedding, blocks with the routed MLP swapped in by the plan, final norm, vocabulary-parallel output and the loss
with the router losses), run on each rank's tokens; gradients averaged over DeepSpeed's data axis (dp x cp).  Each
rank compares with ``MoeDecoder`` on the whole batch (per data-parallel replica: each micro-batch has its own
routing statistics, as in transformers): the training loss (LM + router_aux_loss_coef x aux + router_z_loss_coef x
z), the LM loss, the load-balancing loss and the z-loss as logged (``router_metrics``), every gradient (this rank's
shard) and the global gradient norm.  fp32 within 1e-5.  Layouts: tp 2 with and without sequence parallelism (the
experts split over TP, the router on the sequence shard under SP), cp 2 (ring and a2a), dp 2, two pipeline stages
(the boundary carries the routing statistics the way DeepSpeed's engine sends it: detached, ``requires_grad``,
its gradient sent back), full recompute and selective recompute of ``moe`` (with ``layernorm`` and ``mlp_act``; at
tp 2 + SP, and at ep 2 folded over tp 2 + SP, where the expert-parallel layer recomputes its local experts);
the three families (Qwen2-MoE's shared expert split over TP as the dense MLP, its gate on the sequence shard under
SP, and run by every EP rank on its own tokens at ep 2, there with the overlapped exchange in 2 chunks, its TP
collectives run while the dispatch is in flight; its q/k/v biases set to a value on both sides); a router
skewed so that one expert gets no token.  Expert tensor parallelism (``expert_tp`` = tp 2 with ep 2: each expert
split over TP, EP over the dp or cp ranks of one tp index) with SP (recompute of ``moe``, the skewed router, over
cp 2, and with the overlapped exchange in 2 chunks) and without (Qwen2-MoE).  bf16: the tp 2 + SP model in bf16
against the single-device bf16 model, within
``BF16_TOLERANCE``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from inprocess import BF16_TOLERANCE, Pairs, failures, run_checks, spawn_reports
from torch import nn

from ds_megatron.config import resolve
from ds_megatron.model import build_model, model_config

SEQ = 24
# Three blocks, the first dense (mlp_only_layers), 4 experts of width 16 (8 per TP rank at tp 2), top 2, a head
# width of its own (head_dim 16 at h 32, a 4); weights large enough that the router losses move the gradients.
MOE = {
    "family": "qwen3_moe",
    "num_layers": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "experts_per_token": 2,
    "norm_topk_prob": False,
    "mlp_only_layers": [0],
    "router_aux_loss_coef": 0.1,
    "router_z_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
# Mixtral with its output layer tied to the embedding (the pipeline's tied output layer then carries the statistics)
MIXTRAL = {**MOE, "family": "mixtral", "num_layers": 2, "head_dim": None, "mlp_only_layers": None}
MIXTRAL["tie_word_embeddings"] = True
MIXTRAL.pop("norm_topk_prob")
# Qwen2-MoE: a shared expert of width 24 (12 per TP rank at tp 2) in every routed block, q/k/v biases, h / a heads
QWEN2 = {**MOE, "family": "qwen2_moe", "head_dim": None, "shared_expert_intermediate_size": 24}
QWEN2_BIAS = 0.05  # the q/k/v biases start at zero: a value both models are given, so that the forward sees them


def config(
    tp=1, cp=1, dp=1, *, sp=False, comm="ring", mixtral=False, recompute=None, attention="eager", ep=1, qwen2=False,
    chunks=1, expert_tp=None,
):  # fmt: skip
    model = {k: v for k, v in (MIXTRAL if mixtral else QWEN2 if qwen2 else MOE).items() if v is not None}
    model.update(vocab_size=101, seq_length=SEQ, dropout=0.0, attention=attention)
    return {
        "train_batch_size": 2 * dp,
        "train_micro_batch_size_per_gpu": 2,
        "ds_megatron": {
            "model": model,
            "parallel": {"tp": tp, "cp": cp, "cp_comm": comm, "sequence_parallel": sp, "ep": ep, "expert_tp": expert_tp}
            | ({"ep_dispatch_chunks": chunks} if chunks > 1 else {}),
            "recompute": recompute or {"policy": "none"},
            "train": {"seed": 1234},
        },
    }


class Layout(NamedTuple):
    tp: int
    cp: int
    dp: int
    # sp, a2a, mixtral, qwen2, stages, full, moe (selective recompute), skew, bf16, ep2, chunks2 (the overlapped EP
    # exchange in 2 chunks: ds_megatron.parallel.ep_dispatch_chunks), etp (expert_tp = tp)
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "-".join([f"tp{self.tp}", f"cp{self.cp}", f"dp{self.dp}", *self.options])


LAYOUTS = {
    2: [
        Layout(1, 1, 2, ("stages", "mixtral")),
        Layout(1, 1, 2, ("full", "skew")),
        Layout(2, 1, 1, ("sp",)),
        Layout(2, 1, 1, ("sp", "stages", "moe")),
        Layout(2, 1, 1, ("mixtral", "skew")),
        Layout(1, 2, 1),
        Layout(1, 2, 1, ("a2a", "stages", "mixtral")),
        Layout(2, 1, 1, ("sp", "bf16")),
        Layout(1, 1, 2, ("ep2",)),
        Layout(2, 1, 1, ("sp", "ep2", "mixtral", "moe")),
        Layout(2, 1, 1, ("sp", "qwen2", "skew")),
        Layout(2, 1, 1, ("qwen2", "stages", "moe")),
        Layout(1, 1, 2, ("ep2", "qwen2")),
        Layout(2, 1, 1, ("sp", "ep2", "qwen2", "chunks2")),
    ],
    4: [
        Layout(2, 2, 1, ("sp", "stages", "skew")),
        Layout(2, 1, 2, ("sp", "ep2", "stages", "skew")),
        # expert TP: each expert split over tp 2, EP over dp 2 (the ranks of one tp index), with and without SP
        Layout(2, 1, 2, ("sp", "ep2", "etp", "skew", "moe")),
        Layout(2, 1, 2, ("ep2", "etp", "qwen2", "chunks2")),
        Layout(2, 2, 1, ("sp", "ep2", "etp", "chunks2")),  # EP over the cp ranks of each tp index
    ],
}


def layout_run(layout: Layout, world: int):
    o = layout.options
    recompute = None
    if "full" in o:
        recompute = {"policy": "full", "num_layers": 1}
    if "moe" in o:
        recompute = {"policy": "selective", "modules": ["moe", "layernorm", "mlp_act"]}
    cfg = config(
        layout.tp,
        layout.cp,
        layout.dp,
        sp="sp" in o,
        comm="a2a" if "a2a" in o else "ring",
        mixtral="mixtral" in o,
        recompute=recompute,
        ep=2 if "ep2" in o else 1,
        qwen2="qwen2" in o,
        chunks=2 if "chunks2" in o else 1,
        expert_tp=layout.tp if "etp" in o else None,
    )
    return resolve(cfg, world)


def through_boundary(x):
    """What the next stage receives from DeepSpeed's pipeline engine: detached copies, ``requires_grad`` for the
    floating ones."""
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in x)


def set_biases(named_params) -> None:
    """Every q/k/v bias (Qwen2's) set to ``QWEN2_BIAS``, on the single-device model and on the shards alike."""
    with torch.no_grad():
        for name, p in named_params:
            if name.endswith(".bias"):
                p.fill_(QWEN2_BIAS)


def skew(named_params) -> None:
    """Hidden coordinate 0 large for every token (a constant embedding column) and every router's expert 0
    weighted on it, the last expert against it: expert 0 is everyone's first choice and the last expert gets no
    token (its gradient must be present and zero)."""
    with torch.no_grad():
        for name, p in named_params:
            if name.endswith("embed_tokens.weight"):
                p[:, 0] = 4.0
            if name.endswith("mlp.gate.weight"):
                p[0, 0] += 3.0
                p[-1, 0] -= 3.0


def reference(cfg, seed: int, windows: torch.Tensor, dp: int, skewed: bool, dtype: torch.dtype):
    """The single-device model's loss (mean over the dp micro-batches of lm + router losses), its parts, and
    gradients (of that mean)."""
    from ds_megatron.model.qwen3_moe.model import router_losses, training_loss

    ref = build_model(cfg, seed=seed).to(dtype)
    set_biases(ref.named_parameters())
    if skewed:
        skew(ref.named_parameters())
    total, parts = 0.0, torch.zeros(3)
    for chunk in windows.chunk(dp):
        logits, stats = ref(chunk[:, :-1], return_router_stats=True)
        lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        loss = training_loss(lm, stats, cfg) / dp
        loss.backward()
        total = total + loss.detach()
        aux, z = router_losses(stats)
        parts += torch.stack([lm.detach(), aux.detach(), z.detach()]) / dp
    return ref, total, parts


def parity_check(layout: Layout, world: int, _ctx: None) -> Pairs:
    from deepspeed.moe.utils import is_moe_param

    from ds_megatron.config.ep_rules import resolved_expert_tp
    from ds_megatron.data.stream import split_batch
    from ds_megatron.expert_parallel.dispatch import attach_ep_groups
    from ds_megatron.expert_parallel.layer import ExpertParallelMoE, reduce_expert_grads
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

    o = layout.options
    dtype = torch.bfloat16 if "bf16" in o else torch.float32
    tol = BF16_TOLERANCE if "bf16" in o else 1e-5
    run = layout_run(layout, world)
    topo = ParallelTopology.build(run.tp, 1, run.dp, run.cp)
    par = run.section.parallel
    expert_tp = resolved_expert_tp(par.expert_tp, par.ep, run.tp)
    attach_ep_groups(topo, par.ep, par.sequence_parallel, expert_tp)
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
        ep=topo.ep_axis,
        ep_dispatch_chunks=run.section.parallel.ep_dispatch_chunks,
        expert_tp=expert_tp,
    )
    seed = run.section.train.seed
    loss_fn = VocabParallelLoss(ctx, fused="bf16" not in o)
    specs = layer_specs(cfg, ctx, seed, loss_fn)
    tied = PipelineLayout.of(cfg).tied
    layers = nn.ModuleList(spec.build() for spec in (specs[:-1] if tied else specs)).to(dtype)
    set_biases(layers.named_parameters())
    if "skew" in o:
        skew(layers.named_parameters())
    blocks = [i for i, m in enumerate(layers) if type(m).__name__ == "BlockPipe"]

    windows = torch.randint(0, cfg.vocab_size, (run.global_batch_size, run.model.seq_length + 1))
    mine = windows.chunk(run.dp)[topo.dp_rank]
    x, labels = split_batch(mine, topo.cp_rank, topo.cp, None)
    cut = blocks[1] if "stages" in o else None  # the second stage starts at the second block
    sent = received = None
    for i, layer in enumerate(layers):
        if i == cut:
            sent, received = x, through_boundary(x)
            x = received
        x = checkpoint_segment(layer, x, None) if "full" in o and i in blocks else layer(x)
    if tied:  # the embedding again, as the output layer
        x = lm_head_forward(layers[0], x)
    loss = loss_fn(x, labels)
    loss.backward()
    if cut is not None:  # the first stage's backward, from the gradients of the floating tensors it sent
        floats = [(s, r) for s, r in zip(sent, received) if s.is_floating_point()]
        torch.autograd.backward([s for s, _ in floats], [r.grad for _, r in floats])
    pairs: Pairs = []
    if cut is not None:
        shapes = [(t.dtype, tuple(t.shape)) for t in received]
        want_router = (torch.float32, (2 * cfg.num_experts + 2,))
        on_boundary = torch.tensor(int(shapes[-1] == want_router))
        pairs.append(("router statistics on the boundary", on_boundary, torch.tensor(1)))
    size = run.dp * run.cp
    for p in layers.parameters():  # DeepSpeed's data-parallel average, over dp x cp ranks (the experts: below)
        if is_moe_param(p):
            continue
        if size > 1:
            dist.all_reduce(p.grad, group=data_group)
        p.grad /= size
    parts = (loss_fn.router_metrics[k] for k in ("lm_loss", "aux_loss", "z_loss"))
    logged = torch.stack([loss.detach().float(), *parts])
    if size > 1:
        dist.all_reduce(logged, group=data_group)
    logged /= size
    if topo.ep > 1:  # the engine's rule for experts split over EP: a sum over expert-DP, divided by dp x cp
        reduce_expert_grads(layers, topo.expert_dp_group, topo.expert_grad_divisor)
        routed = sum(
            isinstance(m, ExpertParallelMoE)
            and (m.recompute is not None) == ("moe" in o)
            and m.dispatch_chunks == (2 if "chunks2" in o else 1)
            for m in layers.modules()
        )
        stacked = sum(n.endswith("experts.down_proj") for n, _ in layers.named_parameters())
        pairs.append(
            ("every routed block expert-parallel, recomputed under moe", torch.tensor(routed), torch.tensor(stacked))
        )
    norm = global_grad_norm(list(layers.parameters()), topo)

    ref, ref_loss, ref_parts = reference(cfg, seed, windows, run.dp, "skew" in o, dtype)
    ref_grads = dict(ref.named_parameters())
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in ref.parameters()]))
    pairs += [
        ("loss", logged[0], ref_loss.float(), tol),
        ("lm loss", logged[1], ref_parts[0], tol),
        ("aux loss", logged[2], ref_parts[1], tol),
        ("z loss", logged[3], ref_parts[2], tol),
        ("grad norm", norm.reshape(()).float(), ref_norm, tol),
    ]
    if "skew" in o:  # the last expert got no token: its weights' gradient is present and zero everywhere
        empty = [
            gather_experts(p.grad, topo.ep_group)[-1].abs().sum()
            for n, p in layers.named_parameters()
            if n.endswith("experts.down_proj")
        ]
        pairs.append(("an expert without tokens", torch.stack(empty).sum(), torch.tensor(0.0)))
        low = loss_fn.router_metrics["expert_load_min"]
        pairs.append(("least loaded expert has no assignment", low, torch.tensor(0.0)))
    layout_names = PipelineLayout.of(cfg)
    seen = set()
    for name, p in layers.named_parameters():
        full = layout_names.full_name(name)
        seen.add(full)
        if is_moe_param(p):  # split over EP: this EP group's slices gathered into the single-device tensor
            got, expected = gather_experts(p.grad, topo.ep_group), ref_grads[full].grad
            if expert_tp > 1:  # and each expert over TP: this tp rank's slice of every expert
                expected = shard(expected, shard_rule(full, ctx), topo.tp_rank, topo.tp)
        else:
            got, expected = p.grad, shard(ref_grads[full].grad, shard_rule(full, ctx), topo.tp_rank, topo.tp)
        pairs.append((f"grad {full}", got.float(), expected.float(), tol))
    missing = set(ref_grads) - seen
    pairs.append(("every parameter compared", torch.tensor(len(missing)), torch.tensor(0)))
    return pairs


def gather_experts(grad: torch.Tensor, ep_group) -> torch.Tensor:
    """The stacked expert tensor's slices of every rank of ``ep_group``, in EP rank order (dim 0); ep 1: itself."""
    if ep_group is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, grad.contiguous(), group=ep_group)
    return torch.cat(parts)


def _run_rank(group, rank: int, world: int) -> dict[str, str]:
    checks = {layout.name: functools.partial(parity_check, layout, world) for layout in LAYOUTS[world]}
    return run_checks(checks, None)


@pytest.fixture(scope="module")
def reports():
    cache: dict[int, list[dict[str, str]]] = {}

    def get(world: int) -> list[dict[str, str]]:
        if world not in cache:
            cache[world] = spawn_reports(_run_rank, world)
        return cache[world]

    return get


@pytest.mark.parametrize("world, name", [(w, lay.name) for w, lays in LAYOUTS.items() for lay in lays])
def test_moe_training_matches_single_device(reports, world, name):
    message = failures(reports(world), name, name)
    assert not message, message
