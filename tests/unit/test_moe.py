"""The MoE families (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers' ``Qwen3MoeForCausalLM``,
``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (its shared expert, sigmoid gate and q/k/v biases).

Same weights (our state dict loads into transformers with no key map), fp32, dropless: logits, the LM loss, the
load-balancing loss and every gradient of ``lm + router_aux_loss_coef * aux`` within 1e-5, through the grouped GEMM
and the per-expert loop; a router that sends most tokens to one expert and none to another (whose gradient is then
present and zero); dense layers by ``mlp_only_layers`` and ``decoder_sparse_step``; the z-loss; the configs' rules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_megatron.model import FAMILIES, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, build_model, family_of
from ds_megatron.model.moe_layer import RouterStats, SparseMoeBlock, load_balancing_loss
from ds_megatron.model.qwen3_moe.model import router_losses, training_loss

V, B, S = 128, 2, 16
SMALL = dict(vocab_size=V, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)


def qwen3(**kw) -> Qwen3MoeConfig:
    # layer 0 dense by mlp_only_layers (and layers 0 and 2 off a decoder_sparse_step of 2 where one is given)
    base = dict(SMALL, num_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=4)
    base.update(num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=(0,))
    base.update(router_aux_loss_coef=0.1)
    return Qwen3MoeConfig(**{**base, **kw})


def mixtral(**kw) -> MixtralConfig:
    base = dict(SMALL, num_layers=2, intermediate_size=32, moe_intermediate_size=32, num_experts=4)
    return MixtralConfig(**{**base, "router_aux_loss_coef": 0.1, **kw})


def qwen2(**kw) -> Qwen2MoeConfig:
    # layer 0 dense; a shared expert of width 48 beside 4 routed experts of 32, top 2 not renormalised
    base = dict(SMALL, num_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=4)
    base.update(shared_expert_intermediate_size=48, num_experts_per_tok=2, mlp_only_layers=(0,))
    return Qwen2MoeConfig(**{**base, "router_aux_loss_coef": 0.1, **kw})


CONFIGS = {
    "qwen3": lambda: qwen3(),
    "qwen3-normalised-head32": lambda: qwen3(norm_topk_prob=True, head_dim=32, num_experts_per_tok=3),
    "qwen3-step2": lambda: qwen3(decoder_sparse_step=2, mlp_only_layers=()),
    "mixtral": lambda: mixtral(),
    "qwen2": lambda: qwen2(),
    "qwen2-normalised-step2": lambda: qwen2(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=()),
}


def pair(cfg, gemm: str):
    import transformers

    ours = build_model(cfg, seed=5)
    for module in ours.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts.gemm = gemm
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: give them values that the comparison sees
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    hf = getattr(transformers, family_of(cfg).hf_architecture)(cfg.to_hf())
    hf.load_state_dict(ours.state_dict(), strict=True)  # the identity key map
    return ours, hf


def skew_router(model, constant: float = 3.0) -> None:
    """Hidden coordinate 0 large and positive for every token (a constant embedding column), and every router's
    expert 0 weighted on it, the last expert against it: most tokens' first choice is expert 0, none picks the
    last expert (its softmax probability underflows to 0)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = constant
        for block in model.model.layers:
            if block.sparse:
                block.mlp.gate.weight[:, 0] = 0.0
                block.mlp.gate.weight[0, 0] = 5.0
                block.mlp.gate.weight[-1, 0] = -50.0


def run_both(ours, hf, cfg, ids):
    logits, stats = ours(ids, return_router_stats=True)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss = training_loss(lm, stats, cfg)
    loss.backward()
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return logits, lm, loss, stats, out


