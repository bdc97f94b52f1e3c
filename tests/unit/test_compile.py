"""``model.compile``: the block's memory-bound pieces (RMSNorm, rotary, SwiGLU, GELU) run as torch.compile (inductor)
kernels (``ds_megatron.model.kernels``) and give the eager block's outputs and gradients, in-process on CPU.

tp 1 (this process): a Llama block with attention dropout 0.1 (eager attention, so the s x s dropout is the core's),
compiled, under no recompute, selective recompute of every module (core_attn, mlp_act, layernorm) and full
recompute, against the eager block without recompute: equal within fp32
rounding only if every dropout mask was drawn as eager draws it and replayed exactly in the recompute.  Then two
more steps of two micro-batches each with dynamo's ``error_on_recompile``: no graph is compiled after the first step.

tp 2 with SP (a gloo group of two): a Llama block built as the pipeline builds it (``build_shard`` of
``parallelize_block``), compiled and eager, attention dropout 0.1 in the tensor-parallel RNG state and selective
recompute of the core: equal outputs and gradients, and both equal to the single-device block without dropout.

Compiling costs seconds per graph on a loaded CPU, so every check shares the process's compiled kernels
(``compiled_kernels`` is made once per process), the shapes are tiny, and inductor compiles in the checking process
(``INDUCTOR``): its pool of compile workers (each a Python process importing torch) and its build-and-load probe of
every vector instruction set the CPU reports (a C++ compile and a child process per instruction set) cost each of the
three compiling processes more than the graphs do on few cores.  The kernels are the same: inductor still picks the
instruction set from the CPU's flags and torch's own capability (AVX-512 here either way), only without the probe."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from inprocess import Pairs, failures, run_checks, spawn_reports
from torch.distributed import ProcessGroup

from ds_megatron.config.schema import RecomputeSection
from ds_megatron.model import LlamaConfig
from ds_megatron.model.kernels import compile_report, compiled_kernels, use_kernels
from ds_megatron.model.llama.model import LlamaBlock, init_llama_module
from ds_megatron.parallelize import ParallelContext, block_hooks, build_shard, parallelize_block
from ds_megatron.random import build_rng
from ds_megatron.recompute import checkpoint
from ds_megatron.topology import Group

S, B = 8, 2
LLAMA = LlamaConfig(
    vocab_size=64, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32,
    attention_dropout=0.1, attention="eager",
)  # fmt: skip
EVERY_MODULE = RecomputeSection("selective", modules=("core_attn", "mlp_act", "layernorm"))
POLICIES = {"none": RecomputeSection(), "selective": EVERY_MODULE, "full": RecomputeSection("full")}
# fp32: inductor sums a row's squares and a gradient's products in another order than eager's kernels (measured
# max |difference| below 1e-6 on these shapes); a dropout mask drawn or replayed differently changes values by O(1).
TOL = 1e-5
# What changes only how inductor builds (see the docstring): the generated C++ and the checks stay the same.
INDUCTOR = {"compile_threads": 1, "cpp.vec_isa_ok": True}


class Ctx(NamedTuple):
    group: ProcessGroup | None
    rank: int
    t: int


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def step(block, ctx: ParallelContext, x: torch.Tensor, policy: str) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward and backward of ``block`` under ``policy``,
    the RNG seeded afresh (so every run draws the same masks)."""
    ctx.rng = build_rng(7, ctx.tp.rank, 0, 0)
    ctx.recompute = POLICIES[policy]
    block.hooks = block_hooks(ctx)
    block.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = checkpoint(block, xi, rng=ctx.rng) if policy == "full" else block(xi)
    y.backward(torch.cos(y.detach() * 3))  # any fixed gradient that is not y's own scale
    return [y.detach(), xi.grad] + [p.grad for p in block.parameters()]


def single_device_block(config: LlamaConfig) -> LlamaBlock:
    block = LlamaBlock(config).train()
    init_llama_module(block, config, 3, prefix="model.layers.0.")
    return block


def flag(what: str, value: bool | torch.Tensor) -> tuple:
    return (what, torch.tensor(bool(value)), torch.tensor(True), 0.0)


