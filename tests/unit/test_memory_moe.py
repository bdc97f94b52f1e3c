"""The routed families' memory, parameter and GEMM terms (``model/qwen3_moe``: ``routed_block_terms``,
``routed_block_params``, ``routed_block_gemms``): one routed block's saved tensors measured with saved-tensor hooks
at tp 1 and at tp 2 + SP (in-process gloo), with and without selective ``moe`` recompute, in fp32 and bf16, at
ep 2, and with experts split over TP (tp 2 x ep 2 over 2 dp ranks, with and without SP), against
``memory.activation_bytes_per_layer``; the parameter counts against the published model cards."""

from __future__ import annotations

import functools

import pytest

from ds_megatron.memory import activation_bytes_per_layer
from ds_megatron.model.family import RoutedShape

# A tiny routed block: h 64, 4 heads of width 32 (a d = 128, not h), 2 KV heads, 8 experts of width 48, top 2.
SHAPE = dict(s=32, b=2, h=64, a=4, kv=2, d=32, F=48, E=8, k=2)
# Qwen2-MoE's: heads of h / a, q/k/v biases, and a shared expert of width 40 beside the routed ones
QWEN2 = {"d": 16, "shared": 40}
# (family, dtype, recompute modules): every case for Qwen3-MoE and Qwen2-MoE (and its shared expert's mlp_act);
# Mixtral (no q/k norms, the same routed MLP) in bf16
CASES = [
    (family, dtype, modules)
    for family, dtypes in (("qwen3_moe", ("fp32", "bf16")), ("mixtral", ("bf16",)), ("qwen2_moe", ("fp32", "bf16")))
    for dtype in dtypes
    for modules in ((), ("moe",), ("moe", "layernorm"), *([("mlp_act",)] if family == "qwen2_moe" else []))
]


# A routed family's dense block (layer 0 in mlp_only_layers: a SwiGLU of the dense width 96), with and without the
# recompute modules that touch it; Qwen2-MoE's (heads of h / a, biases) once
DENSE_CASES = [("qwen3_moe", "fp32", ()), ("qwen3_moe", "bf16", ("mlp_act", "layernorm")), ("qwen2_moe", "bf16", ())]


def _shape(family: str) -> dict:
    return {**SHAPE, **QWEN2} if family == "qwen2_moe" else {**SHAPE, "shared": 0}


def _config(family: str, **overrides):
    """The tiny block's model config (the family's own defaults, ``norm_topk_prob`` among them, unless given)."""
    from ds_megatron.model import FAMILIES

    g = _shape(family)
    shared = {"shared_expert_intermediate_size": g["shared"]} if g["shared"] else {}
    return FAMILIES[family].config(
        vocab_size=128, hidden_size=g["h"], num_layers=1, num_heads=g["a"], num_kv_heads=g["kv"], head_dim=g["d"],
        intermediate_size=96, moe_intermediate_size=g["F"], num_experts=g["E"], num_experts_per_tok=g["k"],
        max_position_embeddings=g["s"], rope_theta=10000.0, **shared, **overrides,
    )  # fmt: skip


def _routed(family: str, config) -> RoutedShape:
    """The formula's experts' layout, read off the block's own config (its ``norm_topk_prob`` decides whether the
    router keeps the top-k weights and their sum)."""
    g = _shape(family)
    return RoutedShape(g["a"], g["kv"], g["d"], g["E"], g["k"], g["F"], config.norm_topk_prob, g["shared"])