def assert_same(ours, hf, cfg, ids):
    logits, lm, loss, stats, out = run_both(ours, hf, cfg, ids)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, out.logits, **close)
    aux, _ = router_losses(stats)
    torch.testing.assert_close(aux, out.aux_loss, **close)
    torch.testing.assert_close(loss, out.loss, **close)
    torch.testing.assert_close(lm, out.loss - cfg.router_aux_loss_coef * out.aux_loss, **close)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and theirs[name].grad is not None, name
        torch.testing.assert_close(p.grad, theirs[name].grad, **close, msg=name)
    return stats


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_losses_and_gradients_equal_transformers(name, gemm):
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    ours, hf = pair(cfg, gemm)
    ids = torch.randint(0, V, (B, S))
    stats = assert_same(ours, hf, cfg, ids)
    sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
    assert stats.rows.item() == len(sparse) * B * S  # the dense layers route nothing
    assert [b.sparse for b in ours.model.layers] == [cfg.is_sparse(i) for i in range(cfg.num_layers)]
    assert 0 < len(sparse) < cfg.num_layers or name == "mixtral"


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_uneven_router_and_an_expert_without_tokens(name, gemm):
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    ours, _ = pair(cfg, gemm)
    skew_router(ours)
    hf = getattr(__import__("transformers"), family_of(cfg).hf_architecture)(cfg.to_hf())
    hf.load_state_dict(ours.state_dict(), strict=True)
    stats = assert_same(ours, hf, cfg, torch.randint(0, V, (B, S)))
    counts = stats.counts.tolist()
    assert counts[0] == stats.rows.item() and counts[-1] == 0, counts  # every token's first choice, and nobody's
    for block in ours.model.layers:
        if block.sparse:
            grad = block.mlp.experts.gate_up_proj.grad
            assert grad[-1].abs().max().item() == 0.0 and grad[0].abs().max().item() > 0.0
            assert block.mlp.experts.down_proj.grad[-1].abs().max().item() == 0.0


def test_grouped_gemm_equals_the_loop_in_bf16():
    torch.manual_seed(0)
    block = SparseMoeBlock(64, 32, 8, 2, norm_topk_prob=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    block = block.to(torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    results = []
    for kind in ("grouped", "loop"):
        block.experts.gemm = kind
        xi = x.clone().requires_grad_()
        out, _ = block(xi)
        out.sum().backward()  # an expanded gradient: grouped_mm's backward needs it made contiguous
        results.append((out, xi.grad, block.experts.gate_up_proj.grad.clone()))
        block.zero_grad()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def _autograd_combine(out, weights, token, n):
    """The combine as plain autograd operations (``moe_layer.weighted_sum`` before its own backward): the
    reference ``weighted_sum`` is held to, bit for bit."""
    scaled = out.float() * weights[:, None]
    combined = torch.zeros(n, out.shape[-1], dtype=torch.float32, device=out.device).index_add(0, token, scaled)
    return combined.to(out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sum_keeps_one_copy_of_the_outputs_and_equals_autograd_bit_for_bit(dtype, monkeypatch):
    """``weighted_sum`` against the same operations under plain autograd: its output and the gradients of the
    expert outputs and routing weights the same bits (fp32 and bf16; tokens out of order, a token with a dropped
    pair); what it keeps for backward: the outputs in their own dtype, the weights and the token index, where
    autograd keeps two fp32 copies of the outputs.  Then a whole block (capacity drops on) through each: the same
    output and the same gradient of the input and of every parameter."""
    from ds_megatron.model import moe_layer

    torch.manual_seed(0)
    n, k, h = 7, 3, 16
    token = torch.randperm(n * k)[: n * k - 2] // k  # two pairs dropped, the rest in no particular order
    m = token.numel()
    out = torch.randn(m, h).to(dtype)
    weights = torch.rand(m)
    upstream = torch.randn(n, h).to(dtype)
    results, kept = [], []
    for combine in (moe_layer.weighted_sum, _autograd_combine):
        o, w = out.clone().requires_grad_(), weights.clone().requires_grad_()
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = combine(o, w, token, n)
        y.backward(upstream)
        results.append((y, o.grad, w.grad))
        kept.append(sum(seen.values()))
    for ours, reference in zip(*results, strict=True):
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)
    act = out.element_size()
    assert kept == [m * h * act + m * 4 + m * 8, 2 * m * h * 4 + m * 4 + m * 8]

    block = SparseMoeBlock(32, 16, 6, 2, norm_topk_prob=True, capacity_factor=1.0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    block = block.to(dtype).train()
    x = torch.randn(2, 9, 32).to(dtype)
    runs = []
    for combine in (moe_layer.weighted_sum, _autograd_combine):
        monkeypatch.setattr(moe_layer, "weighted_sum", combine)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        y, stats = block(xi)
        (y.float().square().sum() + stats.probs.square().sum()).backward()
        runs.append([y, xi.grad, *(p.grad.clone() for p in block.parameters())])
    for ours, reference in zip(*runs, strict=True):
        assert torch.equal(ours, reference)


def test_router_runs_in_fp32_for_bf16_activations():
    torch.manual_seed(0)
    block = SparseMoeBlock(64, 32, 8, 2, norm_topk_prob=True).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.1)
    weights, experts, stats = block.gate(torch.randn(10, 64, dtype=torch.bfloat16))
    assert weights.dtype == stats.probs.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))


