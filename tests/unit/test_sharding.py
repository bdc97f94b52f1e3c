"""Shard rules: shard/unshard round trips, fused QKV split by heads, vocabulary padding."""

from __future__ import annotations

import torch
from tiny import tiny_gpt, tiny_llama

from ds_megatron.model import GPTConfig
from ds_megatron.parallelize import ParallelContext, shard_rule
from ds_megatron.tensor_parallel import ShardRule, padded_vocab_size, shard, unshard
from ds_megatron.topology import Group


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 1, 128) == 50304
    assert padded_vocab_size(50257, 8, 128) == 51200
    assert padded_vocab_size(1001, 2, 128) == 1024
    assert padded_vocab_size(1024, 2, 128) == 1024


def test_qkv_shard_takes_the_same_heads_of_q_k_and_v():
    h, heads, tp = 8, 4, 2
    head_dim = h // heads
    # Row i of the fused weight belongs to (q|k|v) block i // h, head (i % h) // head_dim.
    full = torch.arange(3 * h).float().unsqueeze(1).repeat(1, h)
    for rank in range(tp):
        part = shard(full, ShardRule(dim=0, fused=3), rank, tp)
        rows = part[:, 0].long()
        blocks = rows // h
        local_heads = (rows % h) // head_dim
        assert blocks.tolist() == [0] * (h // tp) + [1] * (h // tp) + [2] * (h // tp)
        assert set(local_heads.tolist()) == set(range(rank * heads // tp, (rank + 1) * heads // tp))


def test_round_trip_every_rule():
    plan = ParallelContext(GPTConfig(vocab_size=1001, n_embd=16, n_head=4, n_layer=1), Group(size=4), False, None)
    shapes = {
        "transformer.h.0.attn.c_attn.weight": (48, 16),
        "transformer.h.0.attn.c_attn.bias": (48,),
        "transformer.h.0.attn.c_proj.weight": (16, 16),
        "transformer.h.0.attn.c_proj.bias": (16,),
        "transformer.h.0.mlp.c_fc.weight": (64, 16),
        "transformer.h.0.mlp.c_proj.weight": (16, 64),
        "transformer.h.0.ln_1.weight": (16,),
        "transformer.wte.weight": (1001, 16),
    }
    for name, shape in shapes.items():
        full = torch.randn(shape)
        rule = shard_rule(name, plan)
        parts = [shard(full, rule, r, 4) for r in range(4)]
        assert torch.equal(unshard(parts, rule, full.shape[rule.dim] if rule.dim is not None else None), full), name
    wte = [shard(torch.randn(1001, 16), shard_rule("transformer.wte.weight", plan), r, 4) for r in range(4)]
    assert all(p.shape == (1024 // 4, 16) for p in wte)
    assert torch.count_nonzero(wte[-1][1001 - 3 * 256 :]) == 0  # padding rows are zero


def test_the_plan_table_covers_every_parameter_and_drives_the_swap():
    """Every parameter of the single-device GPT has a row in the plan table, and the module swap builds each row's
    style (so layers, checkpoints and export read one table)."""
    from ds_megatron.model import FAMILIES
    from ds_megatron.model.family import COLUMN, NORM, ROW, VOCAB
    from ds_megatron.model.gpt2 import PLAN as GPT2_PLAN
    from ds_megatron.model.gpt2.model import GPT
    from ds_megatron.parallelize import ParallelContext, parallelize_model
    from ds_megatron.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        SequenceParallelLayerNorm,
        VocabParallelEmbedding,
    )

    config = tiny_gpt(vocab_size=1001)
    model = GPT(config)
    assert all(FAMILIES["gpt2"].row(name) is not None for name, _ in model.named_parameters())
    parallelize_model(model, ParallelContext(config, Group(), True, None))
    expected = {COLUMN: ColumnParallelLinear, ROW: RowParallelLinear, VOCAB: VocabParallelEmbedding}
    for row in GPT2_PLAN:
        paths = [row.path] if row.path.startswith("transformer.") else [f"transformer.h.{i}.{row.path}" for i in (0, 1)]
        for path in paths:
            module = model.get_submodule(path)
            if row.style in expected:
                assert isinstance(module, expected[row.style]), (path, type(module))
            elif row.style == NORM:  # tp 1: SP is a no-op, the LayerNorm stays as it is
                assert isinstance(module, torch.nn.LayerNorm) and not isinstance(module, SequenceParallelLayerNorm)


def _attributes(module: torch.nn.Module) -> dict[str, dict]:
    """Every submodule's plain (non-module, non-parameter) attributes, by path."""
    return {path: {k: v for k, v in vars(m).items() if not k.startswith("_")} for path, m in module.named_modules()}


def test_parallelism_reaches_a_block_only_through_its_hooks_and_the_plan_swaps():
    """parallelize_block swaps the plan's modules and sets one attribute, the block's ``hooks``: no other module of
    the block gains or changes an attribute (its forward reads every parallel choice off ``BlockHooks``)."""
    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.model.gpt2.model import GPTBlock
    from ds_megatron.model.layers import SINGLE_DEVICE
    from ds_megatron.model.llama.model import LlamaBlock
    from ds_megatron.parallelize import parallelize_block
    from ds_megatron.random import build_rng

    everything = RecomputeSection("selective", modules=("core_attn", "mlp_act", "layernorm"))
    configs = (
        tiny_gpt(n_layer=1),
        tiny_llama(num_layers=1),
    )
    for block_class, config in zip((GPTBlock, LlamaBlock), configs):
        block = block_class(config)
        assert block.hooks is SINGLE_DEVICE
        before = _attributes(block)
        ctx = ParallelContext(config, Group(), False, build_rng(1, 0, 0, 0), recompute=everything)
        parallelize_block(block, ctx)
        after = _attributes(block)
        for row in ctx.family.block_rows:  # the plan's swapped modules are new modules
            before.pop(row.path), after.pop(row.path)
        assert after[""].pop("hooks") is not SINGLE_DEVICE and before[""].pop("hooks") is SINGLE_DEVICE
        assert after == before, block_class


def test_every_sp_replicated_parameter_is_held_by_a_layer_the_engine_can_switch():
    """Under SP the layers holding SP-replicated parameters (norms, row-parallel biases, the position table) are
    SPReplicatedGrads: ``defer_sp_grad_sync`` turns off each one's per-micro-batch sum, and no other module holds
    such a parameter."""
    from ds_megatron.model import build_model
    from ds_megatron.parallelize import parallelize_model
    from ds_megatron.tensor_parallel import SPReplicatedGrads, defer_sp_grad_sync

    configs = (
        tiny_gpt(),
        tiny_llama(),
    )
    for config in configs:
        model = parallelize_model(build_model(config), ParallelContext(config, Group(None, 0, 2), True, None))
        holders = [
            m
            for m in model.modules()
            if any(getattr(p, "sequence_parallel_replicated", False) for p in m.parameters(recurse=False))
        ]
        assert holders and all(isinstance(m, SPReplicatedGrads) and m.sync_grads_in_backward for m in holders)
        defer_sp_grad_sync(model)
        assert not any(getattr(m, "sync_grads_in_backward", False) for m in model.modules())


def _drawn_elements(monkeypatch) -> list[int]:
    """A running count of the elements random initialisation fills on real tensors (normal_ and uniform_)."""
    count = [0]
    for method in ("normal_", "uniform_"):
        plain = getattr(torch.Tensor, method)

        def counted(self, *args, _plain=plain, **kwargs):
            if not self.is_meta:
                count[0] += self.numel()
            return _plain(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return count


def test_pipeline_layers_start_from_the_single_device_weights_and_draw_only_their_shard(monkeypatch):
    """Each rank's pipeline layers hold the single-device model's initial weights, cut by the plan (at tp 1, 2 and
    4, with fused q|k|v, grouped KV heads, vocabulary padding and an untied output layer), and a rank draws only
    the values its shards hold: at most its own parameters' count (drawing every full tensor and slicing drew
    the whole model on every rank).  Without drawing (weights loaded next, ``init_weights=False``) all are zero."""
    from ds_megatron.model import build_model
    from ds_megatron.pipeline_parallel.module import PipelineLayout, layer_specs

    configs = (
        tiny_gpt(vocab_size=100),
        tiny_llama(vocab_size=100, intermediate_size=48),
    )
    drawn = _drawn_elements(monkeypatch)
    for config in configs:
        reference = dict(build_model(config, seed=5).named_parameters())
        layout = PipelineLayout.of(config)
        for tp in (1, 2, 4):
            shards: dict[str, list[torch.Tensor]] = {}
            for rank in range(tp):
                ctx = ParallelContext(config, Group(None, rank, tp), False, None)
                drawn[0] = 0
                layers = [spec.build() for spec in layer_specs(config, ctx, 5)[:-1]]  # the last: tied or lm_head
                if not layout.tied:
                    layers.append(layer_specs(config, ctx, 5)[-1].build())
                params = {
                    layout.full_name(f"{i}.{k}"): p for i, m in enumerate(layers) for k, p in m.named_parameters()
                }
                assert 0 < drawn[0] <= sum(p.numel() for p in params.values()), (config.family, tp, rank)
                for name, p in params.items():
                    shards.setdefault(name, []).append(p.detach())
            assert set(shards) == set(reference)
            for name, parts in shards.items():
                rule = shard_rule(name, ParallelContext(config, Group(None, 0, tp), False, None))
                assert torch.equal(unshard(parts, rule), reference[name].detach()), (config.family, tp, name)
        skipped = ParallelContext(config, Group(None, 1, 2), False, None, init_weights=False)
        drawn[0] = 0
        layers = [spec.build() for spec in layer_specs(config, skipped, 5)]
        assert drawn[0] == 0 and all(not p.any() for m in layers for p in m.parameters())
