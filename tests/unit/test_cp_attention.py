"""Context-parallel attention and its layout, in-process on CPU (gloo): ring and a2a attention against whole-sequence
causal attention on one process (torch's math SDPA on the full q, k, v), forward and dq, dk, dv, at cp 1, 2 and 4,
with the eager and the sdpa kernel, grouped-query attention, batch 2 and a sequence length that is not a power of
two; bf16 forward; the layout (chunks, positions, labels, slicing) and the refusals as unit tests.  The packed
document checks of tests/unit/test_document_mask.py run in the same spawn.

One spawn of 4 gloo processes runs every case at cp 4 and at cp 2 (cp 1 runs here); each (cp, case) is its own
test.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from flash_cuda_standin import CALLS, cuda_flash_on_cpu
from inprocess import Pairs, failures, run_checks, spawn_reports
from test_document_mask import CHECKS as DOCUMENT_CHECKS
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

from ds_megatron.config import ConfigError
from ds_megatron.config.context_parallel import check_cp_attention_dropout, check_cp_heads, check_cp_seq_length
from ds_megatron.context_parallel import attention as cp_comm
from ds_megatron.context_parallel.layout import gather_for_ranks, slice_for_rank, split_window, token_indices, unslice

CP_SIZES = (1, 2, 4)
B, S, D = 2, 24, 8  # 24 = 2 x 2 x 6 = 2 x 4 x 3: two chunks per rank at cp 2 and 4, and not a power of two
BF16_TOLERANCE = 2e-2  # measured: at most 1.0e-2 at cp 2 and 4 (8.8e-3 for the same kernel at cp 1) on N(0, 1) inputs


class Ctx(NamedTuple):
    group: ProcessGroup | None
    rank: int
    cp: int


def expected_indices(s: int, rank: int, cp: int) -> Tensor:
    """This rank's global token indices, written out here so a layout bug in the library cannot cancel out."""
    c = s // (2 * cp)
    return torch.tensor([*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def reference(q: Tensor, k: Tensor, v: Tensor, gout: Tensor) -> tuple[Tensor, ...]:
    """Whole-sequence causal attention on one process, and dq, dk, dv of sum(out * gout)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(gout)
    return out, q.grad, k.grad, v.grad


def check_parity(c: Ctx, comm: str, kernel: str, n: int, n_kv: int) -> Pairs:
    q, gout = torch.randn(B, n, S, D), torch.randn(B, n, S, D)
    k, v = torch.randn(B, n_kv, S, D), torch.randn(B, n_kv, S, D)
    out_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, gout)
    idx = expected_indices(S, c.rank, c.cp) if c.cp > 1 else torch.arange(S)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    kept = [t.detach().clone() for t in local]
    out = cp_comm.cp_attention(comm, *local, c.group, kernel, 1 / math.sqrt(D))
    out.backward(gout[:, :, idx])
    return [
        ("output", out, out_ref[:, :, idx]),
        ("dq", local[0].grad, dq_ref[:, :, idx]),
        ("dk", local[1].grad, dk_ref[:, :, idx]),
        ("dv", local[2].grad, dv_ref[:, :, idx]),
        ("inputs untouched", torch.cat([t.flatten() for t in local]), torch.cat([t.flatten() for t in kept])),
    ]


def check_bf16_forward(c: Ctx, comm: str, kernel: str) -> Pairs:
    """bf16 inputs against the fp32 reference on the same (bf16-representable) values, within BF16_TOLERANCE."""
    q, k, v = (torch.randn(B, 4, S, D).bfloat16() for _ in range(3))
    out_ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    idx = expected_indices(S, c.rank, c.cp) if c.cp > 1 else torch.arange(S)
    out = cp_comm.cp_attention(comm, q[:, :, idx], k[:, :, idx], v[:, :, idx], c.group, kernel, 1 / math.sqrt(D))
    return [("bf16 dtype kept", torch.tensor(out.dtype == torch.bfloat16), torch.tensor(True)),
            ("bf16 output", out.float(), out_ref[:, :, idx], BF16_TOLERANCE)]  # fmt: skip


def check_ring_traffic_and_work(c: Ctx, kernel: str) -> Pairs:
    """What the ring sends and computes: K/V messages at KV-head size (GQA: 2 of 8 heads), send buffers left
    untouched once posted, and per rank one causal
    2c x 2c block plus cp - 1 full blocks of 2c x c (the pairs above the diagonal are never computed), so every
    rank computes the same number of scores."""
    n, n_kv = 8, 2
    sent: list[tuple[int, ...]] = []
    posted: list[tuple[Tensor, int]] = []
    blocks: list[tuple[int, int, bool]] = []
    real_shift, real_block = cp_comm._shift, cp_comm.block_forward

    def shift(send: Tensor, group: ProcessGroup) -> Any:
        sent.append(tuple(send.shape))
        posted.append((send, send._version))  # the version counter counts in-place writes
        return real_shift(send, group)

    def block(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, docs: Any = None) -> Any:
        blocks.append((q.shape[2], k.shape[2], causal))
        return real_block(kernel, q, k, v, causal, scale, docs)

    q = torch.randn(B, n, S // c.cp, D, requires_grad=True)
    k, v = (torch.randn(B, n_kv, S // c.cp, D, requires_grad=True) for _ in range(2))
    cp_comm._shift, cp_comm.block_forward = shift, block
    try:
        out = cp_comm.ring_attention(q, k, v, c.group, kernel, 1.0)
        forward_sent = list(sent)
        out.sum().backward()
    finally:
        cp_comm._shift, cp_comm.block_forward = real_shift, real_block
    local = S // c.cp
    kv_msg = (2, B, n_kv, local, D)
    expected_blocks = [(local, local, True)] + sorted(
        [(local, local // 2, False) if (c.rank - t) % c.cp < c.rank else (local // 2, local, False)
         for t in range(1, c.cp)])  # fmt: skip
    scores = torch.tensor([sum(a * b for a, b, _ in blocks)])
    all_scores = [torch.zeros_like(scores) for _ in range(c.cp)]
    dist.all_gather(all_scores, scores, group=c.group)
    return [
        ("forward messages: K/V at KV-head size", torch.tensor(forward_sent), torch.tensor([kv_msg] * (c.cp - 1))),
        # backward: K/V again (cp - 1 hops) and their fp32 gradient accumulator (cp hops, the last one home)
        ("backward messages", torch.tensor(sorted(sent[c.cp - 1 :])), torch.tensor(sorted([kv_msg] * (2 * c.cp - 1)))),
        ("blocks computed", torch.tensor([blocks[0]] + sorted(blocks[1:])), torch.tensor(expected_blocks)),
        ("same scores on every rank", torch.cat(all_scores), scores.expand(c.cp)),
        # gloo reads a send buffer while it sends: one written in place after posting would send garbage
        (
            "send buffers never written once posted",
            torch.tensor([t._version for t, _ in posted]),
            torch.tensor([v for _, v in posted]),
        ),  # fmt: skip
    ]


def check_ring_message_dtypes(c: Ctx) -> Pairs:
    """bf16 K/V: the backward's dK/dV accumulator travels in fp32 (the sum over cp ranks rounds once) except on its
    first hop (one block's grads, nothing summed yet) and its last one home (the owner would only round it): both
    in bf16, which at cp 2 is every hop.  The K/V themselves travel in bf16."""
    dtypes: list[torch.dtype] = []
    real_shift = cp_comm._shift

    def shift(send: Tensor, group: ProcessGroup) -> Any:
        dtypes.append(send.dtype)
        return real_shift(send, group)

    q = torch.randn(B, 4, S // c.cp, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, 2, S // c.cp, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = cp_comm.ring_attention(q, k, v, c.group, "sdpa", 0.3)
    cp_comm._shift = shift
    try:
        out.backward(torch.randn_like(out))
    finally:
        cp_comm._shift = real_shift
    # backward posts, per step, the K/V's next hop (steps 0 .. cp-2) and then the accumulator's
    kv_hops = [torch.bfloat16 if step + 1 < c.cp else None for step in range(c.cp)]
    acc_hops = [torch.bfloat16 if step in (0, c.cp - 1) else torch.float32 for step in range(c.cp)]
    expected = [d for pair in zip(kv_hops, acc_hops, strict=True) for d in pair if d is not None]
    return [("message dtypes", torch.tensor([d == torch.bfloat16 for d in dtypes]),
             torch.tensor([d == torch.bfloat16 for d in expected]))]  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it, and the elements that the copying ones write."""

    COPIES = ("aten.clone.default", "aten.cat.default", "aten.stack.default", "aten.copy_.default")

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ to keep torch.compile out of it, importing torch._dynamo at the
        # first op (about 3 s of CPU in each spawned rank); nothing here is compiled, so there is nothing to skip.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.copied = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls[str(func)] += 1
        if str(func) in self.COPIES:
            self.copied += out.numel()
        return out


def check_ring_copies_nothing(c: Ctx) -> Pairs:
    """The sdpa ring on CPU, forward and backward: no operand is copied (the CPU kernel reads strided q, dout and
    out slices through their strides, bit for bit as from contiguous copies) and no accumulator is filled with
    zeros (step 0's diagonal block covers every row and key and is copied in); the results stay exact (the parity
    checks)."""
    q = torch.randn(S // c.cp, B, 8, D).permute(1, 2, 0, 3).requires_grad_()  # [b, n, s, d] over [s, b, n, d]
    k, v = (torch.randn(S // c.cp, B, 2, D).permute(1, 2, 0, 3).requires_grad_() for _ in range(2))
    with OpCounter() as ops:
        cp_comm.ring_attention(q, k, v, c.group, "sdpa", 0.3).sum().backward()
    return [
        ("operand copies (aten.clone)", torch.tensor(ops.calls["aten.clone.default"]), torch.tensor(0)),
        ("accumulators zero-filled", torch.tensor(ops.calls["aten.zeros.default"]), torch.tensor(0)),
    ]


def check_heads_to_seq_one_pass(c: Ctx) -> Pairs:
    """a2a's return trip builds its send buffer in one pass over the context (every rank's chunks written straight
    into it), and reassembles the received heads in one more, straight into the model's [s, b, n, d] layout."""
    y = torch.randn(B, 2, S, D)  # [b, n/cp, s, d]: head group of this rank, the whole sequence
    with OpCounter() as ops:
        (out,) = cp_comm._heads_to_seq((y,), c.group)
    mine = slice_for_rank(y, 2, c.rank, c.cp)
    return [
        ("elements copied", torch.tensor(ops.copied), torch.tensor(2 * y.numel())),
        ("own heads of own chunks", out[:, 2 * c.rank : 2 * c.rank + 2], mine),
    ]


def model_layout(s: int, n: int) -> Tensor:
    """[b, n, s, d] as the model hands it to attention: a view of its [s, b, n, d] projections."""
    return torch.randn(s, B, n, D).permute(1, 2, 0, 3).requires_grad_()


def seq_major(t: Tensor) -> bool:
    """Whether a [b, n, s, d] tensor is laid out as [s, b, n, d] (the model's reshape to [s, b, n * d] a view)."""
    return t.permute(2, 0, 1, 3).is_contiguous()


def check_layout_and_exchanges(c: Ctx, comm: str) -> Pairs:
    """Forward and backward of one attention call from the model's layout: dq, dk, dv come back in that layout
    (a [b, n, s, d]-contiguous one costs the model a copy per tensor per layer in the view backward of q, k, v), and
    so does the a2a's context (the ring's stays [b, n, s, d]-contiguous: it is saved for backward, and the model's
    copy of it is what the memory model counts); the a2a exchanges q, k, v together: two all-to-alls each way (q, k
    and v; the context), where one per tensor would be four."""
    q, k, v = model_layout(S // c.cp, 8), model_layout(S // c.cp, 4), model_layout(S // c.cp, 4)
    with OpCounter() as ops:
        out = cp_comm.cp_attention(comm, q, k, v, c.group, "sdpa", 0.3)
        forward_a2a = ops.calls["c10d.alltoall_base_.default"]
        out.backward(torch.randn(S // c.cp, B, 8, D).permute(1, 2, 0, 3))
    pairs = [
        (f"{name} in the model's layout", torch.tensor(seq_major(t)), torch.tensor(True))
        for name, t in (("context", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
        if name != "context" or comm == "a2a"
    ]
    if comm == "a2a":
        pairs += [
            ("all-to-alls in forward", torch.tensor(forward_a2a), torch.tensor(2)),
            ("all-to-alls in forward and backward", torch.tensor(ops.calls["c10d.alltoall_base_.default"]),
             torch.tensor(4)),
        ]  # fmt: skip
    return pairs


def check_cuda_branch(c: Ctx, comm: str) -> Pairs:
    """The sdpa kernel's CUDA branch (torch's CUDA flash ops with their preconditions, stood in for on CPU by
    tests/unit/flash_cuda_standin.py: undefined cum_seq_q/k, an lse read as contiguous [b, n, sq], ...), in bf16
    from the model's layout with 8 query heads on 4 KV heads: the context and dq, dk, dv equal the CPU branch's and
    match whole-sequence attention within bf16 rounding; no operand is copied but a strided lse.  The stand-in must
    have run forward and backward."""
    n, n_kv = 8, 4
    q, gout = (torch.randn(B, n, S, D).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, n_kv, S, D).bfloat16() for _ in range(2))
    out_ref, *grads_ref = reference(q.float(), k.float(), v.float(), gout.float())
    idx = expected_indices(S, c.rank, c.cp) if c.cp > 1 else torch.arange(S)

    # [b, n, s/cp, d] views of [s/cp, b, n, d] memory, as the model hands them over
    inputs = [t[:, :, idx].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in (q, k, v)]
    dout = gout[:, :, idx].clone()

    def run() -> list[Tensor]:
        local = [t.detach().requires_grad_() for t in inputs]
        out = cp_comm.cp_attention(comm, *local, c.group, "sdpa", 1 / math.sqrt(D))
        out.backward(dout)
        return [out.detach(), *(t.grad for t in local)]

    cpu_branch = run()
    CALLS.clear()
    with cuda_flash_on_cpu(), OpCounter() as ops:  # counts the ops around the stand-in's, not inside it
        cuda_branch = run()
    # The one copy: the lse of the second chunk's rows (ring steps holding a later rank's K/V), which the kernel
    # reads as contiguous; q, k, v, out and dout go in through their strides.
    lse_slices = sum((c.rank - t) % c.cp > c.rank for t in range(1, c.cp)) if comm == "ring" else 0
    copies = torch.tensor(ops.calls["aten.clone.default"])
    pairs: Pairs = [
        ("stand-in ran forward and backward", torch.tensor([CALLS["forward"] > 0, CALLS["backward"] > 0]),
         torch.tensor([True, True])),
        ("copies: the strided lse slices only", copies, torch.tensor(lse_slices)),
    ]  # fmt: skip
    for name, got, cpu, ref in zip(("output", "dq", "dk", "dv"), cuda_branch, cpu_branch, (out_ref, *grads_ref)):
        pairs.append((f"{name}: CUDA branch = CPU branch", got, cpu, 0.0))
        pairs.append((f"{name}: CUDA branch = whole sequence", got.float(), ref[:, :, idx], BF16_TOLERANCE))
    return pairs


def check_gather_for_ranks(c: Ctx) -> Pairs:
    x = torch.randn(S, B, 3)  # [s, b, h]: the sequence along dim 0
    return [("gather_for_ranks", gather_for_ranks(slice_for_rank(x, 0, c.rank, c.cp), 0, c.group), x)]


CHECKS: dict[str, Callable[[Ctx], Pairs]] = {"gather-for-ranks": check_gather_for_ranks}
for _comm in ("ring", "a2a"):
    for _kernel in ("eager", "sdpa"):
        for _n, _n_kv in ((4, 4), (8, 4)):  # (8, 4): grouped-query attention, KV heads still divisible by cp 4
            CHECKS[f"{_comm}-{_kernel}-h{_n}-kv{_n_kv}"] = partial(
                check_parity, comm=_comm, kernel=_kernel, n=_n, n_kv=_n_kv
            )
        CHECKS[f"{_comm}-{_kernel}-bf16"] = partial(check_bf16_forward, comm=_comm, kernel=_kernel)
    CHECKS[f"ring-{_kernel}-h8-kv2"] = partial(check_parity, comm="ring", kernel=_kernel, n=8, n_kv=2)
for _kernel in ("eager", "sdpa"):
    CHECKS[f"ring-{_kernel}-traffic-and-work"] = partial(check_ring_traffic_and_work, kernel=_kernel)
CHECKS["ring-sdpa-copies-nothing"] = check_ring_copies_nothing
CHECKS["ring-sdpa-message-dtypes"] = check_ring_message_dtypes
CHECKS["a2a-heads-to-seq-one-pass"] = check_heads_to_seq_one_pass
for _comm in ("ring", "a2a"):
    CHECKS[f"{_comm}-sdpa-cuda-branch"] = partial(check_cuda_branch, comm=_comm)
for _comm in ("ring", "a2a"):
    CHECKS[f"{_comm}-layout-and-exchanges"] = partial(check_layout_and_exchanges, comm=_comm)
# packed documents (document ids: parity with each document alone, skipped pairs, bf16), in the same spawn
CHECKS |= {f"documents-{name}": check for name, check in DOCUMENT_CHECKS.items()}


def _run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    """cp 1 here in the test process; otherwise one spawn of 4 processes runs cp 4 on all of them and cp 2 on two
    groups of two ({0, 1}, {2, 3}: the second checks that ring peers are addressed by their global ranks)."""
    if world == 1:
        return {f"cp1/{k}": r for k, r in run_checks(CHECKS_CP1, Ctx(None, 0, 1)).items()}
    report = {}
    for cp in (4, 2):
        groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]  # every rank creates each
        ctx = Ctx(groups[rank // cp], rank % cp, cp)
        report |= {f"cp{cp}/{k}": r for k, r in run_checks(CHECKS, ctx).items()}
    return report


# cp 1 sends nothing and computes one block: no ring, no all-to-all to check
CP_ONLY = ("traffic", "copies-nothing", "message-dtypes", "heads-to-seq", "layout-and-exchanges")
CHECKS_CP1 = {k: f for k, f in CHECKS.items() if not any(word in k for word in CP_ONLY)}


@pytest.fixture(scope="module")
def reports() -> Callable[[int], list[dict[str, str]]]:
    cache: dict[int, list[dict[str, str]]] = {}

    def get(cp: int) -> list[dict[str, str]]:
        world = 1 if cp == 1 else 4
        if world not in cache:
            cache[world] = spawn_reports(_run_rank, world)
        return cache[world]

    return get


@pytest.mark.parametrize(
    "cp, name", [pytest.param(cp, n, id=f"cp{cp}-{n}") for cp in CP_SIZES for n in (CHECKS if cp > 1 else CHECKS_CP1)]
)
def test_cp_attention_matches_whole_sequence(reports: Callable[[int], list[dict[str, str]]], cp: int, name: str):
    message = failures(reports(cp), f"cp{cp}/{name}", f"cp={cp}")
    assert not message, message


# ---- the layout ----


def test_token_indices_are_the_balanced_chunks():
    assert token_indices(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert token_indices(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert token_indices(12, 0, 1).tolist() == list(range(12))
    for cp in (2, 3, 4):
        ranks = [token_indices(S, r, cp) for r in range(cp)]
        for r, idx in enumerate(ranks):
            assert idx.tolist() == expected_indices(S, r, cp).tolist()
        assert sorted(torch.cat(ranks).tolist()) == list(range(S))  # every token on exactly one rank
        # causal work: token j attends to j + 1 keys; the balanced layout gives every rank the same total
        assert len({int((idx + 1).sum()) for idx in ranks}) == 1


def test_slice_and_unslice_on_both_layouts():
    for cp in (1, 2, 4):
        for x, dim in ((torch.randn(B, S, 3), 1), (torch.randn(S, B, 3), 0)):  # [b, s, h] and [s, b, h]
            pieces = [slice_for_rank(x, dim, r, cp) for r in range(cp)]
            for r, piece in enumerate(pieces):
                assert torch.equal(piece, x.index_select(dim, token_indices(S, r, cp)))
            assert torch.equal(unslice(pieces, dim), x)


def test_labels_are_shifted_over_the_whole_sequence():
    window = torch.arange(2 * (S + 1)).view(2, S + 1)  # [b, s + 1] as the packed data yields it
    inputs_full, labels_full = window[:, :-1], window[:, 1:]
    for cp in (1, 2, 4):
        for r in range(cp):
            inputs, labels = split_window(window, r, cp)
            idx = expected_indices(S, r, cp) if cp > 1 else torch.arange(S)
            assert torch.equal(inputs, inputs_full[:, idx]) and torch.equal(labels, labels_full[:, idx])
    # the label of rank 0's first chunk's last token is the first token of chunk 1, which rank 1 holds (cp 2)
    c = S // 4
    assert split_window(window, 0, 2)[1][0, c - 1] == window[0, c] == split_window(window, 1, 2)[0][0, 0]


# ---- the refusals ----


def _refused(fn: Callable[..., None], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_seq_length_rule():
    check_cp_seq_length(24, 2)
    check_cp_seq_length(24, 4)
    check_cp_seq_length(7, 1)
    message = _refused(check_cp_seq_length, 20, 4)
    assert "ds_megatron.parallel.cp" in message and "seq_length=20, cp=4" in message and "16 or 24" in message
    # sequence parallel: each rank's s/cp tokens split over tp too; 24 / 2 = 12 splits over tp 4, 20 / 2 does not
    check_cp_seq_length(24, 2, tp=4, sequence_parallel=True)
    check_cp_seq_length(12, 2, tp=2, sequence_parallel=True)
    message = _refused(check_cp_seq_length, 20, 2, tp=4, sequence_parallel=True)
    assert "tp=4" in message and "16 or 24 (any multiple of 8)" in message
    check_cp_seq_length(20, 2, tp=4, sequence_parallel=False)  # without SP tp does not split the sequence


def test_a2a_heads_rule():
    check_cp_heads(8, 8, tp=2, cp=2)
    check_cp_heads(8, 4, tp=1, cp=4)
    message = _refused(check_cp_heads, 8, 2, tp=2, cp=2)
    assert "num_kv_heads=2, tp=2, num_kv_heads/tp=1, cp=2" in message and "cp_comm" in message
    assert "num_heads=6" in _refused(check_cp_heads, 6, 6, tp=1, cp=4)


def test_cuda_flash_refuses_what_it_cannot_run():
    """On CUDA the sdpa kernel is torch's flash attention: fp32 and head dims that are not a multiple of 8 (or above
    256) get a one-line error naming both fixes, before the op is called."""
    from ds_megatron.context_parallel.kernels import block_forward

    with cuda_flash_on_cpu():
        for dtype, d in ((torch.float32, 8), (torch.bfloat16, 12), (torch.bfloat16, 264)):
            q = torch.randn(1, 2, 4, d, dtype=dtype)
            with pytest.raises(ValueError, match=f"got {dtype}, head dim {d}.*bf16.*eager"):
                block_forward("sdpa", q, q, q, True, 1.0)
        q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
        assert block_forward("sdpa", q, q, q, True, 1.0).lse.is_contiguous()


def test_attention_dropout_refused_with_cp():
    check_cp_attention_dropout(1, 0.1)
    check_cp_attention_dropout(2, 0.0)
    message = _refused(check_cp_attention_dropout, 2, 0.1)
    assert "cp=2, attn_pdrop=0.1" in message and "mask" in message
