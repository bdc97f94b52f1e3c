"""Expert parallelism, in-process on CPU (gloo): the EP layer at ep 2 and 4 (and ep 1 here) against the single-device
``SparseMoeBlock`` on the union of every rank's tokens: outputs, the input gradients, the router gradient (averaged
over the data ranks, as DeepSpeed averages non-expert gradients) and every expert's gradients (summed over the
expert-DP group and divided by dp x cp, then gathered over the EP group), in fp32 within 1e-5 and in bf16 within
BF16_TOLERANCE; the load-balancing and z losses from the statistics summed over the ranks.  Ranks hold uneven token
counts, and a skewed router sends most pairs to expert 0 and none to the last two experts (at ep 4 one rank then
receives no row at all).  The group layout (stdlib) is checked against DeepSpeed's process topology, and the
refusals are one line.

One spawn of 4 gloo processes runs every check at ep 4 (one EP group) and at ep 2 (two EP groups, expert-DP 2).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from inprocess import Pairs, failures, run_checks, spawn_reports
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.config import ConfigError
from ds_megatron.expert_parallel.dispatch import build_ep_groups, exchange_counts
from ds_megatron.expert_parallel.layer import ExpertParallelMoE, reduce_expert_grads
from ds_megatron.expert_parallel.layout import check_num_experts, ep_layout, valid_ep_values
from ds_megatron.model.moe_layer import RouterStats, SparseMoeBlock, load_balancing_loss, router_z_loss
from ds_megatron.topology import Group

E, K, H, FFN = 8, 2, 16, 16  # rows of 16 bf16 values: 32 bytes, so torch._grouped_mm takes them
TOKENS = (5, 11, 3, 7)  # per rank: uneven
# bf16 results are compared as fractions of the reference's largest magnitude.  Measured at ep 2 and 4: outputs,
# input gradients and losses equal; gradients within 5.1e-3 (router), 4.5e-3 (gate_up_proj), 2.7e-3 (down_proj):
# partial sums rounded to bf16 on each rank before the sum over ranks, where one device rounds once.
BF16_TOLERANCE = 1e-2
WORLD = 4


class Ctx(NamedTuple):
    group: ProcessGroup | None  # every rank (the data ranks here: tp 1, cp 1, dp 4)
    rank: int
    world: int


def reference_block(dtype: torch.dtype, capacity: float = 0.0) -> SparseMoeBlock:
    """The single-device layer, its router skewed: hidden coordinate 0 is 3 for every token (see ``tokens``), expert
    0 weighted on it and the last two experts against it, so most first choices are expert 0 and no token picks
    experts 6 and 7 (and at ``capacity`` 0.5, expert 0 drops pairs on every rank: ceil(n / 8) each)."""
    block = SparseMoeBlock(H, FFN, E, K, norm_topk_prob=True, capacity_factor=capacity)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
        block.gate.weight[:, 0] = 0.0
        block.gate.weight[0, 0] = 2.0
        block.gate.weight[-2:, 0] = -50.0
        block.experts.gate_up_proj.normal_(0, 0.3)
        block.experts.down_proj.normal_(0, 0.3)
    return block.to(dtype)


def tokens(n: int, dtype: torch.dtype) -> Tensor:
    x = torch.randn(n, H)
    x[:, 0] = 3.0
    return x.to(dtype)


def gathered(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Every EP rank's slice of an expert tensor, concatenated along the expert dim (no autograd)."""
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def summed(stats: RouterStats, group: ProcessGroup | None) -> RouterStats:
    if group is None:
        return stats
    parts = [s.detach().clone() for s in stats]
    for part in parts:
        dist.all_reduce(part, group=group)
    return RouterStats(*parts)


def scaled(what: str, actual: Tensor | None, expected: Tensor, tol: float) -> tuple[str, Tensor | None, Tensor, float]:
    """``actual`` and ``expected`` in fp32 as fractions of the reference's largest magnitude."""
    scale = expected.detach().float().abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    return what, None if actual is None else actual.detach().float() / scale, expected.detach().float() / scale, tol


