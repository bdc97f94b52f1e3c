"""The analytic activation memory under context parallelism (``ds_megatron.memory``, ``cp`` > 1): the cp 1 terms
unchanged, the sequence terms at s / cp, the cp_comm core's saved tensors counted, and that count checked against
the bytes the real ring and a2a autograd functions save (2 gloo ranks, in-process), in fp32 and bf16; and every
tensor the real ring's backward creates, alive at once at its peak, against ``cp_transient_bytes`` (4 gloo ranks:
cp 2 and 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_megatron.memory import (
    LSE_BYTES,
    activation_bytes_per_layer,
    cp_core_saved_bytes,
    cp_transient_bytes,
    ring_dkv_hop_bytes,
    rotary_table_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA = dict(family="llama", num_kv_heads=8, intermediate_size=14336)  # Llama 3 8B's block
S, B, H, A = 8192, 1, 4096, 32


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("sp,t", [(False, 1), (False, 4), (True, 4)])
def test_cp1_is_unchanged(kernel, sp, t):
    for recompute in ("none", "selective", "full"):
        if kernel == "sdpa" and recompute == "selective":
            continue
        before = activation_bytes_per_layer(S, B, H, A, t, sp, recompute, attention=kernel, **LLAMA)
        assert activation_bytes_per_layer(S, B, H, A, t, sp, recompute, attention=kernel, **LLAMA, cp=1) == before


@pytest.mark.parametrize("cp_comm", ["ring", "a2a"])
@pytest.mark.parametrize("sp,t", [(False, 1), (False, 4), (True, 4)])
def test_cp2_halves_the_sequence_terms_and_counts_the_a2a_core_output(cp_comm, sp, t):
    # The fused sdpa kernel at cp 1 already stores no s^2 term, only the fp32 lse; the a2a core adds its own
    # output tensor ([b, a/(t cp), s, d]: one h per token split by TP, in activation bytes) on top of that, while the
    # ring's output is the output projection's input, counted once.
    half = activation_bytes_per_layer(S // 2, B, H, A, t, sp, attention="sdpa", **LLAMA)
    out_copy = 0 if cp_comm == "ring" else 2 * (S // 2) * B * H / t
    got = activation_bytes_per_layer(S, B, H, A, t, sp, attention="sdpa", **LLAMA, cp=2, cp_comm=cp_comm)
    assert got == pytest.approx(half + out_copy)
    # Eager at cp 2 stores no s^2 term either (the cp kernels recompute the probabilities): the same bytes.
    assert activation_bytes_per_layer(S, B, H, A, t, sp, **LLAMA, cp=2, cp_comm=cp_comm) == pytest.approx(got)
    # Under SP everything is split by cp x t; the full-recompute block input too.
    full = activation_bytes_per_layer(S, B, H, A, t, sp, "full", **LLAMA, cp=2)
    assert full == pytest.approx(2 * S * B * H / (2 * (t if sp else 1)))


def test_cp_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="cp_comm"):
        activation_bytes_per_layer(S, B, H, A, **LLAMA, cp=2, cp_comm="allgather")
    with pytest.raises(ValueError, match="attention dropout"):
        activation_bytes_per_layer(S, B, H, A, **{**LLAMA, "attention_dropout": 0.1}, cp=2)
    # core_attn at cp > 1 checkpoints the whole cp_comm call: the lse and the a2a's own output are not kept (the
    # ring's output is still the projection's input)
    for cp_comm, out_bytes in (("ring", 0), ("a2a", 2)):
        kept = activation_bytes_per_layer(S, B, H, A, recompute="selective", **LLAMA, cp=2, cp_comm=cp_comm)
        dropped = activation_bytes_per_layer(S, B, H, A, **LLAMA, cp=2, cp_comm=cp_comm) - kept
        assert dropped == pytest.approx((out_bytes + LSE_BYTES * A / H) * (S // 2) * B * H)


def test_ring_buffers_are_counted():
    d, kv, cp, t = H // A, 8, 4, 2
    local = B * S // cp * d / t
    q, e = local * A, 2 * local * kv  # elements of q and of the K/V stack
    # cp 4, bf16: at step 2 the fp32 dQ, the K/V in hand and arriving (bf16), the fp32 accumulator sent and the
    # one arriving, and the kernel's dq of every row with dk, dv of half the keys (bf16)
    expected = 4 * q + 2 * 2 * e + 2 * 4 * e + 2 * (q + e / 2)
    assert cp_transient_bytes(S, B, H, A, t, cp, "ring", num_kv_heads=kv) == pytest.approx(expected)
    # cp 2, bf16: at the last step the fp32 dQ, the K/V in hand, the accumulator sent and the one arriving (bf16:
    # both hops), the kernel's dq of every row with dk, dv of half the keys
    q2, e2 = 2 * q, 2 * e
    cp2 = 4 * q2 + 3 * 2 * e2 + 2 * (q2 + e2 / 2)
    assert cp_transient_bytes(S, B, H, A, t, 2, "ring", num_kv_heads=kv) == pytest.approx(cp2)
    eager = cp_transient_bytes(S, B, H, A, t, cp, "ring", "eager", num_kv_heads=kv)
    assert eager - expected == pytest.approx(12 * B * A / t * (S // cp) ** 2)  # the diagonal block in fp32 x 3
    # the a2a's eager score block is the whole sequence at a/(t cp) heads: cp times the ring's diagonal block
    a2a = cp_transient_bytes(S, B, H, A, t, cp, "a2a", "eager", num_kv_heads=kv)
    a2a_fused = cp_transient_bytes(S, B, H, A, t, cp, "a2a", num_kv_heads=kv)
    assert a2a - a2a_fused == pytest.approx(cp * (eager - expected))


def test_ring_dkv_hop_bytes():
    """The accumulator's first hop and its last one home travel in the K/V dtype, the middle ones in fp32; with
    packed documents the first one in fp32 too; fp32 and fp64 K/V travel in their own dtype every hop."""
    assert ring_dkv_hop_bytes(2) == [2, 2]
    assert ring_dkv_hop_bytes(4) == [2, 4, 4, 2]
    assert ring_dkv_hop_bytes(2, documents=True) == [4, 2]
    assert ring_dkv_hop_bytes(3, 4) == [4, 4, 4]
    assert ring_dkv_hop_bytes(2, 8, documents=True) == [8, 8]


def test_core_saved_bytes_formula():
    # q and out [b, a/t, s/cp, d], k and v at KV size, lse fp32 [b, a/t, s/cp]
    s, b, h, a, kv, t, cp = 24, 2, 32, 4, 2, 1, 2
    rows = b * s // cp
    expected = rows * 8 * (4 + 4 + 2 + 2) * 4 + rows * 4 * LSE_BYTES  # fp32: 4 bytes each
    assert cp_core_saved_bytes(s, b, h, a, t, cp, num_kv_heads=kv, act_bytes=4) == expected


def test_rotary_tables_are_counted_once_per_process():
    # cos and sin [s/cp, 1, 1, d] in activation bytes, whatever tp or SP do; none with learned positions
    d = H // A
    assert rotary_table_bytes(S, H, A, family="llama") == 2 * S * d * 2
    assert rotary_table_bytes(S, H, A, 4, family="llama", act_bytes=4) == 2 * (S // 4) * d * 4
    assert rotary_table_bytes(S, H, A, 2, family="gpt2") == 0


# The in-process measurement: every (cp_comm, kernel, dtype) on 2 gloo ranks, one spawn.
SHAPE = dict(s=32, b=2, a=4, kv=2, d=8)
CASES = [
    (comm, kernel, dtype) for comm in ("ring", "a2a") for kernel in ("eager", "sdpa") for dtype in ("fp32", "bf16")
]


def _saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (each storage counted once)."""
    import torch

    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*args)
    out.float().sum().backward()  # the saved tensors are enough to run the backward
    return sum(seen.values())