def _saved_bytes(block, x):
    """Bytes of the distinct storages autograd saves in one forward of ``block`` (parameters excluded: the model
    states count them), and its backward run on them."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, stats = block(x)
    (y.float().sum() + (0 if stats is None else stats.probs.sum() + stats.z)).backward()
    return sum(seen.values())


def _check(family: str, dtype: str, modules: tuple, group, rank: int, world: int, dense: bool = False):
    """``dense``: the family's dense block (layer 0 in ``mlp_only_layers``)."""
    import torch

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model import FAMILIES
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    g = _shape(family)
    config = _config(family, norm_topk_prob=True, mlp_only_layers=(0,) if dense else ())
    torch_side = FAMILIES[family].torch_side()
    block = torch_side.block(config)
    torch_side.init(block, config, 1234, prefix="model.layers.0.")
    rng = build_rng(1234, rank, 0, 0)
    recompute = RecomputeSection("selective", modules=modules) if modules else RecomputeSection("none")
    tp = Group(group, rank, world) if world > 1 else Group()
    plan = ParallelContext(config, tp, world > 1, rng, recompute=recompute)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    block = parallelize_block(block, plan).to(dt).train()
    x = torch.randn(g["s"] // world, g["b"], g["h"]).to(dt).requires_grad_()
    measured = _saved_bytes(block, x)
    act = torch.finfo(dt).bits // 8
    formula = activation_bytes_per_layer(
        g["s"], g["b"], g["h"], g["a"], world, world > 1, "selective" if modules else "none", act,
        family=family, num_kv_heads=g["kv"], intermediate_size=96, attention_dropout=0.0, modules=modules,
        routed=_routed(family, config), dense_layer=dense,
    )  # fmt: skip
    # The rotary cos/sin tables [s, 1, 1, d] are shared by every block of a process: memory.rotary_table_bytes.
    rotary = 2 * g["s"] * g["d"] * act
    if world > 1 and "moe" in modules and not dense:
        # Under SP the checkpointed expert function holds the all-gathered expert choices [s b, k] int64 in its
        # closure (not a saved tensor, so the hooks miss it); the formula counts it (moe_kept_sp).
        measured += g["s"] * g["b"] * g["k"] * 8
    label = f"{family}{' dense' if dense else ''} tp {world}{' + SP' if world > 1 else ''} {dtype} {modules}"
    print(f"\n{label}: saved {measured} B, rotary {rotary} B, formula {formula:.0f} B")
    return [("saved bytes", torch.tensor(float(measured - rotary)), torch.tensor(float(formula)), 0.0)]


def _check_ep(family: str, dtype: str, modules: tuple, group, rank: int, world: int):
    """At ep = world (tp 1, no SP): each rank routes its own tokens and runs 8 / ep whole experts on what the EP
    group sends it (with ``moe`` recomputed: on the dispatched rows it keeps).  What a rank saves depends on how many
    pairs it receives; the mean over the group is the formula's uniform routing (every rank receives as many pairs
    as it sends, in all)."""
    import torch
    import torch.distributed as dist

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model import FAMILIES
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    g = _shape(family)
    config = _config(family)  # the family's own norm_topk_prob: Qwen2-MoE's top-k weights are not renormalised
    torch_side = FAMILIES[family].torch_side()
    block = torch_side.block(config)
    torch_side.init(block, config, 1234, prefix="model.layers.0.")
    recompute = RecomputeSection("selective", modules=modules) if modules else RecomputeSection("none")
    ep = Group(group, rank, world)
    plan = ParallelContext(config, Group(), False, build_rng(1234, rank, 0, 0), recompute=recompute, ep=ep)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    block = parallelize_block(block, plan).to(dt).train()
    x = torch.randn(g["s"], g["b"], g["h"]).to(dt)
    x = (x + rank).requires_grad_()  # each rank its own tokens
    measured = torch.tensor(float(_saved_bytes(block, x)), dtype=torch.float64)
    dist.all_reduce(measured, group=group)
    act = torch.finfo(dt).bits // 8
    formula = activation_bytes_per_layer(
        g["s"], g["b"], g["h"], g["a"], 1, False, "selective" if modules else "none", act, family=family,
        num_kv_heads=g["kv"], intermediate_size=96, attention_dropout=0.0, modules=modules,
        routed=_routed(family, config), ep=world,
    )  # fmt: skip
    rotary = 2 * g["s"] * g["d"] * act
    label = f"{family} ep {world} {dtype} {modules}"
    print(f"\n{label}: saved {measured.item() / world:.0f} B (mean), formula {formula:.0f} B")
    return [("saved bytes", measured / world - rotary, torch.tensor(float(formula), dtype=torch.float64), 0.0)]


# With ``moe`` at ep > 1 the local experts are checkpointed on their dispatched rows; with ``layernorm`` too, the
# norms as without the experts' checkpoint.
EP_CASES = list(CASES)


def _run_rank(group, rank: int, world: int) -> dict[str, str]:
    from inprocess import run_checks

    checks = {
        f"{family}-{dtype}-{'+'.join(modules) or 'none'}": functools.partial(
            lambda f, d, m, _: _check(f, d, m, group, rank, world), family, dtype, modules
        )
        for family, dtype, modules in CASES
    }
    checks.update(
        {
            f"{family}-{dtype}-{'+'.join(modules) or 'none'}-dense": functools.partial(
                lambda f, d, m, _: _check(f, d, m, group, rank, world, dense=True), family, dtype, modules
            )
            for family, dtype, modules in DENSE_CASES
        }
    )
    if world > 1:  # the same launch measures the expert-parallel layer at ep = world
        checks.update(
            {
                f"{family}-{dtype}-{'+'.join(modules) or 'none'}-ep": functools.partial(
                    lambda f, d, m, _: _check_ep(f, d, m, group, rank, world), family, dtype, modules
                )
                for family, dtype, modules in EP_CASES
            }
        )
    return run_checks(checks, None)


@pytest.fixture(scope="module")
def reports():
    from inprocess import spawn_reports

    return {world: spawn_reports(_run_rank, world) for world in (1, 2)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family,dtype,modules", CASES)
def test_one_routed_block_stores_what_the_formula_counts(reports, world, family, dtype, modules):
    """Every byte autograd saves in a routed block (parameters and the shared rotary tables aside) is a counted
    term, at tp 1 and at tp 2 + SP (each rank routes its sequence shard, the experts run on the all-gathered tokens),
    without recompute, with ``moe`` (the experts' activations for their gathered inputs) and with ``layernorm``."""
    from inprocess import failures

    name = f"{family}-{dtype}-{'+'.join(modules) or 'none'}"
    message = failures(reports[world], name, f"{name} tp {world}")
    assert not message, message


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family,dtype,modules", DENSE_CASES)
def test_a_dense_block_of_a_routed_family_stores_what_the_formula_counts(reports, world, family, dtype, modules):
    """A layer of ``mlp_only_layers`` (a SwiGLU of the dense width) stores the routed block's attention terms and
    Llama's MLP terms (``memory.activation_bytes_per_layer(..., dense_layer=True)``), at tp 1 and tp 2 + SP."""
    from inprocess import failures

    name = f"{family}-{dtype}-{'+'.join(modules) or 'none'}-dense"
    message = failures(reports[world], name, f"{name} tp {world}")
    assert not message, message


@pytest.mark.parametrize("family,dtype,modules", EP_CASES)
def test_an_expert_parallel_block_stores_what_the_formula_counts(reports, family, dtype, modules):
    """At ep 2 (tp 1): every byte autograd saves in the expert-parallel routed block, averaged over the EP group,
    is the formula's at ``ep`` 2: the experts' tensors for the rank's own tokens and the dispatch's permutations;
    with ``moe``, the local experts' dispatched rows in place of their activations."""
    from inprocess import failures

    name = f"{family}-{dtype}-{'+'.join(modules) or 'none'}-ep"
    message = failures(reports[2], name, f"{name} 2")
    assert not message, message


# Expert tensor parallelism (expert_tp = tp 2) at ep 2 over the 2 dp ranks of a world of 4 (rank = dp_rank * 2 +
# tp_rank): (dtype, sequence parallel, recompute modules)
ETP_CASES = [
    ("fp32", True, ()),
    ("bf16", True, ()),
    ("fp32", False, ()),
    ("bf16", False, ()),
    ("fp32", True, ("moe",)),
]


def _check_etp(dtype: str, sp: bool, modules: tuple, groups, rank: int):
    """At tp 2 x ep 2 with each expert's width split over the tp ranks: every rank routes its own tokens (its
    sequence shard under SP, the tp ranks' same tokens without), the tokens enter the experts gathered over TP as the
    dense MLP's, and the EP group (the two dp ranks of one tp index) exchanges the pairs every tp rank runs.  What a
    rank saves depends on the pairs it receives; the mean over the world is the formula's uniform routing."""
    import torch
    import torch.distributed as dist

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model import FAMILIES
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    world_group, tp_group, ep_group = groups
    tp_rank, dp_rank = rank % 2, rank // 2
    family, g = "qwen3_moe", _shape("qwen3_moe")
    config = _config(family)
    torch_side = FAMILIES[family].torch_side()
    block = torch_side.block(config)
    torch_side.init(block, config, 1234, prefix="model.layers.0.")
    recompute = RecomputeSection("selective", modules=modules) if modules else RecomputeSection("none")
    tp, ep = Group(tp_group, tp_rank, 2), Group(ep_group, dp_rank, 2)
    rng = build_rng(1234, tp_rank, 0, dp_rank)
    plan = ParallelContext(config, tp, sp, rng, recompute=recompute, ep=ep, expert_tp=2)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    block = parallelize_block(block, plan).to(dt).train()
    x = torch.randn(g["s"], g["b"], g["h"]) + dp_rank  # each dp rank its own tokens, the tp ranks' the same
    if sp:
        x = x.chunk(2)[tp_rank].clone()  # this tp rank's sequence shard, a storage of its own (as in a run)
    measured = torch.tensor(float(_saved_bytes(block, x.to(dt).requires_grad_())), dtype=torch.float64)
    dist.all_reduce(measured, group=world_group)
    act = torch.finfo(dt).bits // 8
    formula = activation_bytes_per_layer(
        g["s"], g["b"], g["h"], g["a"], 2, sp, "selective" if modules else "none", act, family=family,
        num_kv_heads=g["kv"], intermediate_size=96, attention_dropout=0.0, modules=modules,
        routed=_routed(family, config), ep=2, expert_tp=2,
    )  # fmt: skip
    rotary = 2 * g["s"] * g["d"] * act
    label = f"{family} tp 2{' + SP' if sp else ''} x ep 2, expert_tp 2, {dtype} {modules}"
    print(f"\n{label}: saved {measured.item() / 4:.0f} B (mean), formula {formula:.0f} B")
    return [("saved bytes", measured / 4 - rotary, torch.tensor(float(formula), dtype=torch.float64), 0.0)]


def _etp_name(dtype: str, sp: bool, modules: tuple) -> str:
    return f"{dtype}-{'sp' if sp else 'nosp'}-{'+'.join(modules) or 'none'}-etp"


def _run_etp_rank(group, rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist
    from inprocess import run_checks

    # every rank creates every group, in the same order: tp groups {0, 1}, {2, 3}; EP groups {0, 2}, {1, 3}
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (group, tp_groups[rank // 2], ep_groups[rank % 2])
    checks = {
        _etp_name(dtype, sp, modules): functools.partial(
            lambda d, p, m, _: _check_etp(d, p, m, groups, rank), dtype, sp, modules
        )
        for dtype, sp, modules in ETP_CASES
    }
    return run_checks(checks, None)


@pytest.fixture(scope="module")
def etp_reports():
    from inprocess import spawn_reports

    return spawn_reports(_run_etp_rank, 4)


@pytest.mark.parametrize("dtype,sp,modules", ETP_CASES)
def test_experts_split_over_tp_store_what_the_formula_counts(etp_reports, dtype, sp, modules):
    """At tp 2 x ep 2 with ``expert_tp`` 2, with and without SP: every byte autograd saves in the routed block,
    averaged over the four ranks, is the formula's at ``expert_tp`` = t: the experts' tensors and the dispatch's
    permutations for the s b tokens every tp rank runs (gathered under SP), their intermediates F / t wide; with
    ``moe``, the local experts' dispatched rows in place of their activations."""
    from inprocess import failures

    name = _etp_name(dtype, sp, modules)
    message = failures(etp_reports, name, name)
    assert not message, message