class Dims(NamedTuple):
    """A stage's layout: the ranks the EP groups fold over."""

    tp: int
    cp: int
    dp: int
    sp: bool


# Every layout runs on the pool's 4 ranks: dp 4 (EP over the data ranks); tp 2 with SP x dp 2 (EP folded over the tp
# ranks, which then share one loss per replica); cp 2 x dp 2
DIMS = {"dp4": Dims(1, 1, 4, False), "tp2sp-dp2": Dims(2, 1, 2, True), "cp2-dp2": Dims(1, 2, 2, False)}


def check_parity(
    c: Ctx, dims: Dims, ep: int, dtype: torch.dtype, tol: float, gemm: str = "grouped", capacity: float = 0.0
) -> Pairs:
    """The layer on this rank's tokens against the block on every rank's (with a ``capacity`` factor, on each rank's
    tokens apart: a rank's tokens are the group whose pairs the capacity counts). The objective is the mean over the
    data replicas (dp x cp of them) of each replica's loss, the sum of out * gout over its tokens (under SP its tp
    ranks hold disjoint shares of them); DeepSpeed averages each rank's gradients over dp x cp, the SP rule sums the
    router's over tp, and the expert-DP rule reduces the experts'."""
    layout = ep_layout(dims.tp, dims.cp, dims.dp, pp=1, ep=ep, sequence_parallel=dims.sp, num_experts=E)
    ep_group, expert_dp_group = build_ep_groups(layout, c.rank)
    replicas = dims.dp * dims.cp
    block = reference_block(dtype, capacity)
    block.experts.gemm = gemm
    counts = TOKENS[: c.world]
    xs = [tokens(n, dtype) for n in counts]
    gouts = [torch.randn(n, H).to(dtype) for n in counts]
    start = sum(counts[: c.rank])
    mine = slice(start, start + counts[c.rank])

    # the reference: one device, every rank's tokens
    ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
    layer = ExpertParallelMoE.from_block(block, Group(ep_group, ep_rank, ep))
    x_all = torch.cat(xs).requires_grad_()
    if capacity:
        outs, per_rank = zip(*(block(part) for part in x_all.split(counts)), strict=True)
        out_all, stats_all = torch.cat(outs), sum(per_rank[1:], per_rank[0])
    else:
        out_all, stats_all = block(x_all)
    ((out_all * torch.cat(gouts)).float().sum() / replicas).backward()

    # this rank: its own tokens and share of the loss; then the gradient rules
    x = xs[c.rank].clone().requires_grad_()
    out, stats = layer(x)
    (out * gouts[c.rank]).float().sum().backward()
    router_grad = layer.gate.weight.grad.clone()
    if c.group is not None:  # summed over tp (SP) and over the data replicas, then their mean
        dist.all_reduce(router_grad, group=c.group)
    router_grad /= replicas
    reduce_expert_grads(layer, expert_dp_group, layout.expert_grad_divisor)
    total = summed(stats, c.group)
    local = layer.local_experts()
    received = exchange_counts(torch.bincount(layer.gate(x)[1].reshape(-1), minlength=E + 1)[:E], ep_group).sum()
    compared = [
        ("output", out, out_all[mine], tol),
        ("input grad (of the replica mean)", x.grad / replicas, x_all.grad[mine], tol),
        ("router grad", router_grad, block.gate.weight.grad, tol),
        *(
            (
                f"{name} grad",
                gathered(getattr(layer.experts, name).grad, ep_group),
                getattr(block.experts, name).grad,
                tol,
            )
            for name in ("gate_up_proj", "down_proj")
        ),
        ("aux loss over the summed stats", load_balancing_loss(total), load_balancing_loss(stats_all), tol),
        ("z loss over the summed stats", router_z_loss(total), router_z_loss(stats_all), tol),
    ]
    if dtype != torch.float32:
        compared = [scaled(*pair) for pair in compared]
    last_rank = ep == 4 and c.rank == 3
    return [
        *compared,
        ("weights held: the block's slice", layer.experts.down_proj, block.experts.down_proj[local], 0.0),
        # the cases the test is for do occur: experts 6 and 7 get no token (zero and present gradients), and at
        # ep 4 the last rank receives no row at all
        ("no token for experts 6, 7", stats_all.counts[-2:], torch.zeros(2)),
        ("expert 0 gets the most", stats_all.counts.argmax(), torch.tensor(0)),
        *([("ep 4: rank 3 receives no row", received, torch.tensor(0))] if last_rank else []),
        *([("pairs dropped here", dropped(layer, x) > 0, torch.tensor(True))] if capacity else []),
    ]


