"""Unit tier of the tensor-parallel layers: in-process, CPU (gloo), no DeepSpeed launcher.

Each TP/SP layer, the vocab-parallel cross entropy and each autograd mapping is compared, forward and backward,
with its unsharded single-process reference (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``F.cross_entropy``)
at tp 1, 2 and 4, with sequence parallelism off and on.  The launcher suites check whole models and take minutes;
this tier takes seconds and names the one layer or collective that broke.  One gloo group is spawned per tp > 1 (tp 1
runs in the test process) and runs every check; each rank reports per check, and each (tp, check) is its own test.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from inprocess import Pairs, failures, run_checks, spawn_reports
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import ds_megatron.tensor_parallel as tpl
from ds_megatron.parallelize import ParallelContext
from ds_megatron.topology import Group

S, B, H, FFN = 8, 2, 16, 32  # s divisible by every tp below, so each SP shard has s/t rows
WORLD_SIZES = (1, 2, 4)
# 1001 does not fill the padded table; with 513 at tp 4 the last rank's block is padding only.
VOCABS = (1001, 513)


class Ctx(NamedTuple):
    group: ProcessGroup | None  # None for a group of one, as the topology builds it
    rank: int
    t: int


def part(x: Tensor, dim: int, c: Ctx, fused: int = 1) -> Tensor:
    """This rank's contiguous block of ``x`` along ``dim`` (in each of ``fused`` equal blocks).  Written here
    rather than taken from ``shard`` so that a slicing bug in the library cannot cancel out in the comparison."""
    return torch.cat([blk.chunk(c.t, dim)[c.rank] for blk in x.chunk(fused, dim)], dim)


def seq_part(x: Tensor, c: Ctx, sp: bool) -> Tensor:
    """Under SP an activation [s, b, h] lives as this rank's sequence chunk; otherwise it is replicated."""
    return part(x, 0, c) if sp else x


def leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_()


