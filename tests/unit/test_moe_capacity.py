"""The optional capacity factor of the routed MLP (``model.moe_capacity_factor``): each expert takes at most
ceil(c n k / E) of the pairs a layer routes in one call, the most probable ones, in training mode only; against a
per-token reference written out here, forward and backward; the setting's rules.  The expert-parallel layer with a
capacity (each rank's tokens their own group) is checked in ``test_expert_parallel.py``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds_megatron.config import ConfigError
from ds_megatron.config.schema import ModelSection
from ds_megatron.config.shape import resolve_shape
from ds_megatron.model import build_model, model_config
from ds_megatron.model.moe_layer import SparseMoeBlock, expert_capacity

H, FFN, E, K, N = 32, 16, 4, 2, 24


def block(capacity: float) -> SparseMoeBlock:
    torch.manual_seed(0)
    b = SparseMoeBlock(H, FFN, E, K, norm_topk_prob=True, capacity_factor=capacity)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0.0, 0.3)
        b.gate.weight[0] += 1.0  # expert 0 wanted by most tokens, so its capacity binds
    return b


def tokens() -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(N, H)
    x[:, 0] = 0.0
    return x + 0.3


def run(b: SparseMoeBlock, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out, stats = b(x)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    grads = [x.grad, *(p.grad.clone() for p in b.parameters())]
    b.zero_grad()
    return out.detach(), stats, grads


def reference(b: SparseMoeBlock, x: torch.Tensor, capacity: int):
    """Token by token: the router's top k, each expert's pairs ranked by router probability (earlier token first on
    a tie), the first ``capacity`` kept; a kept pair adds weight x SwiGLU_e(x_t)."""
    x = x.clone().requires_grad_()
    probs = torch.softmax(F.linear(x.float(), b.gate.weight.float()), -1)
    top, chosen = torch.topk(probs, K, -1)
    weights = top / top.sum(-1, keepdim=True)
    pairs = sorted(
        ((e, -top[t, j].item(), t * K + j, t, j) for t in range(N) for j, e in enumerate(chosen[t].tolist()))
    )
    taken: dict[int, int] = {}
    rows = [torch.zeros(H) for _ in range(N)]
    for e, _, _, t, j in pairs:
        taken[e] = taken.get(e, 0) + 1
        if taken[e] > capacity:
            continue
        gate, up = F.linear(x[t], b.experts.gate_up_proj[e]).chunk(2)
        rows[t] = rows[t] + weights[t, j] * F.linear(F.silu(gate) * up, b.experts.down_proj[e])
    out = torch.stack(rows)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    grads = [x.grad, *(p.grad.clone() for p in b.parameters())]
    b.zero_grad()
    return out.detach(), grads, taken


def test_capacity_is_ceil_c_n_k_over_e():
    assert expert_capacity(24, 2, 4, 1.0) == 12 and expert_capacity(24, 2, 4, 0.3) == math.ceil(0.3 * 12)
    assert expert_capacity(5, 2, 8, 0.5) == 1


def test_each_expert_keeps_its_most_probable_pairs_forward_and_backward():
    b, x = block(0.5), tokens()
    capacity = expert_capacity(N, K, E, 0.5)  # 6 of the 48 pairs per expert
    out, stats, grads = run(b, x)
    ref_out, ref_grads, taken = reference(b, x, capacity)
    assert max(taken.values()) > capacity, "expert 0's capacity binds: pairs are dropped"
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    _, chosen, _ = b.gate(x)
    kept = torch.bincount(chosen.reshape(-1), minlength=E + 1)
    assert kept[:E].tolist() == [min(taken.get(e, 0), capacity) for e in range(E)]
    assert stats.counts.tolist() == [float(taken.get(e, 0)) for e in range(E)], "the statistics count the choices"


def test_a_capacity_every_pair_fits_changes_nothing_and_evaluation_is_dropless():
    x = tokens()
    dropless = run(block(0.0), x)
    roomy = run(block(E / K), x)  # C = n: no expert can overflow
    for a, b in zip([dropless[0], *dropless[2]], [roomy[0], *roomy[2]], strict=True):
        assert torch.equal(a, b)
    tight = block(0.5).eval()
    with torch.no_grad():
        assert torch.equal(tight(x)[0], block(0.0)(x)[0])


def shape(**model):
    return resolve_shape(ModelSection(**{"vocab_size": 1024, "seq_length": 128, **model}))


@pytest.mark.parametrize(
    "model, message",
    [
        ({"size": "moe-tiny", "moe_capacity_factor": -1.0}, r"moe_capacity_factor.*must be a number >= 0.*got -1.0"),
        ({"size": "gpt-tiny", "moe_capacity_factor": 1.25}, r"moe_capacity_factor.*mixture-of-experts families"),
    ],
)
def test_the_setting_is_checked(model, message):
    with pytest.raises(ConfigError, match=message):
        shape(**model)


def test_the_setting_reaches_the_model_and_not_transformers_config():
    config = model_config(shape(size="moe-tiny", moe_capacity_factor=1.25))
    routers = [m.gate for m in build_model(config, seed=0).modules() if isinstance(m, SparseMoeBlock)]
    assert routers and all(r.capacity_factor == 1.25 for r in routers)
    assert shape(size="moe-tiny").moe_capacity_factor == 0.0  # dropless unless set
    assert not hasattr(config.to_hf(), "moe_capacity_factor")