def dropped(layer: ExpertParallelMoE, x: Tensor) -> Tensor:
    """Pairs the layer's router drops from ``x`` (expert id E)."""
    return (layer.gate(x)[1] == E).sum()


class _CountedAllToAll:
    """``torch.distributed.all_to_all_single`` counted while in use (the count exchange and both row exchanges)."""

    def __init__(self):
        self.calls, self.real = 0, dist.all_to_all_single

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)

    def __enter__(self):
        dist.all_to_all_single = self
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.real


def check_recompute(c: Ctx, ep: int) -> Pairs:
    """Selective recompute of ``moe`` in the EP layer (dp 4): the same output and every gradient bit for bit as the
    stored layer's; fewer saved bytes per token, by at least what the local experts' intermediates take (SwiGLU's
    gate, up and output: 3 F numbers per received row); and the all-to-all run as often (the counts and the rows
    forward, the rows' gradients backward: never again for the recompute)."""
    from ds_megatron.recompute import checkpoint

    layout = ep_layout(1, 1, c.world, pp=1, ep=ep, sequence_parallel=False, num_experts=E)
    ep_group, expert_dp_group = build_ep_groups(layout, c.rank)
    group = Group(ep_group, dist.get_rank(ep_group), ep)
    block = reference_block(torch.float32)
    x = tokens(TOKENS[c.rank], torch.float32)
    gout = torch.randn_like(x)

    def run(recompute):
        layer = ExpertParallelMoE.from_block(block, group, recompute)
        inp = x.clone().requires_grad_()
        saved = []
        pack = lambda t: saved.append(t.numel() * t.element_size()) or t  # noqa: E731
        with _CountedAllToAll() as counted:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out, _ = layer(inp)
            (out * gout).sum().backward()
        reduce_expert_grads(layer, expert_dp_group, layout.expert_grad_divisor)
        grads = [inp.grad, *(p.grad for p in layer.parameters())]
        return out, grads, sum(saved) / x.shape[0], counted.calls

    out, grads, stored, calls = run(None)
    out_again, grads_again, kept, calls_again = run(partial(checkpoint, rng=None))
    received = int(exchange_counts(torch.bincount(block.gate(x)[1].reshape(-1), minlength=E), ep_group).sum())
    intermediates = 3 * FFN * received * 4 / x.shape[0]  # bytes per token of this rank's
    fewer = f"saved bytes per token {kept:.0f} <= {stored:.0f} - {intermediates:.0f}"
    return [
        ("output", out_again, out, 0.0),
        *((f"grad {i}", again, grad, 0.0) for i, (again, grad) in enumerate(zip(grads_again, grads, strict=True))),
        ("rows received", torch.tensor(received > 0), torch.tensor(True)),
        (fewer, torch.tensor(kept <= stored - intermediates), torch.tensor(True)),
        ("all-to-alls with recompute", torch.tensor(calls_again), torch.tensor(calls)),
        ("all-to-alls: counts, rows, outputs; 2 gradients", torch.tensor(calls), torch.tensor(5)),
    ]


