"""The overlapped expert-parallel exchange (``ds_megatron.parallel.ep_dispatch_chunks``, ``expert_parallel.overlap``),
in-process on CPU (gloo), on the pool of 4 ranks ``test_expert_parallel`` uses, with its skewed router (experts 6
and 7 get no token; at ep 4 rank 3 receives no row at all) and uneven token counts:

- the same results **bit for bit** as the blocking layer (one all-to-all each way), at ep 2 (C 2 and 4: at C 4
  rank 1's last chunk holds expert 7 alone, an empty exchange) and ep 4 (C 2: rank 3's chunks both empty), fp32 and
  bf16, with and without a shared expert, selective ``moe`` recompute, a capacity factor, and with the loop GEMM:
  output, router statistics, the input's and every parameter's gradient; all-to-alls counted (1 + 4 C, recompute
  running none again) and copies to the host counted (one per layer call, as the blocking path);
- the order of events, forward and backward: every dispatch started before the first wait, the shared expert run
  while they are in flight, chunk c's experts after its wait and before chunk c + 1's; in backward each chunk's rows'
  gradients started before the next chunk's experts' backward, and the shared expert's backward between the last
  start and the first wait (what autograd's order of nodes gives; see ``expert_parallel.overlap``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from inprocess import Pairs, failures, run_checks, spawn_reports
from test_expert_parallel import TOKENS, WORLD, Ctx, H, _CountedAllToAll, _ep_config, reference_block, tokens
from torch import Tensor
from torch.distributed import ProcessGroup

from ds_megatron.expert_parallel import overlap
from ds_megatron.expert_parallel.dispatch import build_ep_groups, exchange_counts
from ds_megatron.expert_parallel.layer import ExpertParallelMoE
from ds_megatron.expert_parallel.layout import ep_layout
from ds_megatron.model.llama.model import LlamaConfig, LlamaMLP
from ds_megatron.recompute import checkpoint
from ds_megatron.topology import Group

E = 8
HOST_COPIES = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class _CountedHostCopies:
    """Every tensor-to-host conversion (``tolist``, ``item``, ``int(t)``...) counted while in use: on a GPU each is
    a device-to-host copy that waits for the device."""

    def __init__(self):
        self.calls, self.real = 0, {name: getattr(torch.Tensor, name) for name in HOST_COPIES}

    def _counted(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        return call

    def __enter__(self):
        for name, real in self.real.items():
            setattr(torch.Tensor, name, self._counted(real))
        return self

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(torch.Tensor, name, real)


def block_with_shared_expert(dtype: torch.dtype):
    """``reference_block`` with a Qwen2-MoE shared expert (a SwiGLU of width 24) and its gate, drawn after it."""
    block = reference_block(torch.float32)
    block.shared_expert = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=24, num_heads=2, vocab_size=8))
    block.shared_expert_gate = torch.nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        for p in (*block.shared_expert.parameters(), block.shared_expert_gate.weight):
            p.normal_(0, 0.3)
    return block.to(dtype)


def _ep_group(c: Ctx, ep: int) -> Group:
    layout = ep_layout(1, 1, c.world, pp=1, ep=ep, sequence_parallel=False, num_experts=E)
    group, _ = build_ep_groups(layout, c.rank)
    return Group(group, dist.get_rank(group), ep)


def _run(block, group: Group, x: Tensor, gout: Tensor, chunks: int, recompute) -> tuple[list[Tensor], int, int]:
    """Output, statistics and every gradient of the layer on ``x``; all-to-alls and host copies counted."""
    layer = ExpertParallelMoE.from_block(block, group, recompute, chunks)
    for param in layer.parameters():  # the shared expert is the block's own module: no gradient of an earlier run
        param.grad = None
    inp = x.clone().requires_grad_()
    with _CountedAllToAll() as exchanges, _CountedHostCopies() as copies:
        out, stats = layer(inp)
        (out.float() * gout).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    assert set(grads) == {name for name, _ in block.named_parameters()}
    return [out, *stats, inp.grad, *grads.values()], exchanges.calls, copies.calls


# (shared expert, moe recompute, capacity factor, GEMM): the layer's variants the overlapped path must match
VARIANTS = (
    (False, False, 0.0, "grouped"),
    (True, False, 0.0, "grouped"),
    (False, True, 0.0, "grouped"),
    (True, True, 0.0, "grouped"),
    (False, False, 0.5, "grouped"),  # expert 0 drops pairs on every rank (test_expert_parallel.reference_block)
    (False, False, 0.0, "loop"),
)


def check_bit_equal(c: Ctx, ep: int, dtype: torch.dtype) -> Pairs:
    """The overlapped layer against the blocking one on this rank's tokens, every chunk count (up to E/ep, at most
    4), in each of ``VARIANTS``: equal bit for bit (tolerance 0).  Host copies: one per layer call, plus the
    capacity's count of kept pairs (``pairs_by_expert``, both paths) and, on the blocking path only, the loop
    GEMM's counts (the overlapped path takes them from its plan)."""
    group = _ep_group(c, ep)
    x = tokens(TOKENS[c.rank], dtype)
    gout = torch.randn(x.shape)
    pairs: Pairs = []
    for shared, recompute, capacity, gemm in VARIANTS:
        block = block_with_shared_expert(dtype) if shared else reference_block(dtype, capacity)
        block.experts.gemm = gemm
        rc = functools.partial(checkpoint, rng=None) if recompute else None
        blocking, exchanges, copies = _run(block, group, x, gout, 1, rc)
        what = f"ep {ep} {dtype} shared={shared} recompute={recompute} capacity={capacity} {gemm}"
        host = 1 + (capacity > 0)
        pairs += [(f"{what}: all-to-alls blocking", torch.tensor(exchanges), torch.tensor(5))]
        pairs += [(f"{what}: host copies blocking", torch.tensor(copies), torch.tensor(host + (gemm == "loop")))]
        for chunks in sorted({2, min(4, E // ep)}):
            overlapped, exchanges, copies = _run(block, group, x, gout, chunks, rc)
            same = enumerate(zip(overlapped, blocking, strict=True))
            pairs += [(f"{what} C {chunks}: tensor {i}", a, b, 0.0) for i, (a, b) in same]
            pairs += [(f"{what} C {chunks}: all-to-alls", torch.tensor(exchanges), torch.tensor(1 + 4 * chunks))]
            pairs += [(f"{what} C {chunks}: host copies", torch.tensor(copies), torch.tensor(host))]
    # the cases the test is for occur: experts 6 and 7 get no token anywhere; at ep 4 rank 3 receives nothing
    block = reference_block(dtype)
    per_expert = torch.bincount(block.gate(x)[1].reshape(-1), minlength=E)
    counts = per_expert.clone()
    dist.all_reduce(counts)
    received = exchange_counts(per_expert, group.group)
    pairs.append(("no token for experts 6, 7", counts[-2:], torch.zeros(2, dtype=counts.dtype)))
    if ep == 4 and c.rank == 3:
        pairs.append(("rank 3 receives no row", received.sum(), torch.tensor(0)))
    return pairs


class _Traced:
    """The order of events of one layer call: all-to-alls started (async: numbered) and waited, the count exchange,
    the experts' grouped GEMMs and their backward, the shared expert's forward and backward."""

    def __init__(self, layer: ExpertParallelMoE):
        self.events: list[str] = []
        self.layer, self.real_a2a, self.real_mlp = layer, dist.all_to_all_single, overlap.grouped_mlp
        self.started = 0
        self.outputs: list[weakref.ref] = []  # the experts' outputs: freed once sent back

    def _a2a(self, *args, async_op: bool = False, **kwargs):
        work = self.real_a2a(*args, async_op=async_op, **kwargs)
        if not async_op:
            self.events.append("counts")
            return work
        self.started += 1
        self.events.append(f"start {self.started}")
        return _TracedWork(work, self.started, self.events)

    def _mlp(self, *args, **kwargs):
        out = self.real_mlp(*args, **kwargs)
        self.events.append("experts")
        self.outputs.append(weakref.ref(out))
        out.register_hook(lambda grad: self.events.append("experts backward"))
        return out

    def _shared(self, module, inputs, out):
        self.events.append("shared expert")
        out.register_hook(lambda grad: self.events.append("shared expert backward"))

    def __enter__(self):
        dist.all_to_all_single, overlap.grouped_mlp = self._a2a, self._mlp
        self.hook = self.layer.shared_expert.register_forward_hook(self._shared)
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, overlap.grouped_mlp = self.real_a2a, self.real_mlp
        self.hook.remove()


class _TracedWork:
    def __init__(self, work, number: int, events: list[str]):
        self.work, self.number, self.events = work, number, events

    def wait(self):
        self.events.append(f"wait {self.number}")
        return self.work.wait()


def expected_order(chunks: int) -> list[str]:
    """Forward: the counts, C dispatches started, the shared expert, then per chunk: its dispatch waited, its
    experts, its combine started (C + c + 1); the combines waited.  Backward: the C output gradients started, then
    per chunk: waited, its experts' backward, its rows' gradients started (3 C + c + 1); the shared expert's backward;
    the rows' gradients waited."""
    c = range(1, chunks + 1)
    forward = ["counts", *(f"start {i}" for i in c), "shared expert"]
    forward += [e for i in c for e in (f"wait {i}", "experts", f"start {chunks + i}")]
    forward += [f"wait {chunks + i}" for i in c]
    backward = [f"start {2 * chunks + i}" for i in c]
    backward += [e for i in c for e in (f"wait {2 * chunks + i}", "experts backward", f"start {3 * chunks + i}")]
    backward += ["shared expert backward", *(f"wait {3 * chunks + i}" for i in c)]
    return [*forward, "backward", *backward]


def check_order(c: Ctx, ep: int, chunks: int) -> Pairs:
    """The overlapped layer's events in the order the module docstring gives (a blocking exchange, or a backward
    that ran the shared expert after the rows' gradients arrived, fails it); the experts' outputs are not kept for
    backward (only their gradient edges are), as on the blocking path."""
    layer = ExpertParallelMoE.from_block(block_with_shared_expert(torch.float32), _ep_group(c, ep), None, chunks)
    x = tokens(TOKENS[c.rank], torch.float32).requires_grad_()
    with _Traced(layer) as traced:
        out, _ = layer(x)
        kept = sum(ref() is not None for ref in traced.outputs)
        traced.events.append("backward")
        out.sum().backward()
    expected = expected_order(chunks)
    return [
        (f"events {traced.events} == {expected}", torch.tensor(traced.events == expected), torch.tensor(True)),
        ("experts' outputs alive after forward", torch.tensor(kept), torch.tensor(0)),
    ]


def check_no_grad(c: Ctx) -> Pairs:
    """Under ``torch.no_grad`` (evaluation) the overlapped layer computes the blocking layer's output, bit for bit,
    and keeps no graph."""
    group, block = _ep_group(c, 2), block_with_shared_expert(torch.float32)
    x = tokens(TOKENS[c.rank], torch.float32)
    with torch.no_grad():
        outs = [ExpertParallelMoE.from_block(block, group, None, chunks)(x)[0] for chunks in (1, 4)]
    graph = torch.tensor(outs[1].requires_grad)
    return [("output without grad", outs[1], outs[0], 0.0), ("no graph", graph, torch.tensor(False))]


def checks() -> dict[str, Callable[[Ctx], Pairs]]:
    found: dict[str, Callable[[Ctx], Pairs]] = {}
    for ep in (2, 4):
        for dtype in (torch.float32, torch.bfloat16):
            found[f"ep{ep}/{str(dtype)[6:]}/bit-equal"] = functools.partial(check_bit_equal, ep=ep, dtype=dtype)
    found["ep2/C2/order"] = functools.partial(check_order, ep=2, chunks=2)
    found["ep4/C2/order"] = functools.partial(check_order, ep=4, chunks=2)
    found["ep2/no-grad"] = check_no_grad
    return found


def _run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    return run_checks(checks(), Ctx(group, rank, world))


@pytest.fixture(scope="module")
def reports() -> list[dict[str, str]]:
    return spawn_reports(_run_rank, WORLD)


@pytest.mark.parametrize("name", list(checks()))
def test_overlapped_exchange(reports: list[dict[str, str]], name: str):
    message = failures(reports, name, f"world={WORLD}")
    assert not message, message


def test_chunks_of_local_experts():
    """Chunks are contiguous ranges covering the local experts once, of sizes differing by at most one, and
    :func:`overlap.chunk_of` (the device side's rule) agrees with :func:`overlap.chunk_bounds` (the host's)."""
    for local in range(1, 17):
        for chunks in range(1, local + 1):
            bounds = overlap.chunk_bounds(local, chunks)
            assert [lo for lo, _ in bounds[1:]] == [hi for _, hi in bounds[:-1]] and bounds[0][0] == 0
            assert bounds[-1][1] == local and {hi - lo for lo, hi in bounds} <= {local // chunks, -(-local // chunks)}
            of = overlap.chunk_of(torch.arange(local), local, chunks).tolist()
            assert of == [c for c, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]


def test_the_setting_and_its_refusals():
    """``ds_megatron.parallel.ep_dispatch_chunks``: 1 (the default) and 2..E/ep at ep > 1 resolve and reach the
    layer; 0, a chunk count above the local experts and any count above 1 at ep 1 are refused in one line naming the
    setting, before any process group exists."""
    from ds_megatron.config import ConfigError, resolve

    def cfg(ep: int, chunks: int) -> dict:
        config = _ep_config(ep)
        config["ds_megatron"]["parallel"]["ep_dispatch_chunks"] = chunks
        return config

    assert resolve(_ep_config(2), 2).section.parallel.ep_dispatch_chunks == 1
    assert resolve(cfg(2, 4), 2).section.parallel.ep_dispatch_chunks == 4  # moe-tiny: 8 experts, 4 per EP rank
    cases = [
        (cfg(1, 2), 2, "ep 1 exchanges nothing (ep_dispatch_chunks=2, ep=1); use 1, or ep > 1"),
        (cfg(2, 5), 2, "num_experts=8, ep=2: 4 local experts); use ep_dispatch_chunks in [1, 2, 3, 4]"),
        (cfg(2, 0), 2, "must be a positive integer (got 0)"),
    ]
    for config, world, message in cases:
        with pytest.raises(ConfigError) as err:
            resolve(config, world)
        text = str(err.value)
        assert text.startswith("error: ds_megatron.parallel.ep_dispatch_chunks: ") and "\n" not in text, text
        assert message in text, text
    with pytest.raises(ConfigError, match="ep_dispatch_chunks in \\[1, 2, 3, 4\\]"):
        ExpertParallelMoE(H, 16, E, 2, True, Group(None, 0, 2), dispatch_chunks=8)
