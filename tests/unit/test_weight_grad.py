"""Deferred weight gradients (the W passes of zero-bubble schedules), in-process on CPU (gloo at tp 2).

A whole parallelized model (GPT-2 with its tied embedding, Llama untied, Llama tied, and Qwen2-MoE with its q/k/v
biases and shared expert) runs three micro-batches of
gradient accumulation twice: once with the plain backward, once with every column/row-parallel linear and the
vocabulary embedding deferring its weight gradient to a ``WeightGradQueue``, W passes run late and out of step
with the backward passes (one after the second backward, the rest at ``flush``).  Every parameter's gradient
after the flush must equal the plain one bit for bit: fp32 and bf16, tp 1 and tp 2 with SP off and on, no recompute,
selective recompute of every module, and full recompute of each block (recompute runs inside backward, so W must
keep the recomputed tensors).  Nothing may be left queued after the flush, and before it the linears' weight
gradients must really be missing (the deferral happened).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from inprocess import Pairs, failures, run_checks, spawn_reports
from tiny import tiny_gpt, tiny_llama
from torch.distributed import ProcessGroup

from ds_megatron.config.schema import RecomputeSection
from ds_megatron.model import Qwen2MoeConfig, build_model
from ds_megatron.parallelize import ParallelContext, parallelize_model
from ds_megatron.recompute import checkpoint
from ds_megatron.tensor_parallel import vocab_parallel_cross_entropy
from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue, defer_weight_grads
from ds_megatron.topology import Group

S, B, MICRO_BATCHES, VOCAB = 8, 2, 3, 101
LLAMA = dict(vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=16, rope_theta=10000.0)
FAMILIES = {
    "gpt2": tiny_gpt(vocab_size=VOCAB, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
    "llama": tiny_llama(**LLAMA),
    "llama-tied": tiny_llama(**LLAMA, tie_word_embeddings=True),
    # q/k/v biases (added after the grouped projection) and a shared expert beside the routed ones
    "qwen2_moe": Qwen2MoeConfig(
        **LLAMA,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(0,),
    ),
}
RECOMPUTE = {
    "none": RecomputeSection(),
    "selective": RecomputeSection(policy="selective", modules=("core_attn", "mlp_act", "layernorm")),
    "full": RecomputeSection(policy="full"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Ctx(NamedTuple):
    group: ProcessGroup | None
    rank: int
    t: int


def build(c: Ctx, family: str, sp: bool, recompute: str, dtype: torch.dtype):
    config = FAMILIES[family]
    policy = RECOMPUTE[recompute]
    ctx = ParallelContext(config=config, tp=Group(c.group, c.rank, c.t), sequence_parallel=sp, rng=None)
    ctx.recompute = policy if policy.policy == "selective" else RecomputeSection()
    model = parallelize_model(build_model(config, seed=3), ctx).to(dtype)
    if policy.policy == "full":  # each block recomputed in backward, as the pipeline's full policy does
        blocks = model.transformer.h if family == "gpt2" else model.model.layers
        for block in blocks:
            # the blocks' other inputs (packed documents' ids and positions: None here) pass around the checkpoint
            block.forward = lambda x, *rest, run=block.forward: checkpoint(lambda h: run(h, *rest), x, rng=None)
    return model, ctx


def train_grads(c: Ctx, model, ctx, queue: WeightGradQueue | None):
    """Accumulate three micro-batches' gradients; with ``queue``, W passes run late (one after the second
    backward, the others at the flush).  Returns the gradients and what the check must also see."""
    model.zero_grad(set_to_none=True)
    defer_weight_grads(model, queue)
    g = torch.Generator().manual_seed(11)
    vocab_start = c.rank * (ctx.padded_vocab_size // c.t)
    missing_before_w = 0
    for mb in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (B, S + 1), generator=g)
        logits = model(tokens[:, :-1])  # [b, s, V_pad/t]
        loss = vocab_parallel_cross_entropy(logits, tokens[:, 1:], ctx.tp.group, vocab_start).float().mean()
        loss.backward()
        if queue is not None:
            queue.seal()
            if mb == 0:
                missing_before_w = sum(p.grad is None for n, p in model.named_parameters() if "weight" in n)
            if mb == 1:
                queue.run_next()
    if queue is not None:
        queue.flush()
    defer_weight_grads(model, None)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, missing_before_w


def check(family: str, sp: bool, recompute: str, dtype: str):
    def run(c: Ctx) -> Pairs:
        model, ctx = build(c, family, sp, recompute, DTYPES[dtype])
        plain, _ = train_grads(c, model, ctx, None)
        queue = WeightGradQueue()
        deferred, missing = train_grads(c, model, ctx, queue)
        pairs: Pairs = [(f"{name} grad", deferred[name], plain[name], 0.0) for name in plain]
        pairs.append(("W passes left after flush", torch.tensor(len(queue)), torch.tensor(0), 0.0))
        # Every linear and the embedding defers its weight gradient, so after the first backward (before any W
        # pass) those weights have none at all: only norms have theirs.
        pairs.append(("weights deferred", torch.tensor(missing > 0), torch.tensor(True), 0.0))
        return pairs

    return run


CASES = {
    f"{family}-{dtype}-{'sp' if sp else 'nosp'}-{recompute}": check(family, sp, recompute, dtype)
    for family in FAMILIES
    for dtype in DTYPES
    for sp in (False, True)
    for recompute in RECOMPUTE
    # recompute and the tied Llama: fp32 only (the suite's time budget; bf16 is covered without recompute); Qwen2-MoE
    # in fp32 without full recompute (its blocks return the routing statistics beside the hidden states)
    if not ((recompute != "none" or family == "llama-tied") and dtype == "bf16")
    and not (recompute != "none" and family == "llama-tied")
    and not (family == "qwen2_moe" and (dtype == "bf16" or recompute == "full"))
}


def run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    c = Ctx(group, rank, world)
    return run_checks({k: v for k, v in CASES.items() if world > 1 or "-nosp-" in k}, c)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def reports(request):
    return request.param, spawn_reports(run_rank, request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_deferred_weight_grads_equal_plain_backward(reports, case):
    world, reps = reports
    if world == 1 and "-sp-" in case:
        pytest.skip("SP needs a TP group of two or more")
    msg = failures(reps, case, f"tp {world}")
    assert not msg, msg


def test_queue_runs_passes_in_order_and_flush_empties_it():
    """W passes run oldest first, one per sealed backward; flush runs the open one too and leaves nothing."""
    queue, ran = WeightGradQueue(), []
    p = torch.zeros(2, requires_grad=True)
    for i in range(3):
        queue.defer((p,), lambda i=i: (ran.append(i) or torch.full((2,), float(i + 1)),))
        if i < 2:
            queue.seal()
    assert len(queue) == 3 and queue.run_next() and ran == [0]
    assert queue.flush() == 2 and ran == [0, 1, 2] and len(queue) == 0 and not queue.run_next()
    assert p.grad.tolist() == [6.0, 6.0]