def check_refusals(c: Ctx) -> Pairs:
    """Six experts cannot split over 4 EP ranks: refused in one line (before any collective)."""
    group = dist.new_group(list(range(c.world)))
    with pytest.raises(ConfigError, match=r"num_experts=6, ep=4\).*use ep in \[1, 2, 3, 6\]"):
        ExpertParallelMoE(H, FFN, 6, K, True, Group(group, c.rank, c.world))
    return [("refused", torch.tensor(1), torch.tensor(1))]


def checks(world: int) -> dict[str, Callable[[Ctx], Pairs]]:
    fp32 = dict(dtype=torch.float32, tol=1e-5)
    bf16 = dict(dtype=torch.bfloat16, tol=BF16_TOLERANCE)
    if world == 1:
        one = Dims(1, 1, 1, False)
        return {"ep1/fp32": partial(check_parity, dims=one, ep=1, **fp32)}
    found: dict[str, Callable[[Ctx], Pairs]] = {}
    for ep in (4, 2):
        found[f"dp4/ep{ep}/fp32"] = partial(check_parity, dims=DIMS["dp4"], ep=ep, **fp32)
        found[f"dp4/ep{ep}/bf16"] = partial(check_parity, dims=DIMS["dp4"], ep=ep, **bf16)
        found[f"tp2sp-dp2/ep{ep}/fp32"] = partial(check_parity, dims=DIMS["tp2sp-dp2"], ep=ep, **fp32)
    found["cp2-dp2/ep2/fp32"] = partial(check_parity, dims=DIMS["cp2-dp2"], ep=2, **fp32)
    found["dp4/ep2/fp32-loop"] = partial(check_parity, dims=DIMS["dp4"], ep=2, gemm="loop", **fp32)
    found["dp4/ep2/fp32-capacity"] = partial(check_parity, dims=DIMS["dp4"], ep=2, capacity=0.5, **fp32)
    found["tp2sp-dp2/ep4/fp32-capacity"] = partial(check_parity, dims=DIMS["tp2sp-dp2"], ep=4, capacity=0.5, **fp32)
    found["dp4/ep2/fp32-recompute"] = partial(check_recompute, ep=2)
    found["refusals"] = check_refusals
    return found


def _run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    return run_checks(checks(world), Ctx(group, rank, world))


@pytest.fixture(scope="module")
def reports() -> Callable[[int], list[dict[str, str]]]:
    cache: dict[int, list[dict[str, str]]] = {}

    def get(world: int) -> list[dict[str, str]]:
        if world not in cache:
            cache[world] = spawn_reports(_run_rank, world)
        return cache[world]

    return get


@pytest.mark.parametrize("world, name", [pytest.param(w, n, id=f"world{w}-{n}") for w in (1, WORLD) for n in checks(w)])
def test_expert_parallel_matches_single_device(reports: Callable[[int], list[dict[str, str]]], world: int, name: str):
    message = failures(reports(world), name, f"world={world}")
    assert not message, message


# ---- the layout ----

# (tp, cp, dp, pp, ep, sequence_parallel) -> (EP groups, expert-DP groups): the layouts the parity tests of a whole
# model will run, written out here so that a layout bug in the library cannot cancel out
WRITTEN = {
    (2, 1, 1, 1, 2, True): ([(0, 1)], [(0,), (1,)]),  # folded over tp
    (1, 2, 1, 1, 2, False): ([(0, 1)], [(0,), (1,)]),  # over cp
    (1, 1, 2, 2, 2, False): ([(0, 1), (2, 3)], [(0,), (1,), (2,), (3,)]),  # one EP group per stage
    (2, 1, 2, 1, 4, True): ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),  # over tp and dp
    (2, 1, 2, 1, 2, True): ([(0, 1), (2, 3)], [(0, 2), (1, 3)]),  # over tp; expert-DP over dp
    (1, 1, 4, 1, 2, False): ([(0, 1), (2, 3)], [(0, 2), (1, 3)]),
    (2, 2, 1, 1, 1, False): ([(0,), (2,), (1,), (3,)], [(0, 2), (1, 3)]),  # ep 1 without SP: data axis per tp rank
    (2, 2, 1, 1, 1, True): ([(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)]),  # ep 1 with SP: every token rank
}