def test_z_loss_and_its_coefficient():
    torch.manual_seed(0)
    cfg = qwen3(router_z_loss_coef=0.01)
    model = build_model(cfg, seed=5)
    ids = torch.randint(0, V, (B, S))
    logits, stats = model(ids, return_router_stats=True)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    aux, z = router_losses(stats)
    # the z-loss by its definition: logsumexp of each routed layer's logits, squared, averaged over tokens and layers
    expected, rows = 0.0, 0
    x_per_layer = []
    for block in model.model.layers:
        if block.sparse:
            block.mlp.gate.register_forward_hook(lambda m, i, o: x_per_layer.append(i[0]))
    model(ids)
    for block, x in zip([b for b in model.model.layers if b.sparse], x_per_layer, strict=True):
        lse = torch.logsumexp(F.linear(x.float(), block.mlp.gate.weight), -1)
        expected, rows = expected + lse.square().sum(), rows + lse.numel()
    torch.testing.assert_close(z, expected / rows)
    torch.testing.assert_close(training_loss(lm, stats, cfg), lm + 0.1 * aux + 0.01 * z)


def test_load_balancing_loss_sums_layers_before_the_product():
    one = RouterStats(torch.tensor([2.0, 0.0]), torch.tensor([0.75, 0.25]), torch.tensor(1.0), torch.tensor(0.0))
    two = RouterStats(torch.tensor([0.0, 2.0]), torch.tensor([0.25, 0.75]), torch.tensor(1.0), torch.tensor(0.0))
    # per layer 2 * (2 * 0.75) = 3 each; over both layers' sums 2 * (1 * 0.5 + 1 * 0.5) = 2 (transformers' rule)
    assert load_balancing_loss(one).item() == 3.0
    assert load_balancing_loss(one + two).item() == 2.0


