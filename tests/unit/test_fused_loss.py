"""The fused output layer + cross entropy (``tensor_parallel.fused_cross_entropy``) against the unfused path, in-process
on CPU (gloo at tp 2).

Layer checks: the tied embedding (``VocabParallelEmbedding``, whose weight also takes the lookup's gradient) and the
untied output layer (``VocabParallelOutput``), tp 1 and 2, SP off and on, fp32, bf16 and fp16 (with a loss scale), 24
tokens in chunks of 5 (five chunks, the last one short), vocabularies 1001 (padding columns in the last block) and 100
(at tp 2 rank 1's block is padding only; fp32 and bf16). Loss, hidden-state gradient and weight gradient are compared
with the unfused layer (``logits`` + ``vocab_parallel_cross_entropy``) on the same weights, whose own parity with the
unsharded reference is tests/unit/test_layers_inprocess.py's; padding rows must get exactly zero gradient. With a
``WeightGradQueue`` (zero bubble) the weight's gradient is missing after backward and equal bit for bit after the flush.

Pipeline checks: both families' output layer as the pipeline builds it (``layer_specs``: GPT-2's tied embedding,
Llama's untied ``lm_head``) with ``VocabParallelLoss`` fused and unfused, under DeepSpeed's backward prologue (which
clears gradients when a module output's gradient arrives), and generation's ``emitting_logits``.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from deepspeed.runtime.utils import register_output_backward_hooks
from inprocess import Pairs, failures, run_checks, spawn_reports
from torch import nn
from torch.distributed import ProcessGroup

import ds_megatron.tensor_parallel as tpl
from ds_megatron.model import GPTConfig, LlamaConfig
from ds_megatron.parallelize import ParallelContext
from ds_megatron.pipeline_parallel.module import PipelineLayout, VocabParallelLoss, layer_specs, lm_head_forward
from ds_megatron.tensor_parallel.fused_cross_entropy import chunk_tokens, dh_operand
from ds_megatron.tensor_parallel.weight_grad import WeightGradQueue, defer_weight_grads
from ds_megatron.topology import Group

S, B, H, CHUNK = 12, 2, 16, 5  # 24 tokens: chunks of 5, 5, 5, 5, 4
VOCABS = (1001, 100)
# fp32: the fused path sums the same products in another order (measured max |difference| 2.4e-7, on a gradient
# summed over all tokens).  bf16: both paths compute the loss in fp32 from the same bf16 logits and round
# (softmax - one_hot) / N to bf16 alike; the fused one sums dW over chunks in fp32 and rounds once, the unfused one
# rounds its single product: measured max |difference| 9.8e-4, one bf16 step of the largest weight-gradient entries.
# fp16 (loss-scaled): measured max |difference| 4.9e-4 (one fp16 step near 0.5); with the gradient of the mean cast
# to fp16 before the loss scale (as bf16 does) the weight gradients differ by far more and these checks fail.
TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16 runs with a loss scale, as DeepSpeed's: the fused path keeps its stored gradients in fp32 until backward
# applies the scale (the gradient of the mean alone would underflow fp16); both paths' gradients are unscaled
# (exactly: a power of two) before the comparison.
LOSS_SCALE = {torch.float16: 2.0**16}


class Ctx(NamedTuple):
    group: ProcessGroup | None
    rank: int
    t: int


def padded(vocab: int, c: Ctx) -> int:
    return tpl.padded_vocab_size(vocab, c.t, ParallelContext.vocab_multiple)


def seq_part(x: torch.Tensor, c: Ctx, sp: bool) -> torch.Tensor:
    return x.chunk(c.t, 0)[c.rank] if sp else x


def make_layer(c: Ctx, vocab: int, sp: bool, tied: bool, dtype: torch.dtype) -> tpl.VocabParallelEmbedding:
    full = nn.Embedding(vocab, H) if tied else nn.Linear(H, vocab, bias=False)
    cls = tpl.VocabParallelEmbedding if tied else tpl.VocabParallelOutput
    return cls(full, padded(vocab, c), Group(c.group, c.rank, c.t), sp).to(dtype)


def loss_and_grads(layer, ids, target, c: Ctx, sp: bool, fused: bool, queue: WeightGradQueue | None = None):
    """Loss, the hidden states' gradient and the weight's (after the queue's flush) of one micro-batch.  Tied: the
    hidden states are the embedding's own output (times a learned-free scale), so the weight takes both terms."""
    layer.zero_grad(set_to_none=True)
    defer_weight_grads(layer, queue)
    if isinstance(layer, tpl.VocabParallelOutput):
        hidden = seq_part(ids, c, sp).detach().clone().requires_grad_()
        leaf = hidden
    else:
        leaf = (torch.arange(1, H + 1, dtype=layer.weight.dtype) / H).requires_grad_()
        hidden = layer(ids) * leaf  # [s(/t), b, h]
    if fused:
        loss = layer.fused_loss(hidden, target, chunk=CHUNK)
    else:
        loss = tpl.vocab_parallel_cross_entropy(layer.logits(hidden), target, c.group, layer.vocab_start).mean()
    scale = LOSS_SCALE.get(layer.weight.dtype, 1.0)
    (loss * scale).backward()
    missing = layer.weight.grad is None
    if queue is not None:
        queue.flush()
    defer_weight_grads(layer, None)
    return loss, leaf.grad / scale, layer.weight.grad / scale, missing


def check_layer(vocab: int, sp: bool, tied: bool, dtype: torch.dtype):
    def run(c: Ctx) -> Pairs:
        layer = make_layer(c, vocab, sp, tied, dtype)
        target = torch.randint(0, vocab, (S, B))
        target.view(-1)[:3] = torch.tensor([0, vocab - 1, min(vocab - 1, padded(vocab, c) // c.t)])
        ids = torch.randint(0, vocab, (S, B)) if tied else torch.randn(S, B, H, dtype=dtype)
        ref = loss_and_grads(layer, ids, target, c, sp, fused=False)
        got = loss_and_grads(layer, ids, target, c, sp, fused=True)
        tol = TOL[dtype]
        start, rows = layer.vocab_start, layer.weight.shape[0]
        real = max(0, min(rows, vocab - start))
        pairs: Pairs = [
            ("loss", got[0], ref[0], tol),
            ("hidden grad" if not tied else "embedding-scale grad", got[1], ref[1], tol),
            ("weight grad", got[2], ref[2], tol),
            ("padding rows' grad (exactly 0)", got[2][real:], torch.zeros_like(got[2][real:]), 0.0),
        ]
        # zero bubble: the weight gradient deferred to W, then the same bits
        deferred = loss_and_grads(layer, ids, target, c, sp, fused=True, queue=WeightGradQueue())
        pairs.append(("deferred: no weight grad before W", torch.tensor(deferred[3]), torch.tensor(True), 0.0))
        pairs.append(("deferred weight grad after flush", deferred[2], got[2], 0.0))
        pairs.append(("deferred hidden grad", deferred[1], got[1], 0.0))
        return pairs

    return run


FAMILIES = {
    "gpt2": GPTConfig(vocab_size=1001, n_positions=S, n_embd=H, n_layer=1, n_head=2),
    "llama": LlamaConfig(
        vocab_size=1001, hidden_size=H, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=S
    ),
}


def prologue_clears_grads(layer: nn.Module, outputs) -> object:
    """DeepSpeed's engine runs its backward prologue when the gradient of a module output arrives
    (``register_output_backward_hooks`` on what the module returned); the BF16 optimizer clears the 16-bit
    gradients there, in place.  The gradients are filled with ones first (an earlier micro-batch's, already moved
    to fp32), which the prologue must clear before this backward accumulates anything."""
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    return register_output_backward_hooks(outputs, lambda: [p.grad.zero_() for p in layer.parameters()])


def check_pipeline(family: str, sp: bool):
    """The output layer as the pipeline builds it (GPT-2: the tied embedding; Llama: lm_head) and its loss, under
    DeepSpeed's backward prologue."""

    def run(c: Ctx) -> Pairs:
        config = FAMILIES[family]
        ctx = ParallelContext(config, Group(c.group, c.rank, c.t), sp, None)
        hidden = torch.randn(S, B, H)
        labels = torch.randint(0, config.vocab_size, (B, S))
        results = []
        for fused in (False, True):
            loss_fn = VocabParallelLoss(ctx, fused)
            specs = layer_specs(config, ctx, 0, loss_fn)
            tied = PipelineLayout.of(config).tied
            layer = specs[0].build() if tied else specs[-1].build()
            x = seq_part(hidden, c, sp).clone().requires_grad_()
            out = lm_head_forward(layer, x) if tied else layer(x)
            hooks = prologue_clears_grads(layer, out)  # noqa: F841 - the hooks live as long as this reference
            loss = loss_fn(out, labels)
            loss.backward()
            weight = next(p for p in layer.parameters())
            with loss_fn.emitting_logits():
                logits = lm_head_forward(layer, x) if tied else layer(x)
            results.append((loss, x.grad, weight.grad, out[0].shape if fused else out.shape, logits))
        (ref_loss, ref_gx, ref_gw, ref_shape, ref_logits), (loss, gx, gw, shape, logits) = results
        return [
            ("loss", loss, ref_loss, TOL[torch.float32]),
            ("hidden grad", gx, ref_gx, TOL[torch.float32]),
            ("output weight grad", gw, ref_gw, TOL[torch.float32]),
            ("fused: the output layer hands over its input", torch.tensor(shape), torch.tensor(x.shape), 0.0),
            (
                "weight grad not cleared by the prologue",
                torch.tensor(bool(gw.abs().max() > 0)),
                torch.tensor(True),
                0.0,
            ),
            ("unfused: logits", torch.tensor(ref_shape), torch.tensor(ref_logits.shape), 0.0),
            ("emitting_logits: the same logits", logits, ref_logits, 0.0),
        ]

    return run


CASES = {
    f"{'tied' if tied else 'untied'}-v{vocab}-{dt}-{'sp' if sp else 'nosp'}": check_layer(vocab, sp, tied, DTYPES[dt])
    for tied in (True, False)
    for vocab in VOCABS
    for dt in DTYPES
    for sp in (False, True)
    if dt != "fp16" or vocab == VOCABS[0]
}
CASES.update(
    {f"pipeline-{f}-{'sp' if sp else 'nosp'}": check_pipeline(f, sp) for f in FAMILIES for sp in (False, True)}
)


def run_rank(group: ProcessGroup | None, rank: int, world: int) -> dict[str, str]:
    return run_checks({k: v for k, v in CASES.items() if world > 1 or not k.endswith("-sp")}, Ctx(group, rank, world))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def reports(request):
    return request.param, spawn_reports(run_rank, request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_loss_equals_unfused(reports, case):
    world, reps = reports
    if world == 1 and case.endswith("-sp"):
        pytest.skip("SP needs a TP group of two or more")
    msg = failures(reps, case, f"tp {world}")
    assert not msg, msg


def test_chunk_rule_keeps_fp32_logits_within_the_budget():
    """128 MiB of fp32 logits per chunk: 523 tokens at V_pad/t 64,128, at least one token at any vocabulary."""
    assert chunk_tokens(64_128) == 523 and 523 * 64_128 * 4 <= 128 * 2**20 < 524 * 64_128 * 4
    assert chunk_tokens(10**9) == 1


def test_dh_operand_is_the_weight_in_column_major_order_on_cpu():
    """dh = D W gets W's own values, laid out column-major on CPU (oneDNN's fast layout for that GEMM)."""
    weight = torch.randn(12, 4, dtype=torch.bfloat16)
    operand = dh_operand(weight)
    assert torch.equal(operand, weight) and operand.shape == weight.shape and operand.stride() == (1, 12)
    weight32, grad = weight.float(), torch.randn(5, 12)
    torch.testing.assert_close(grad.matmul(dh_operand(weight32)), grad.matmul(weight32))  # fp32 summation order


def test_fused_loss_without_grad_computes_the_loss_only():
    """Evaluation (no_grad): the same loss, and no gradient work saved for a backward that never comes."""
    c = Ctx(None, 0, 1)
    layer = make_layer(c, 1001, False, False, torch.float32)
    x, target = torch.randn(S, B, H), torch.randint(0, 1001, (S, B))
    with torch.no_grad():
        fused = layer.fused_loss(x, target, chunk=CHUNK)
        ref = F.cross_entropy(F.linear(x, layer.weight)[..., :1001].flatten(0, 1), target.flatten())
    assert fused.grad_fn is None
    torch.testing.assert_close(fused, ref, atol=2e-6, rtol=2e-6)