# expert_tp = tp: (tp, cp, dp, pp, ep, sequence_parallel) -> the same; one line of cp x dp ranks per tp index, with
# or without SP
WRITTEN_EXPERT_TP = {
    (2, 1, 2, 1, 2, True): ([(0, 2), (1, 3)], [(0,), (2,), (1,), (3,)]),
    (2, 1, 2, 1, 2, False): ([(0, 2), (1, 3)], [(0,), (2,), (1,), (3,)]),
    (2, 2, 2, 1, 2, True): ([(0, 2), (4, 6), (1, 3), (5, 7)], [(0, 4), (2, 6), (1, 5), (3, 7)]),
    (2, 1, 4, 2, 4, False): ([(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)], None),
}


def test_layouts_written_out():
    for expert_tp, written in ((1, WRITTEN), (2, WRITTEN_EXPERT_TP)):
        for (tp, cp, dp, pp, ep, sp), (ep_groups, dp_groups) in written.items():
            layout = ep_layout(tp, cp, dp, pp, ep, sp, expert_tp=expert_tp)
            assert list(layout.ep_groups) == ep_groups, (tp, cp, dp, pp, ep, expert_tp)
            if dp_groups is not None:
                assert list(layout.expert_dp_groups) == dp_groups, (tp, cp, dp, pp, ep, expert_tp)
            assert layout.expert_grad_divisor == dp * cp


def test_layout_against_deepspeeds_topology():
    """For every small world: each EP group lies in one pipeline stage, on ranks holding distinct tokens (distinct
    (dp, cp) and, under SP, tp coordinates; the same tp coordinate without SP), of consecutive token ranks; the EP
    groups tile the world, and so do the expert-DP groups; EP x expert-DP covers a stage's token ranks once."""
    for tp, cp, dp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2)):
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)  # as ds_megatron.topology
        world = tp * cp * dp * pp
        for sp, expert_tp in itertools.product((False, True), sorted({1, tp})):
            folded = (sp or tp == 1) and expert_tp == 1  # the tp ranks hold distinct tokens in the MoE layer
            for ep in valid_ep_values(tp, cp, dp, sp, expert_tp=expert_tp):
                layout = ep_layout(tp, cp, dp, pp, ep, sp, expert_tp=expert_tp)
                for groups in (layout.ep_groups, layout.expert_dp_groups):
                    assert sorted(r for g in groups for r in g) == list(range(world))
                for g in layout.ep_groups:
                    coords = [topo.get_coord(r) for r in g]
                    assert len(g) == ep and len({c.pipe for c in coords}) == 1
                    tokens_of = [(c.data, c.model) if folded else c.data for c in coords]
                    assert len(set(tokens_of)) == ep  # distinct tokens
                    if not folded:
                        assert len({c.model for c in coords}) == 1
                    step = 1 if folded else tp
                    assert list(g) == list(range(g[0], g[0] + step * ep, step))  # consecutive token ranks
                for r in range(world):
                    ep_g, dp_g = layout.ep_group_of(r), layout.expert_dp_group_of(r)
                    assert set(ep_g) & set(dp_g) == {r}
                    assert len(ep_g) * len(dp_g) == (tp * cp * dp if folded else cp * dp)
                    # the expert-DP ranks hold the same experts: the same position in their EP groups
                    assert {layout.ep_group_of(q).index(q) for q in dp_g} == {ep_g.index(r)}


