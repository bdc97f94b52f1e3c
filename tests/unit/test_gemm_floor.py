"""The benchmarks' own pieces at tiny shapes, in-process: gemm_floor.py's recorder sees every matmul and attention
call of a training step (forward and backward), the replay runs them and the per-op CPU timer stays within the
step; throughput_peers.py's PyTorch-native TP + SP peer computes the unsharded model's loss at tp 2 (gloo);
dh_layout.py's two layouts compute the same loss and gradients."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ds_megatron.model import LlamaConfig
from ds_megatron.model.llama.model import Llama

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))

import gemm_floor  # noqa: E402

aten = torch.ops.aten


def test_floor_records_replays_and_accounts_for_a_tiny_step():
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        max_position_embeddings=16,
        rope_theta=10000.0,
        attention="sdpa",
    )
    model = Llama(cfg, seed=0).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 16))

    def step():
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()

    recorder = gemm_floor.RecordCompute()
    with recorder:
        step()
    ops = [f for f, _, _ in recorder.calls]
    linears = 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, then the output layer
    # forward x W^T, backward dX and dW: three matmuls per linear (the embedding's gradient is no matmul)
    assert sum(f in gemm_floor.MATMUL for f in ops) == 3 * linears, ops
    assert ops.count(aten._scaled_dot_product_flash_attention_for_cpu.default) == cfg.num_layers
    assert ops.count(aten._scaled_dot_product_flash_attention_for_cpu_backward.default) == cfg.num_layers
    assert recorder.skipped == 0
    # 2 m n k each: 3 matmuls of [b s = 32 tokens] x in x out per linear (q, k, v, o, gate, up, down; the output)
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48
    assert gemm_floor.gemm_flops(recorder.calls) == 3 * 2 * 32 * (2 * per_layer + 32 * 128)
    cpu, wall = gemm_floor.replay(recorder.calls, repeats=1)
    assert 0 < cpu and 0 < wall
    groups, step_cpu, _, top = gemm_floor.breakdown(step)
    assert set(groups) == set(gemm_floor.GROUPS)
    assert groups["matmuls"] > 0 and groups["attention"] > 0
    assert sum(groups.values()) <= step_cpu * 1.001 + 1e-6
    assert top and all(seconds >= 0 for _, seconds, *_ in top)  # the largest ops by CPU time, largest first
    assert [e[1] for e in top] == sorted((e[1] for e in top), reverse=True)


def _peer_rank(group, rank: int, world: int) -> dict[str, str]:
    """The PyTorch-native TP + SP peer of throughput_peers.py at tp 2 (sdpa, per-layer checkpointing), tiny shape:
    its first training step's loss equals the unsharded transformers model's on the same weights and tokens."""
    import argparse

    import throughput_peers

    args = argparse.Namespace(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, seq=16, batch=1, vocab=128)
    initial = throughput_peers.reference_state

    def sharper(args, kernel):
        """The initial weights x 30 (norms kept): logits far from uniform, so a wrong position, mask or shard
        shows in the loss instead of hiding under ln V."""
        state, config = initial(args, kernel)
        return {k: v if k.endswith("norm.weight") else 30 * v for k, v in state.items()}, config

    throughput_peers.reference_state = sharper
    x, y = throughput_peers.batches(args, 1)[0]
    report = {}
    try:
        for kernel in ("sdpa",):
            try:
                peer = throughput_peers.TorchTP(args, kernel, "full")
                whole = throughput_peers.hf_llama(args, kernel).to(torch.bfloat16)
                expected = F.cross_entropy(whole(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
                loss = peer.train_step(x, y)
                # bf16 on both sides, different op order: 0.02 apart; reversed positions put them 1.3 apart
                ok = abs(loss - float(expected)) < 0.1
                report[kernel] = "ok" if ok else f"loss {loss} != {float(expected)}"
            except Exception as e:  # reported per kernel, never left hanging in a collective
                report[kernel] = repr(e)
    finally:  # the rank runs other tests' checks afterwards (the session's pool): leave the module as found
        throughput_peers.reference_state = initial
    return report


def test_pytorch_native_peer_trains_tiny_at_tp2():
    from inprocess import spawn_reports

    reports = spawn_reports(_peer_rank, 2)
    assert all(r == {"sdpa": "ok"} for r in reports), reports


def test_dh_layout_compares_the_same_gradients_in_both_layouts():
    """dh_layout.py's A/B: each loss path run with W as stored and with the column-major copy gives the loss and
    gradients of the plain path (the same products; bit-equal on the hosts measured, to rounding here), and the
    fused variant leaves the package's dh_operand as it found it."""
    import dh_layout

    from ds_megatron.tensor_parallel import fused_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(24, 1, 16, dtype=torch.bfloat16)
    weight = (torch.randn(40, 16) * 0.25).to(torch.bfloat16)
    target = torch.randint(0, 40, (24, 1))
    shipped = fused_cross_entropy.dh_operand
    for path in (dh_layout.unfused, dh_layout.fused):
        _, (loss_a, dh_a, dw_a) = dh_layout.run(path, hidden, weight, target, False)
        _, (loss_b, dh_b, dw_b) = dh_layout.run(path, hidden, weight, target, True)
        assert fused_cross_entropy.dh_operand is shipped
        assert torch.equal(loss_a, loss_b) and torch.equal(dw_a, dw_b)
        torch.testing.assert_close(dh_a, dh_b, rtol=0, atol=2**-8 * dh_a.abs().max().item())
    h = hidden.float().requires_grad_()
    w = weight.float().requires_grad_()
    F.cross_entropy(F.linear(h, w).flatten(0, 1), target.flatten()).backward()
    _, (loss, dh, dw) = dh_layout.run(dh_layout.unfused, hidden, weight, target, True)
    reference = F.cross_entropy(F.linear(h, w).flatten(0, 1), target.flatten()).detach()
    torch.testing.assert_close(loss, reference, rtol=1e-3, atol=0)  # bf16 logits against fp32 ones
    torch.testing.assert_close(dh.float(), h.grad, rtol=0.02, atol=1e-3)
    torch.testing.assert_close(dw.float(), w.grad, rtol=0.02, atol=1e-3)