def check_compiled_block_under_recompute(c: Ctx) -> Pairs:
    eager = single_device_block(LLAMA)
    compiled = use_kernels(copy.deepcopy(eager), compiled_kernels())
    ctx = ParallelContext(LLAMA, Group(), False, None)
    x = torch.randn(S, B, LLAMA.hidden_size)
    ref = step(eager, ctx, x, "none")
    with torch.no_grad():
        pairs = [flag("dropout changes the output", (ref[0] - eager.eval()(x)).abs().max() > 1e-3)]
    before = graphs()
    for policy in POLICIES:
        got = step(compiled, ctx, x, policy)
        pairs += [(f"recompute {policy}: tensor {i}", a, e, TOL) for i, (a, e) in enumerate(zip(got, ref))]
    # forward and backward of RMSNorm, rotary and SwiGLU, each once whatever the policy
    compiled_now = graphs() - before
    pairs.append(flag(f"{compiled_now} graphs compiled", compiled_now == 6))
    # Later steps: two micro-batches each, new data, the same shapes: nothing is compiled again.
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            for policy in ("none", "full"):
                step(compiled, ctx, torch.randn(S, B, LLAMA.hidden_size), policy)
    pairs.append(flag("no graph compiled after the first step", graphs() == before))
    report = compile_report()  # the line the trainer logs after the first step
    pairs.append(flag(f"compile report: {report}", report is not None and f"{graphs()} graphs" in report))
    return pairs


def tp_sp_step(c: Ctx, dropout: float, compile_: bool, x: torch.Tensor, gy: torch.Tensor) -> list[torch.Tensor]:
    config = LlamaConfig(**{**LLAMA.__dict__, "attention_dropout": dropout})
    rng = build_rng(7, c.rank, 0, 0)
    tp = Group(c.group, c.rank, c.t)
    ctx = ParallelContext(config, tp, True, rng, recompute=RecomputeSection("selective"), compile=compile_)
    block = build_shard("model.layers.0", lambda: LlamaBlock(config), lambda b: parallelize_block(b, ctx), ctx, 3)
    xi = x.clone().requires_grad_()
    y = block.train()(xi)
    y.backward(gy)
    return [y.detach(), xi.grad] + [p.grad for p in block.parameters()]


def check_tp_sp(c: Ctx) -> Pairs:
    """A Llama block at tp 2 with SP as the pipeline builds it, compiled against eager (attention dropout in the
    tensor-parallel RNG state, its core recomputed), and both without dropout against the single-device block."""
    x, gy = torch.randn(S, B, LLAMA.hidden_size), torch.randn(S, B, LLAMA.hidden_size)
    shard = slice(c.rank * S // c.t, (c.rank + 1) * S // c.t)
    results = {}
    for dropout in (0.1, 0.0):
        for compile_ in (True, False):
            results[dropout, compile_] = tp_sp_step(c, dropout, compile_, x[shard], gy[shard])
    ref = single_device_block(LlamaConfig(**{**LLAMA.__dict__, "attention_dropout": 0.0}))
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    y_ref = ref(x).detach()
    pairs: Pairs = []
    for dropout in (0.1, 0.0):
        got, eager = results[dropout, True], results[dropout, False]
        pairs += [
            (f"dropout {dropout}, compiled vs eager: tensor {i}", a, e, TOL) for i, (a, e) in enumerate(zip(got, eager))
        ]
    got = results[0.0, True]
    pairs += [("compiled vs single device: output", got[0], y_ref[shard], TOL)]
    pairs += [("compiled vs single device: input grad", got[1], xr.grad[shard], TOL)]
    norms = [n for n, _ in ref.named_parameters() if n.endswith("norm.weight")]
    params = dict(ref.named_parameters())
    index = [n for n, _ in ref.named_parameters()]
    for n in norms:  # replicated, summed over TP under SP
        pairs.append((f"compiled vs single device: {n} grad", got[2 + index.index(n)], params[n].grad, TOL))
    pairs.append(flag("dropout 0.1 differs from 0.0", (results[0.1, True][0] - got[0]).abs().max() > 10 * TOL))
    return pairs


CHECKS = {"tp1-recompute": check_compiled_block_under_recompute, "tp2-sp": check_tp_sp}


def run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    import torch._inductor.config

    with torch._inductor.config.patch(INDUCTOR):
        return run_checks({k: v for k, v in CHECKS.items() if k.startswith(f"tp{world}")}, Ctx(group, rank, world))


@pytest.mark.parametrize("world, name", [(1, "tp1-recompute"), (2, "tp2-sp")])
def test_compiled_equals_eager(world, name):
    msg = failures(spawn_reports(run_rank, world), name, f"tp {world}")
    assert not msg, msg