def _refused(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    message = str(err.value)
    assert message.startswith("error: ds_megatron.parallel.ep: ") and "\n" not in message
    return message


def test_layouts_the_folding_cannot_form_are_refused():
    message = _refused(ep_layout, 2, 1, 2, 1, 4, False)
    assert "sequence_parallel=false" in message and "turn on sequence_parallel" in message and "[1]" in message
    assert "expert_tp" not in message  # ep 4 does not divide cp x dp either
    assert "turn on sequence_parallel, set expert_tp to 2, or use ep in [1]" in _refused(
        ep_layout, 2, 1, 2, 1, 2, False
    )
    # expert_tp = tp: ep divides cp x dp (2 here), with or without SP
    for sp in (False, True):
        message = _refused(ep_layout, 2, 1, 2, 1, 4, sp, None, 2)
        assert "expert_tp=2" in message and "ep must divide cp x dp" in message and "use ep in [1, 2]" in message
    message = _refused(ep_layout, 2, 1, 2, 1, 3, True)
    assert "ep=3, tp=2, cp=1, dp=2" in message and "use ep in [1, 2, 4]" in message
    message = _refused(ep_layout, 1, 2, 2, 1, 4, False, 6)
    assert "num_experts=6" in message and "use ep in [1, 2]" in message
    assert "use ep in [1, 2, 3, 6]" in _refused(check_num_experts, 6, 4)
    check_num_experts(8, 4)


def test_expert_params_carry_deepspeeds_marks():
    """Experts are DeepSpeed MoE parameters of group ``ep_size_<ep>`` (its engine and optimizers key on them); the
    router is not; a layer run on no token still gives every expert parameter a (zero) gradient to reduce."""
    layer = ExpertParallelMoE.from_block(reference_block(torch.float32), Group())
    marked = {name: is_moe_param(p) for name, p in layer.named_parameters()}
    assert marked == {"gate.weight": False, "experts.gate_up_proj": True, "experts.down_proj": True}
    assert {p.group_name for p in layer.experts.parameters()} == {"ep_size_1"}
    reduce_expert_grads(layer, None, 2)
    assert all(p.grad is not None and not p.grad.any() for p in layer.experts.parameters())


def _ep_config(ep: int, model: dict | None = None, ds: dict | None = None, **parallel) -> dict:
    model = model or {"size": "moe-tiny", "vocab_size": 64, "seq_length": 16}
    section = {"model": model, "parallel": {"ep": ep, **parallel}}
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, **(ds or {}), "ds_megatron": section}