def test_hf_config_round_trip_and_refusals():
    from transformers import MixtralConfig as HFMixtral
    from transformers import Qwen2MoeConfig as HFQwen2
    from transformers import Qwen3MoeConfig as HFQwen3

    for cfg in (qwen3(), qwen3(decoder_sparse_step=2, mlp_only_layers=(1, 3)), mixtral(), qwen2()):
        assert type(cfg).from_hf(cfg.to_hf()) == cfg
    for flag in (dict(qkv_bias=False), dict(use_sliding_window=True)):
        with pytest.raises(ValueError, match=next(iter(flag))):
            Qwen2MoeConfig.from_hf(HFQwen2(**flag))
    with pytest.raises(ValueError, match="head_dim"):
        qwen2(head_dim=32)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        qwen2(shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match="sliding_window"):
        MixtralConfig.from_hf(HFMixtral(sliding_window=4096))
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3MoeConfig.from_hf(HFQwen3(use_sliding_window=True))
    with pytest.raises(ValueError, match="mixtral fixes"):
        mixtral(norm_topk_prob=False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        qwen3(num_experts_per_tok=5)


def test_named_sizes_build_their_configs():
    from ds_megatron.config import resolve_shape
    from ds_megatron.config.schema import ModelSection
    from ds_megatron.model import model_config

    for family in ("qwen3_moe", "mixtral", "qwen2_moe"):
        for size, shape in FAMILIES[family].sizes.items():
            fields = dict(shape.family_fields)
            resolved = resolve_shape(ModelSection(size=size, vocab_size=500, seq_length=32))
            cfg = model_config(resolved)
            assert resolved.size == size and type(cfg) is FAMILIES[family].config, size
            head_dim = fields.get("head_dim") or shape.hidden_size // shape.num_heads  # Qwen2-MoE: h / a
            assert cfg.num_experts == fields["num_experts"] and cfg.head_dim == head_dim, size
            assert cfg.num_experts_per_tok == fields["num_experts_per_tok"], size
            assert cfg.mlp_only_layers == tuple(fields["mlp_only_layers"]), size
            shared = fields.get("shared_expert_intermediate_size", 0)
            assert resolved.shared_expert_intermediate_size == shared, size
            assert getattr(cfg, "shared_expert_intermediate_size", 0) == shared, size


def test_expert_fields_override_the_named_size_and_drop_it():
    from ds_megatron.config import resolve_shape
    from ds_megatron.config.schema import ModelSection

    base = dict(size="moe-tiny", vocab_size=500, seq_length=32)
    shape = resolve_shape(ModelSection(**base, num_experts=16, experts_per_token=4, router_z_loss_coef=0.001))
    assert (shape.num_experts, shape.experts_per_token, shape.router_z_loss_coef) == (16, 4, 0.001)
    assert shape.size is None  # another architecture than the named size's
    # the losses' weights are not the architecture: the size is kept
    assert resolve_shape(ModelSection(**base, router_aux_loss_coef=0.1)).size == "moe-tiny"
    # no size: the layout from the fields, the rest from their defaults
    explicit = dict(family="qwen3_moe", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=96)
    layout = dict(num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    shape = resolve_shape(ModelSection(**explicit, vocab_size=100, seq_length=16, **layout))
    assert (shape.head_dim, shape.norm_topk_prob, shape.decoder_sparse_step, shape.mlp_only_layers) == (16, True, 1, ())


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(size="llama-tiny", num_experts=8),
            "error: ds_megatron.model.num_experts: applies to the mixture-of-experts families (qwen3_moe, mixtral, "
            "qwen2_moe) only (family=llama, num_experts set); remove it or set model.family to one of qwen3_moe, "
            "mixtral, qwen2_moe",
        ),
        (
            dict(size="moe-tiny", experts_per_token=9),
            "error: ds_megatron.model.experts_per_token: must be 1..num_experts (experts_per_token=9, num_experts=8); "
            "use 1..8",
        ),
        (dict(size="moe-tiny", num_experts=0), "error: ds_megatron.model.num_experts: must be a positive integer"),
        (dict(size="moe-tiny", mlp_only_layers=(4,)), "layer indices out of range (got [4], num_layers=4)"),
        (dict(size="moe-tiny", router_aux_loss_coef=-1.0), "error: ds_megatron.model.router_aux_loss_coef: must be"),
        (dict(size="moe-tiny", head_dim=33), "error: ds_megatron.model.head_dim: must be positive and even"),
        (
            dict(size="mixtral-8x7b", norm_topk_prob=False),
            "error: ds_megatron.model.norm_topk_prob: the mixtral family fixes it (norm_topk_prob=False, mixtral has "
            "True)",
        ),
        (
            dict(size="moe-tiny", shared_expert_intermediate_size=64),
            "error: ds_megatron.model.shared_expert_intermediate_size: the qwen3_moe family fixes it "
            "(shared_expert_intermediate_size=64, qwen3_moe has 0); remove it (or use a family that sets it: "
            "qwen2_moe)",
        ),
        (
            dict(size="qwen2-moe-tiny", hidden_size=128, head_dim=16),
            "error: ds_megatron.model.head_dim: the qwen2_moe family's heads are hidden_size / num_heads wide "
            "(head_dim=16, hidden_size=128, num_heads=4); remove it",
        ),
        (
            dict(size="qwen2-moe-tiny", shared_expert_intermediate_size=0),
            "error: ds_megatron.model.shared_expert_intermediate_size: must be a positive integer (got 0, "
            "family=qwen2_moe",
        ),
        (
            dict(family="qwen3_moe", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=96),
            "error: ds_megatron.model.num_experts: not set (family=qwen3_moe, no size gives it)",
        ),
    ],
)
def test_expert_field_refusals(fields, message):
    from ds_megatron.config import ConfigError, resolve_shape
    from ds_megatron.config.schema import ModelSection

    with pytest.raises(ConfigError) as err:
        resolve_shape(ModelSection(vocab_size=500, seq_length=32, **fields))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_training_layout_refusals():
    from ds_megatron.config import ConfigError, resolve

    def run(tp=1, **section):
        model = {"size": "moe-tiny", "vocab_size": 500, "seq_length": 32, **section.pop("model", {})}
        return {"train_batch_size": 2, "ds_megatron": {"model": model, "parallel": {"tp": tp}, **section}}

    with pytest.raises(ConfigError, match="moe_intermediate_size not divisible by tp"):
        resolve(run(tp=2, model={"moe_intermediate_size": 63, "num_kv_heads": 2}), 2)
    with pytest.raises(ConfigError, match="moe recomputes the routed experts' activations, and this model has none"):
        resolve(run(model={"size": "llama-tiny"}, recompute={"policy": "selective", "modules": ["moe"]}), 1)
    assert resolve(run(recompute={"policy": "selective", "modules": ["moe"]}), 1).section.recompute.modules == ("moe",)