def run(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> Tensor:
    """Forward ``fn(x)`` and backward ``grad`` through it; returns the output."""
    out = fn(x)
    out.backward(grad)
    return out


def ce(logits: Tensor, target: Tensor) -> Tensor:
    """The reference per-token loss [s, b] from unpadded logits [s, b, V]."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


def tp_group(c: Ctx) -> Group:
    return Group(c.group, c.rank, c.t)


def padded(vocab: int, c: Ctx) -> int:
    return tpl.padded_vocab_size(vocab, c.t, ParallelContext.vocab_multiple)


def pad_rows(x: Tensor, rows: int, value: float = 0.0) -> Tensor:
    """Pad the last dim (1-d) or the first dim (2-d weight) of a vocabulary-sized tensor to ``rows``."""
    extra = rows - (x.shape[-1] if x.dim() != 2 else x.shape[0])
    return F.pad(x, (0, extra) if x.dim() != 2 else (0, 0, 0, extra), value=value)


def token_ids(c: Ctx, vocab: int) -> Tensor:
    """Random ids [s, b]; the first few are replaced by 0, vocab - 1 and the ids either side of each rank's block
    boundary, where an off-by-one in the block masking would show."""
    ids = torch.randint(0, vocab, (S, B))
    block = padded(vocab, c) // c.t
    edges = [e for e in [0, vocab - 1] + [k * block + d for k in range(1, c.t) for d in (-1, 0)] if e < vocab]
    ids.view(-1)[: len(edges)] = torch.tensor(edges)
    return ids


def check_column(c: Ctx, sp: bool, fused: int = 1, gather: bool = False) -> Pairs:
    ref = nn.Linear(H, FFN * fused)
    x, gy = torch.randn(S, B, H, requires_grad=True), torch.randn(S, B, FFN * fused)
    y_ref = run(ref, x, gy)
    layer = tpl.ColumnParallelLinear(ref, tpl.ShardRule(dim=0, fused=fused), tp_group(c), sp)
    x_in = leaf(seq_part(x, c, sp))
    y = layer(x_in)
    if gather:  # the layer always leaves its output split; gather_last_dim is how a caller gets the full one
        y = tpl.gather_last_dim(y, c.group)
        y.backward(gy)
        out = ("gathered output", y, y_ref)
    else:
        y.backward(part(gy, -1, c, fused))
        out = ("output", y, part(y_ref, -1, c, fused))
    return [
        out,
        ("input grad", x_in.grad, seq_part(x.grad, c, sp)),
        ("weight grad", layer.weight.grad, part(ref.weight.grad, 0, c, fused)),
        ("bias grad", layer.bias.grad, part(ref.bias.grad, 0, c, fused)),
    ]


def check_row(c: Ctx, sp: bool) -> Pairs:
    ref = nn.Linear(FFN, H)
    x, gy = torch.randn(S, B, FFN, requires_grad=True), torch.randn(S, B, H)
    y_ref = run(ref, x, gy)
    layer = tpl.RowParallelLinear(ref, tp_group(c), sp)
    x_in = leaf(part(x, -1, c))
    y = run(layer, x_in, seq_part(gy, c, sp))
    return [
        ("output", y, seq_part(y_ref, c, sp)),
        ("input grad", x_in.grad, part(x.grad, -1, c)),
        ("weight grad", layer.weight.grad, part(ref.weight.grad, 1, c)),
        # The bias is replicated: every rank must hold the full-sequence gradient, under SP too.
        ("bias grad", layer.bias.grad, ref.bias.grad),
    ]


def check_embedding(c: Ctx, sp: bool, vocab: int) -> Pairs:
    ref, ids, gy = nn.Embedding(vocab, H), token_ids(c, vocab), torch.randn(S, B, H)
    out_ref = run(ref, ids, gy)
    layer = tpl.VocabParallelEmbedding(ref, padded(vocab, c), tp_group(c), sp)
    out = run(layer, ids, seq_part(gy, c, sp))
    return [
        ("output", out, seq_part(out_ref, c, sp)),
        # Padding rows are never looked up, so their gradient must be exactly zero.
        ("weight grad", layer.weight.grad, part(pad_rows(ref.weight.grad, padded(vocab, c)), 0, c)),
    ]


def check_tied_logits_ce(c: Ctx, sp: bool, vocab: int) -> Pairs:
    """The tied output layer feeding the vocab-parallel loss, as the GPT uses them."""
    ref, target, gl = nn.Embedding(vocab, H), token_ids(c, vocab), torch.rand(S, B)
    x = torch.randn(S, B, H, requires_grad=True)
    logits_ref = x @ ref.weight.t()
    logits_ref.retain_grad()
    loss_ref = run(partial(ce, target=target), logits_ref, gl)
    layer = tpl.VocabParallelEmbedding(ref, padded(vocab, c), tp_group(c), sp)
    x_in = leaf(seq_part(x, c, sp))
    logits = layer.logits(x_in)
    logits.retain_grad()
    loss = tpl.vocab_parallel_cross_entropy(logits, target, c.group, layer.vocab_start)
    loss.backward(gl)
    n = padded(vocab, c)
    return [
        ("logits (padding columns -inf)", logits, part(pad_rows(logits_ref, n, float("-inf")), -1, c)),
        ("loss", loss, loss_ref),
        ("logits grad (zero on padding)", logits.grad, part(pad_rows(logits_ref.grad, n), -1, c)),
        ("input grad", x_in.grad, seq_part(x.grad, c, sp)),
        ("weight grad", layer.weight.grad, part(pad_rows(ref.weight.grad, n), 0, c)),
    ]


def check_cross_entropy(c: Ctx, vocab: int) -> Pairs:
    """Logits large enough that exp overflows fp32 unless the global max is subtracted first."""
    logits_ref = (30.0 * torch.randn(S, B, vocab)).requires_grad_()
    target, gl = token_ids(c, vocab), torch.rand(S, B)
    loss_ref = run(partial(ce, target=target), logits_ref, gl)
    n = padded(vocab, c)
    block = leaf(part(pad_rows(logits_ref, n, float("-inf")), -1, c))
    loss = run(
        partial(tpl.vocab_parallel_cross_entropy, target=target, group=c.group, vocab_start=c.rank * n // c.t),
        block,
        gl,
    )
    return [
        ("loss", loss, loss_ref),
        ("logits grad (zero on padding)", block.grad, part(pad_rows(logits_ref.grad, n), -1, c)),
    ]


def check_sp_layernorm(c: Ctx) -> Pairs:
    ref = nn.LayerNorm(H)
    with torch.no_grad():  # non-trivial affine parameters, so a lost scale or shift shows in the output
        ref.weight.normal_()
        ref.bias.normal_()
    x, gy = torch.randn(S, B, H, requires_grad=True), torch.randn(S, B, H)
    y_ref = run(ref, x, gy)
    x_in = leaf(part(x, 0, c))
    layer = tpl.SequenceParallelLayerNorm(ref, tp_group(c))
    y = run(layer, x_in, part(gy, 0, c))
    return [
        ("output", y, part(y_ref, 0, c)),
        ("input grad", x_in.grad, part(x.grad, 0, c)),
        ("weight grad (summed over TP)", layer.weight.grad, ref.weight.grad),
        ("bias grad (summed over TP)", layer.bias.grad, ref.bias.grad),
    ]


def check_sp_position_embedding(c: Ctx) -> Pairs:
    ref, gy = nn.Embedding(S, H), torch.randn(S, H)
    out_ref = run(ref, torch.arange(S), gy)
    layer = tpl.SequenceShardedPositionEmbedding(ref.weight.data.clone(), tp_group(c))
    out = run(layer, torch.arange(S), part(gy, 0, c))
    return [("output", out, part(out_ref, 0, c)), ("weight grad (summed over TP)", layer.weight.grad, ref.weight.grad)]


def check_mappings(c: Ctx) -> Pairs:
    """Every autograd mapping against its docstring.  Per-rank inputs and gradients are drawn for all ranks on every
    rank (same seed), so the expected sums and concatenations are computed locally.  Each backward gets a fresh
    gradient, as autograd hands over a tensor that nothing else holds; shared gradients are ``check_forked_input``'s."""
    full, xs, g = torch.randn(S, B, H), torch.randn(c.t, S, B, H), torch.randn(S, B, H)
    gs, gs_seq = torch.randn(c.t, S, B, H), torch.randn(c.t, S // c.t, B, H)
    pairs: Pairs = []

    x = leaf(full)  # copy_to_tp (f): identity / all-reduce
    y = run(partial(tpl.copy_to_tp, group=c.group), x, gs[c.rank].clone())
    pairs += [("copy_to_tp forward", y, full), ("copy_to_tp backward", x.grad, gs.sum(0))]

    x = leaf(xs[c.rank])  # reduce_from_tp (g): all-reduce / identity, and the caller's tensor is left alone
    y = run(partial(tpl.reduce_from_tp, group=c.group), x, g.clone())
    pairs += [("reduce_from_tp forward", y, xs.sum(0)), ("reduce_from_tp intact", x, xs[c.rank])]
    pairs += [("reduce_from_tp backward", x.grad, g)]

    x = leaf(part(full, 0, c))  # gather_seq: all-gather / reduce-scatter
    y = run(partial(tpl.gather_seq, group=c.group), x, gs[c.rank].clone())
    pairs += [("gather_seq forward", y, full), ("gather_seq backward", x.grad, part(gs.sum(0), 0, c))]

    x = leaf(xs[c.rank])  # reduce_scatter_seq: reduce-scatter / all-gather
    y = run(partial(tpl.reduce_scatter_seq, group=c.group), x, gs_seq[c.rank].clone())
    pairs += [("reduce_scatter_seq forward", y, part(xs.sum(0), 0, c)), ("reduce_scatter_seq intact", x, xs[c.rank])]
    pairs += [("reduce_scatter_seq backward", x.grad, gs_seq.flatten(0, 1))]

    x = leaf(full)  # scatter_seq: split / all-gather
    y = run(partial(tpl.scatter_seq, group=c.group), x, gs_seq[c.rank].clone())
    pairs += [("scatter_seq forward", y, part(full, 0, c)), ("scatter_seq backward", x.grad, gs_seq.flatten(0, 1))]

    x = leaf(part(full, -1, c))  # gather_last_dim: all-gather / split
    y = run(partial(tpl.gather_last_dim, group=c.group), x, g.clone())
    pairs += [("gather_last_dim forward", y, full), ("gather_last_dim backward", x.grad, part(g, -1, c))]

    a, b = leaf(full[0, 0]), leaf(full[:, 1])  # sync_grads: identity / one all-reduce (sum) of all gradients
    ga, gb = gs[:, 0, 0], gs[:, :, 1]
    a2, b2 = tpl.sync_grads(c.group, a, b)
    torch.autograd.backward([a2, b2], [ga[c.rank].clone(), gb[c.rank].clone()])
    pairs += [("sync_grads forward", torch.cat([a2, b2.flatten()]), torch.cat([full[0, 0], full[:, 1].flatten()]))]
    return pairs + [("sync_grads backward a", a.grad, ga.sum(0)), ("sync_grads backward b", b.grad, gb.sum(0))]


def check_forked_input(c: Ctx, mapping: str) -> Pairs:
    """x feeds both the mapping and a direct path, so autograd hands the same gradient tensor to both branches
    (as a residual connection does).  The direct branch must still contribute exactly its own gradient."""
    full, gs = torch.randn(S, B, H), torch.randn(c.t, S, B, H)
    x = leaf(full)
    if mapping == "copy_to_tp":  # d/dx [x + f(x)] = g + sum_r g_r
        y, expected = x + tpl.copy_to_tp(x, c.group), gs[c.rank] + gs.sum(0)
    else:  # d/dx [x + gather_seq(x's chunk)] = g + (sum_r g_r) on this rank's chunk rows
        y, expected = x + tpl.gather_seq(part(x, 0, c), c.group), gs[c.rank].clone()
        expected.chunk(c.t, 0)[c.rank].add_(part(gs.sum(0), 0, c))
    y.backward(gs[c.rank].clone())
    return [(f"{mapping} forked-input grad", x.grad, expected)]


CHECKS: dict[str, Callable[[Ctx], Pairs]] = {"mappings": check_mappings}
for _sp, _tag in ((False, ""), (True, "-sp")):
    CHECKS[f"column{_tag}"] = partial(check_column, sp=_sp)
    CHECKS[f"column-gathered{_tag}"] = partial(check_column, sp=_sp, gather=True)
    CHECKS[f"column-qkv{_tag}"] = partial(check_column, sp=_sp, fused=3)
    CHECKS[f"row{_tag}"] = partial(check_row, sp=_sp)
    for _v in VOCABS:
        CHECKS[f"embedding-v{_v}{_tag}"] = partial(check_embedding, sp=_sp, vocab=_v)
        CHECKS[f"tied-logits-ce-v{_v}{_tag}"] = partial(check_tied_logits_ce, sp=_sp, vocab=_v)
for _v in VOCABS:
    CHECKS[f"cross-entropy-v{_v}"] = partial(check_cross_entropy, vocab=_v)
CHECKS["sp-layernorm"] = check_sp_layernorm
CHECKS["sp-position-embedding"] = check_sp_position_embedding
for _m in ("copy_to_tp", "gather_seq"):
    CHECKS[f"{_m}-forked-input"] = partial(check_forked_input, mapping=_m)


def _run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    return run_checks(CHECKS, Ctx(group, rank, world))


@pytest.fixture(scope="module")
def reports() -> Callable[[int], list[dict[str, str]]]:
    cache: dict[int, list[dict[str, str]]] = {}

    def get(t: int) -> list[dict[str, str]]:
        if t not in cache:
            cache[t] = spawn_reports(_run_rank, t)
        return cache[t]

    return get


def _case(tp: int, name: str) -> Any:  # a pytest ParameterSet (its type is not public)
    return pytest.param(tp, name, id=f"tp{tp}-{name}")


@pytest.mark.parametrize("tp, name", [_case(tp, name) for tp in WORLD_SIZES for name in CHECKS])
def test_layer_matches_unsharded_reference(reports: Callable[[int], list[dict[str, str]]], tp: int, name: str) -> None:
    message = failures(reports(tp), name, f"tp={tp}")
    assert not message, message