def test_the_ep_setting_and_its_refusals():
    """``ds_megatron.parallel.ep`` / ``--ep``: the layouts the folding forms resolve; every other use is refused in
    one line naming the setting, before any process group exists."""
    from ds_megatron.cli.train import apply_overrides, build_parser
    from ds_megatron.config import resolve

    assert resolve(_ep_config(2), 2).section.parallel.ep == 2  # dp 2
    assert resolve(_ep_config(2, tp=2, sequence_parallel=True), 2).section.parallel.ep == 2  # folded over tp
    assert resolve(_ep_config(4, tp=2, sequence_parallel=True), 4).section.parallel.ep == 4  # tp 2 x dp 2
    # expert_tp = tp: EP over the dp ranks of one tp index, with or without SP
    for sp in (False, True):
        assert resolve(_ep_config(2, tp=2, expert_tp=2, sequence_parallel=sp), 4).section.parallel.expert_tp == 2
    # DeepSpeed's BF16 optimizer: bf16 at ZeRO 0, and at ZeRO 1 with fp32 gradient accumulation; its ZeRO optimizer:
    # fp32 at ZeRO 1, bf16 at ZeRO 1 accumulating in bf16
    bf16_z1 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
    zero1 = {"zero_optimization": {"stage": 1}}
    for ds in ({"bf16": {"enabled": True}}, bf16_z1, zero1, {"bf16": {"enabled": True}, **zero1}):
        assert resolve(_ep_config(2, ds=ds), 2).section.parallel.ep == 2
    dense = {"family": "gpt2", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 64, "seq_length": 16}
    cases = [
        (_ep_config(2, dense), 2, "this model has none"),
        (_ep_config(2, tp=2), 2, "turn on sequence_parallel, or use ep in [1]"),
        (_ep_config(2, tp=2), 4, "turn on sequence_parallel, set expert_tp to 2, or use ep in [1]"),
        (_ep_config(2, tp=2, expert_tp=2), 2, "expert_tp=2, num_experts=8); use ep in [1]"),
        # ep 3 splits neither the 8 experts nor, with them, dp 3: the values that do both (not ep 2 at dp 3)
        (_ep_config(3), 3, "dp=3, sequence_parallel=false, num_experts=8); use ep in [1]"),
        (_ep_config(4), 2, "use ep in [1, 2]"),
        (_ep_config(0), 2, "ds_megatron.parallel.ep"),
        (_ep_config(2, ds={"fp16": {"enabled": True}}), 2, "leaves expert gradients out of the norm"),
        (_ep_config(2, ds={"fp16": {"enabled": True}, **zero1}), 2, "wrapper ZeRO (precision fp16, zero_optimization"),
    ]
    for cfg, world, message in cases:
        with pytest.raises(ConfigError) as err:
            resolve(cfg, world)
        text = str(err.value)
        assert text.startswith("error: ds_megatron.parallel.ep: ") and "\n" not in text and message in text, text
    # and not its options without expert handling
    for zero, setting in (
        ({"stage": 1, "reduce_scatter": False}, "zero_optimization.reduce_scatter"),
        ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.offload_optimizer"),
        ({"stage": 1, "elastic_checkpoint": True}, "zero_optimization.elastic_checkpoint"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve(_ep_config(2, ds={"zero_optimization": zero}), 2)
        assert str(err.value).startswith(f"error: {setting}: DeepSpeed's ZeRO optimizer"), str(err.value)
        assert resolve(_ep_config(1, ds={"zero_optimization": zero}), 2).section.parallel.ep == 1
    cfg = _ep_config(2)
    cfg["ds_megatron"]["recompute"] = {"policy": "selective", "modules": ["moe"]}
    assert resolve(cfg, 2).section.recompute.modules == ("moe",)  # refused before the EP layer recomputed
    # checkpoints are written and read at ep > 1 on fp32 at ZeRO 0, DeepSpeed's BF16 optimizer and its ZeRO
    # optimizer (their flat partitions written as the ep 1 run's, checkpoint/ep_state.py)
    for ds in ({}, {"bf16": {"enabled": True}}, bf16_z1, zero1, {"bf16": {"enabled": True}, **zero1}):
        for checkpoint in ({"save": "ckpt"}, {"load": "ckpt"}, {"init_from_hf": "hf"}):
            cfg = _ep_config(2, ds=ds)
            cfg["ds_megatron"]["checkpoint"] = checkpoint
            ckpt = resolve(cfg, 2).section.checkpoint
            assert {k: getattr(ckpt, k) for k in checkpoint} == checkpoint
    for ep, tp, expert_tp, world, valid in ((2, 2, 3, 4, "[1, 2]"), (1, 2, 1, 2, "[2]"), (2, 1, 2, 2, "[1]")):
        cfg = _ep_config(ep, tp=tp, expert_tp=expert_tp, sequence_parallel=tp > 1)
        with pytest.raises(ConfigError) as err:
            resolve(cfg, world)
        text = str(err.value)
        assert text.startswith("error: ds_megatron.parallel.expert_tp: ") and "\n" not in text, text
        assert f"expert_tp={expert_tp}, ep={ep}, tp={tp}); use expert_tp in {valid}" in text, text
    args = build_parser().parse_args(["--deepspeed_config", "x.json", "--ep", "2", "--expert-tp", "2"])
    assert apply_overrides({"ds_megatron": {}}, args)["ds_megatron"]["parallel"] == {"ep": 2, "expert_tp": 2}
