"""Shard rules: shard/unshard round trips, fused QKV split by heads, vocabulary padding."""

from __future__ import annotations

import torch

from ds_megatron.model import GPTConfig
from ds_megatron.parallelize import ParallelContext, shard_rule
from ds_megatron.tensor_parallel import ShardRule, TPGroup, padded_vocab_size, shard, unshard


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
    plan = ParallelContext(GPTConfig(vocab_size=1001, n_embd=16, n_head=4, n_layer=1), TPGroup(size=4), False, None)
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
    from ds_megatron.model.family import COLUMN, NORM, ROW, VOCAB
    from ds_megatron.model.gpt2 import PLAN as GPT2_PLAN
    from ds_megatron.model.gpt2.model import GPT, GPTConfig
    from ds_megatron.parallelize import ParallelContext, parallelize_model, plan_row
    from ds_megatron.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        SequenceParallelLayerNorm,
        VocabParallelEmbedding,
    )

    config = GPTConfig(vocab_size=1001, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = GPT(config)
    assert all(plan_row(name) is not None for name, _ in model.named_parameters())
    parallelize_model(model, ParallelContext(config, TPGroup(), True, None))
    expected = {COLUMN: ColumnParallelLinear, ROW: RowParallelLinear, VOCAB: VocabParallelEmbedding}
    for row in GPT2_PLAN:
        paths = [row.path] if row.path.startswith("transformer.") else [f"transformer.h.{i}.{row.path}" for i in (0, 1)]
        for path in paths:
            module = model.get_submodule(path)
            if row.style in expected:
                assert isinstance(module, expected[row.style]), (path, type(module))
            elif row.style == NORM:  # tp 1: SP is a no-op, the LayerNorm stays as it is
                assert isinstance(module, torch.nn.LayerNorm) and not isinstance(module, SequenceParallelLayerNorm)