def test_moe_recompute_keeps_only_the_experts_inputs_and_replays_them_exactly():
    """Selective recompute of ``moe``: the experts' activations (the routed copies of the tokens, gate and up,
    SwiGLU's output, the expert outputs) are not stored; backward recomputes them and the gradients are the
    stored run's, bit for bit."""
    import functools

    from ds_megatron.recompute import checkpoint
    from ds_megatron.tensor_parallel.experts import TensorParallelExperts
    from ds_megatron.topology import Group

    torch.manual_seed(0)
    block = SparseMoeBlock(64, 32, 4, 2, True)
    torch.nn.init.normal_(block.experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(block.experts.down_proj, std=0.1)
    torch.nn.init.normal_(block.gate.weight, std=0.1)
    x = torch.randn(48, 64)

    def run(recompute):
        experts = TensorParallelExperts(block.experts, Group(), recompute=recompute)
        inp = x.clone().requires_grad_()
        weights, chosen, _ = block.gate(inp)
        saved = []
        pack = lambda t: saved.append(t.numel() * t.element_size()) or t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = experts(inp, weights, chosen)
        out.square().sum().backward()
        return sum(saved), inp.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    stored, *grads = run(None)
    kept, *again = run(functools.partial(checkpoint, rng=None))
    assert kept < stored / 4, (kept, stored)  # the inputs (tokens [n, h], weights [n, k]) against every activation
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "size, published",
    # the model cards' "active" (Qwen1.5-MoE-A2.7B: 2.7B; Qwen2-57B-A14B: 14B, the shared experts included)
    [("qwen3-30b-a3b", 3.3e9), ("qwen3-235b-a22b", 22e9), ("mixtral-8x7b", 12.9e9)]
    + [("qwen1.5-moe-a2.7b", 2.7e9), ("qwen2-57b-a14b", 14e9)],
)
def test_model_flops_count_the_published_active_parameters(size, published):
    """MFU of a mixture of experts is on active parameters: at one token (no s^2 term to speak of) the model FLOPs
    are 6 x the active parameters less the embedding table, which the model cards count in."""
    from ds_megatron.config import resolve_shape
    from ds_megatron.config.schema import ModelSection
    from ds_megatron.flops import block_fields, model_flops_per_step

    shape = resolve_shape(ModelSection(size=size))
    flops = model_flops_per_step(1, 1, shape.num_layers, shape.hidden_size, shape.vocab_size, **block_fields(shape))
    active = flops / 6 + shape.vocab_size * shape.hidden_size
    assert abs(active - published) / published < 0.02, (size, active)


def test_log_line_shows_the_router_losses_and_loads():
    from ds_megatron.metrics import format_record

    record = dict(step=3, loss=6.9, lr=1e-3, grad_norm=1.0, tokens_per_s=100.0, tflops_per_gpu=0.1, step_ms=10.0)
    record.update(mfu=0.4, hfu=0.5, lm_loss=6.88, aux_loss=2.0053, expert_load_min=0.84, expert_load_max=1.15)
    line = format_record(record, 10)
    assert "| lm 6.8800 aux 2.0053 | expert load 0.84-1.15 |" in line
    assert "MFU 40.0% HFU 50.0% (active parameters)" in line


def test_boundary_tensor_partitioning_is_off_at_tp_above_1():
    """The routing statistics cross stage boundaries with a gradient, which DeepSpeed's TP partitioning of boundary
    tensors refuses (it allows one such tensor): off for a routed family at tp > 1, SP or not."""
    from ds_megatron.config import resolve
    from ds_megatron.engine import deepspeed_config_for

    def ds(tp, size="moe-tiny"):
        model = {"size": size, "vocab_size": 500, "seq_length": 32}
        cfg = {"train_batch_size": 2, "ds_megatron": {"model": model, "parallel": {"tp": tp, "pp": 2}}}
        notes: list[str] = []
        return deepspeed_config_for(resolve(cfg, 2 * tp), notes).get("pipeline", {}), notes

    pipe, notes = ds(2)
    assert pipe == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "mixture of experts: pipeline.pipe_partitioned and grad_partitioned turned off" in notes
    assert ds(1)[0] == {} and ds(2, "llama-tiny")[0] == {}


def test_resume_refuses_another_expert_layout_and_takes_another_top_k(monkeypatch, tmp_path):
    from ds_megatron.checkpoint import manifest
    from ds_megatron.config import ConfigError, resolve
    from ds_megatron.preflight import check_resume_shape

    def cfg(**model):
        section = {"model": {"size": "moe-tiny", "vocab_size": 500, "seq_length": 32, **model}}
        return resolve({"train_batch_size": 2, "ds_megatron": section}, 1)

    monkeypatch.setattr(manifest, "tag_config", lambda load, tag: cfg().ds_config)
    check_resume_shape(cfg(experts_per_token=3, router_aux_loss_coef=0.1), tmp_path, "step00000002")
    with pytest.raises(ConfigError) as err:
        check_resume_shape(cfg(num_experts=16), tmp_path, "step00000002")
    assert "checkpoint model shape does not match the config (num_experts) (num_experts=8 in" in str(err.value)