def _run_rank(group, rank: int, world: int) -> dict[str, str]:
    import torch
    from inprocess import run_checks

    from ds_megatron.context_parallel.attention import cp_attention

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    s, b, a, kv, d = (SHAPE[k] for k in ("s", "b", "a", "kv", "d"))

    def check(comm: str, kernel: str, dtype: str):
        def run(_):
            q = torch.randn(b, a, s // world, d, dtype=dtypes[dtype], requires_grad=True)
            k, v = (torch.randn(b, kv, s // world, d, dtype=dtypes[dtype], requires_grad=True) for _ in range(2))
            measured = _saved_bytes(lambda *x: cp_attention(comm, *x, group, kernel, d**-0.5), q, k, v)
            act = 4 if dtype == "fp32" else 2
            predicted = cp_core_saved_bytes(s, b, a * d, a, 1, world, num_kv_heads=kv, act_bytes=act)
            return [
                (f"{comm} {kernel} {dtype} saved bytes", torch.tensor(float(measured)), torch.tensor(predicted), 0.05)
            ]

        return run

    def block_check(comm: str, kernel: str, dtype: str, recompute: str):
        def run(_):
            measured, predicted = _llama_block(group, rank, world, comm, kernel, dtypes[dtype], recompute)
            what = f"LlamaBlock {comm} {kernel} {dtype} {recompute} saved bytes"
            return [(what, torch.tensor(float(measured)), torch.tensor(predicted), 0.0)]  # to the byte

        return run

    def one_storage_check(kernel: str, dtype: str):
        def run(_):
            return _ring_context_storage(group, rank, world, kernel, dtypes[dtype])

        return run

    checks = {f"{c}-{k}-{t}": check(c, k, t) for c, k, t in CASES}
    checks.update({"block-" + "-".join(case): block_check(*case) for case in BLOCK_CASES})
    checks.update({f"one-storage-{k}-{t}": one_storage_check(k, t) for k, t in ONE_STORAGE_CASES})
    return run_checks(checks, None)


# A real LlamaBlock (4 heads, 2 KV heads, SwiGLU 176) at cp 2, as the CP training builds it (parallelize_block
# with the CP group): what it saves for backward equals activation_bytes_per_layer(..., cp=2) plus the rotary
# cos/sin tables of the rank's positions (rotary_table_bytes: once per process, and this process has one block).
BLOCK_CASES = [
    (comm, kernel, dtype, recompute)
    for comm in ("ring", "a2a")
    for kernel, recompute in (("eager", "none"), ("sdpa", "none"), ("eager", "selective"))
    for dtype in ("fp32", "bf16")
]


def _llama_block(group, rank: int, world: int, comm: str, kernel: str, dtype, recompute: str) -> tuple[int, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from activation_memory import measure

    block, x, rng, predicted = _cp_llama_block(group, rank, world, comm, kernel, dtype, recompute)
    return measure(block, x, False, rng), predicted


def _cp_llama_block(group, rank: int, world: int, comm: str, kernel: str, dtype, recompute: str):
    """(block, input, rng, predicted saved bytes) of a LlamaBlock at cp ``world`` built as the CP training builds
    it; the prediction includes the rotary tables of the rank's positions."""
    import torch

    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.llama.model import LlamaBlock, LlamaConfig, init_llama_module
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    s, b, h, a, k, f = 128, 2, 64, 4, 2, 176
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=h,
        num_layers=1,
        num_heads=a,
        num_kv_heads=k,
        intermediate_size=f,
        max_position_embeddings=s,
        rope_theta=10000.0,
        attention_dropout=0.0,
        attention=kernel,
    )
    rng = build_rng(1234, 0, 0, rank)
    plan = ParallelContext(
        config, Group(), False, rng, recompute=RecomputeSection(recompute),
        cp=Group(group, rank, world), cp_comm=comm,
    )  # fmt: skip
    block = LlamaBlock(config)
    init_llama_module(block, config, 1234, prefix="model.layers.0.")
    block = parallelize_block(block, plan).to(dtype).train()
    x = torch.randn(s // world, b, h).to(dtype).requires_grad_()
    predicted = activation_bytes_per_layer(
        s, b, h, a, recompute=recompute, act_bytes=torch.finfo(dtype).bits // 8, attention=kernel,
        family="llama", num_kv_heads=k, intermediate_size=f, attention_dropout=0.0, cp=world, cp_comm=comm,
    )  # fmt: skip
    tables = rotary_table_bytes(s, h, a, world, family="llama", act_bytes=torch.finfo(dtype).bits // 8)
    return block, x, rng, predicted + tables


# The ring keeps one storage of its merged context: what it saves for its backward ([b, a, s/cp, d]) is a view of
# the storage the output projection saves as its input, so a block's saved bytes count the context once (a copy in
# another layout beside it would add b (s/cp) h activation bytes per layer).
ONE_STORAGE_CASES = [("sdpa", "fp32"), ("sdpa", "bf16"), ("eager", "bf16")]


def _ring_context_storage(group, rank: int, world: int, kernel: str, dtype) -> list:
    import torch

    block, x, rng, predicted = _cp_llama_block(group, rank, world, "ring", kernel, dtype, "none")
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saves: list[tuple[int, int, tuple[int, ...]]] = []  # (storage, its bytes, the saved view's shape) per save
    proj_inputs: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saves.append((storage.data_ptr(), storage.nbytes(), tuple(t.shape)))
        return t

    hook = block.self_attn.o_proj.register_forward_pre_hook(lambda _, args: proj_inputs.append(args[0]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    hook.remove()
    y.float().sum().backward()
    s_local, b, h = x.shape
    d = block.self_attn.head_dim
    context = proj_inputs[0].untyped_storage()
    views = {shape for ptr, _, shape in saves if ptr == context.data_ptr()}
    measured = sum({ptr: nbytes for ptr, nbytes, _ in saves}.values())  # each storage once
    return [
        ("the ring's saved context is a view of the projection input's storage",
         torch.tensor(float((b, h // d, s_local, d) in views)), torch.tensor(1.0), 0.0),
        ("that storage holds the context once", torch.tensor(float(context.nbytes())),
         torch.tensor(float(s_local * b * h * x.element_size())), 0.0),
        ("the block's saved bytes, the context counted once", torch.tensor(float(measured)),
         torch.tensor(predicted), 0.0),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    from inprocess import spawn_reports

    return spawn_reports(_run_rank, 2)


@pytest.mark.parametrize("comm,kernel,dtype", CASES)
def test_saved_bytes_match_the_real_cp_functions(reports, comm, kernel, dtype):
    from inprocess import failures

    message = failures(reports, f"{comm}-{kernel}-{dtype}", f"{comm} {kernel} {dtype}")
    assert not message, message


@pytest.mark.parametrize("comm,kernel,dtype,recompute", BLOCK_CASES)
def test_a_cp_llama_block_stores_what_the_formula_counts(reports, comm, kernel, dtype, recompute):
    from inprocess import failures

    name = "block-" + "-".join((comm, kernel, dtype, recompute))
    message = failures(reports, name, f"LlamaBlock {comm} {kernel} {dtype} {recompute}")
    assert not message, message


@pytest.mark.parametrize("kernel,dtype", ONE_STORAGE_CASES)
def test_the_ring_saves_one_storage_of_its_context(reports, kernel, dtype):
    from inprocess import failures

    message = failures(reports, f"one-storage-{kernel}-{dtype}", f"ring one storage {kernel} {dtype}")
    assert not message, message


# Every tensor the ring's backward creates, alive at once at its peak (4 gloo ranks: cp 4, and cp 2 on two groups
# of two), the most over the ranks, against cp_transient_bytes to the byte.  The saved tensors are not counted, nor
# the block kernel's internals (its results are).
HELD_CASES = [(4, "bf16", False), (4, "fp32", False), (2, "bf16", False), (2, "fp32", False), (2, "bf16", True)]


def _ring_backward_peak_bytes(group, cp: int, dtype, documents: bool) -> int:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ds_megatron.context_parallel import attention as cp_comm

    class Live(TorchDispatchMode):
        """The storages every op creates, alive while anything (a tensor, a view, a pending send) holds them: a
        storage held only here has a use count of 1.  Skipped: the storages of ``known`` (saved tensors, dout)."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # torch otherwise wraps __torch_dispatch__ to keep torch.compile out of it, importing torch._dynamo at
            # the first op (seconds of CPU per rank); nothing here is compiled, so there is nothing to skip.
            return False

        def __init__(self, known: set[int]):
            super().__init__()
            self.known, self.storages, self.peak, self.paused = known, {}, 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not self.paused:
                self.note(out)
            return out

        def note(self, out) -> None:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in self.known:
                    self.storages.setdefault(leaf.untyped_storage().data_ptr(), leaf.untyped_storage())
            self.storages = {p: st for p, st in self.storages.items() if torch._C._storage_Use_Count(st._cdata) > 1}
            self.peak = max(self.peak, sum(st.nbytes() for st in self.storages.values()))

    s, b, a, kv, d = (SHAPE[k] for k in ("s", "b", "a", "kv", "d"))
    q = torch.randn(b, a, s // cp, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv, s // cp, d, dtype=dtype, requires_grad=True) for _ in range(2))
    ids = torch.zeros(b, s // cp, dtype=torch.long) if documents else None  # one document: every pair computed
    out = cp_comm.ring_attention(q, k, v, group, "sdpa", d**-0.5, ids)
    real_backward, real_block = cp_comm._RingAttention.backward, cp_comm.block_backward
    modes: list[Live] = []

    def backward(ctx, dout):
        modes.append(Live({t.untyped_storage().data_ptr() for t in (*ctx.saved_tensors, dout)}))
        with modes[0]:
            return real_backward(ctx, dout)

    def block(*args, **kwargs):  # the kernel's internals are not the ring's: only its results are recorded
        modes[0].paused = True
        try:
            results = real_block(*args, **kwargs)
        finally:
            modes[0].paused = False
        modes[0].note(results)
        return results

    cp_comm._RingAttention.backward, cp_comm.block_backward = staticmethod(backward), block
    try:
        out.backward(torch.ones_like(out))
    finally:
        cp_comm._RingAttention.backward, cp_comm.block_backward = real_backward, real_block
    return modes[0].peak


def _held_rank(group, rank: int, world: int) -> dict[str, str]:
    import torch
    import torch.distributed as dist
    from inprocess import run_checks

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    s, b, a, kv, d = (SHAPE[k] for k in ("s", "b", "a", "kv", "d"))

    def check(cp: int, dtype: str, documents: bool):
        def run(sub_group):
            peak = torch.tensor([_ring_backward_peak_bytes(sub_group, cp, dtypes[dtype], documents)])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=sub_group)  # the rank whose blocks hold the most
            predicted = cp_transient_bytes(s, b, a * d, a, 1, cp, "ring", "sdpa", num_kv_heads=kv,
                                           act_bytes=dtypes[dtype].itemsize, documents=documents)  # fmt: skip
            return [(f"ring backward peak bytes cp {cp}", peak.double(), torch.tensor([predicted]).double(), 0.0)]

        return run

    report = {}
    for cp in (4, 2):
        groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]  # every rank creates each
        cases = {f"cp{c}-{t}-{'documents' if docs else 'plain'}": check(c, t, docs) for c, t, docs in HELD_CASES}
        report |= run_checks({k: f for k, f in cases.items() if k.startswith(f"cp{cp}-")}, groups[rank // cp])
    return report


@pytest.fixture(scope="module")
def held_reports():
    from inprocess import spawn_reports

    return spawn_reports(_held_rank, 4)


@pytest.mark.parametrize("cp,dtype,documents", HELD_CASES)
def test_ring_backward_peak_is_cp_transient_bytes(held_reports, cp, dtype, documents):
    """To the byte, the most bytes the ring's backward holds at once in tensors it creates (tracked op by op, a
    storage alive while anything holds it, pending sends included) is what cp_transient_bytes counts."""
    from inprocess import failures

    name = f"cp{cp}-{dtype}-{'documents' if documents else 'plain'}"
    message = failures(held_reports, name, name)
    assert not message, message
