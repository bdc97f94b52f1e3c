"""The tuner on the llama family: named Llama sizes, parameter counts, the family-aware memory and time models, the
tp rules of grouped-query attention, and generated configs that resolve to the same shape.  Fast, in-process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_megatron.config import ModelShape, resolve
from ds_megatron.flops import model_flops_per_step
from ds_megatron.memory import activation_bytes_per_layer
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search, step_time
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.memory_model import layer_activation_bytes, padded_vocab_size, stage_param_counts
from ds_megatron.tune.core.memory_model import total_param_count as params
from ds_megatron.tune.training.time_model import dp_comm_s, eager_score_bytes, stage_times

ARGS_8B = ["--model", "llama3-8b", "--global-batch-size", "512", "--gpus", "8", "--gpu", "h100-sxm"]


def _spec(size: str) -> ModelShape:
    return build_model_shape(size, None, None, None, None, None)


def test_named_llama_sizes_resolve_with_their_fields():
    m = _spec("llama3-70b")
    assert (m.family, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size) == (
        "llama",
        80,
        8192,
        64,
        8,
        28672,
    )
    assert (m.vocab_size, m.seq_length, m.tie_word_embeddings, m.size, m.learning_rate) == (
        128256,
        8192,
        False,
        "llama3-70b",
        1.5e-4,
    )
    assert _spec("llama3.2-1b").tie_word_embeddings is True
    changed = build_model_shape("llama3-8b", 4, None, None, None, None)
    assert changed.size is None and changed.rope_theta == 500000.0  # a changed shape is no longer the named size


def test_parameter_counts_are_the_published_totals():
    # transformers' safetensors totals of the published checkpoints
    assert params(_spec("llama3-8b")) == 8_030_261_248  # untied: embedding and lm_head 2 x 525,336,576
    assert params(_spec("llama3-70b")) == 70_553_706_496
    assert params(_spec("llama3.2-1b")) == 1_235_814_400  # tied: one embedding


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_equal_the_real_model_and_its_shard_rules(tied):
    """Total = the single-device Llama; at tp 2, pp 2 over 4 blocks each stage's count on TP rank 0 comes from the
    plan's shard rules (stage 0: embed_tokens, layers 0-1; stage 1: layers 2-3, norm, lm_head or the tied copy)."""
    from ds_megatron.model.llama.model import Llama, LlamaConfig
    from ds_megatron.parallelize import ParallelContext, shard_rule
    from ds_megatron.tensor_parallel.sharding import shard
    from ds_megatron.topology import Group

    model = build_model_shape(
        None, 4, 64, 4, 257, 32, family="llama", kv_heads=2, intermediate_size=176, tie_word_embeddings=tied
    )
    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=176,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    llama = Llama(cfg)
    assert params(model) == sum(p.numel() for p in llama.parameters())
    plan = ParallelContext(cfg, Group(size=2), False, None)
    local = {name: shard(p.data, shard_rule(name, plan), 0, 2).numel() for name, p in llama.named_parameters()}
    first = sum(
        n for name, n in local.items() if name.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1."))
    )
    output = local["model.embed_tokens.weight"] if tied else local["lm_head.weight"]
    last = sum(n for name, n in local.items() if name.startswith(("model.layers.2.", "model.layers.3.", "model.norm.")))
    assert stage_param_counts(model, 2, 2) == (first, last + output)
    assert padded_vocab_size(257, 2) == 512 and output == 512 * 64 // 2


def test_memory_model_uses_the_llama_formula():
    m = _spec("llama3-8b")
    cand = Candidate(8, 1, 1, True, 1, 8, "none")
    # the hand-computed figure of tests/unit/test_memory.py: 82,945 bytes per token at t 8 with SP
    assert layer_activation_bytes(m, cand, "none") == 679_485_440
    sdpa = dataclasses.replace(cand, attention="sdpa")
    assert layer_activation_bytes(m, sdpa, "none") == activation_bytes_per_layer(
        8192, 1, 4096, 32, 8, True, attention="sdpa", family="llama", num_kv_heads=8, intermediate_size=14336
    )


def test_time_model_uses_llama_flops_and_no_tied_reduction_when_untied():
    m = _spec("llama3-8b")
    cluster = build_cluster("h100-sxm", 16, 8)
    cand = Candidate(2, 2, 4, True, 1, 128, "none", attention="sdpa")
    t = step_time(m, cluster, cand, 512)
    model_flops = model_flops_per_step(
        512, 8192, 32, 4096, 128256, family="llama", num_heads=32, num_kv_heads=8, intermediate_size=14336
    )
    assert t.mfu * t.step_s * cluster.peak_flops * cluster.num_gpus == pytest.approx(model_flops)
    tied = dataclasses.replace(m, tie_word_embeddings=True)
    assert dp_comm_s(tied, cluster, cand) > dp_comm_s(m, cluster, cand)  # only a tied embedding is all-reduced
    # eager without an attention dropout skips the dropout's passes over the scores (33 and 35 bytes with it)
    assert eager_score_bytes(False) == (28, 30) and eager_score_bytes(True) == (33, 35)
    eager = dataclasses.replace(cand, attention="eager")
    first, _ = stage_times(m, cluster, eager)
    assert first.attention_s == pytest.approx(1 * 32 / 2 * 8192**2 * 16 * (28 + 30) / (cluster.memory_gbps * 1e9))


def test_llama3_8b_on_8_h100s_writes_a_config_that_resolves(tmp_path, capsys):
    path = tmp_path / "llama3_8b.json"
    assert main([*ARGS_8B, "--write-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model: llama3-8b (llama: L 32, h 4096, a 32, KV heads 8, F 14336, untied output layer" in out
    assert "8.0B parameters" in out and "winner:" in out
    cfg = json.loads(path.read_text())
    run = resolve(cfg, 8)
    shape = run.model
    assert (shape.family, shape.num_layers, shape.hidden_size, shape.num_heads) == ("llama", 32, 4096, 32)
    assert (shape.num_kv_heads, shape.intermediate_size, shape.tie_word_embeddings) == (8, 14336, False)
    assert (shape.vocab_size, shape.seq_length, shape.rope_theta, shape.dropout) == (128256, 8192, 500000.0, 0.0)
    assert run.micro_batch_size * run.grad_accum_steps * run.dp == 512
    assert cfg["optimizer"]["params"]["lr"] == 3.0e-4 and cfg["ds_megatron"]["model"]["size"] == "llama3-8b"


def test_a_changed_llama_shape_writes_its_fields(tmp_path, capsys):
    path = tmp_path / "custom.json"
    args = ["--model", "llama3.2-1b", "--layers", "8", "--global-batch-size", "64", "--gpus", "8"]
    assert main([*args, "--write-config", str(path)]) == 0
    capsys.readouterr()
    section = json.loads(path.read_text())["ds_megatron"]["model"]
    assert "size" not in section and section["family"] == "llama"
    shape = resolve(json.loads(path.read_text()), 8).model
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.intermediate_size) == (8, 2048, 8, 8192)
    assert shape.tie_word_embeddings is True and shape.rope_theta == 500000.0
    assert dict(shape.rope_scaling)["factor"] == 32.0  # Llama 3.2's llama3 scaling kept


def test_tp_16_is_refused_for_8_kv_heads(capsys):
    assert main([*ARGS_8B, "--tp", "16"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --tp: num_kv_heads not divisible by tp (num_kv_heads=8, tp=16); choose tp from [1, 2, 4, 8]"
    ), captured.err
    # searched on 16-GPU nodes, tp 16 divides the heads (32) and the node but not the KV heads: a rejected family
    result = search(_spec("llama3-8b"), build_cluster("h100-sxm", 16, 16), 512, Pins(pp=1))
    assert {e.candidate.tp for e in result.evaluations} == {1, 2, 4, 8}
    kv = [r for r in result.rejections if "num_kv_heads" in r.reason]
    assert len(kv) == 1 and kv[0].family == {"tp": [16, 32]} and "TP splits the KV heads" in kv[0].reason


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model", "gpt3-1.3b", "--kv-heads", "4"], "error: --kv-heads: applies to the llama, qwen3_moe"),
        (["--model", "llama3-8b", "--family", "gpt2"], "error: --family: differs from the named size's family"),
        (["--family", "llama", "--layers", "2", "--hidden", "256", "--heads", "8"], "error: --intermediate-size: not"),
        (["--model", "llama3-8b", "--kv-heads", "3"], "error: --kv-heads: must divide the number of heads"),
        # the rotary embedding turns a head's dimensions in pairs: an odd head dimension (60 / 4 = 15, 4,100 / 100)
        (
            ["--family", "llama", "--layers", "2", "--hidden", "60", "--heads", "4", "--intermediate-size", "160"],
            "error: --hidden: the head dimension must be even for the rotary embedding, which turns its dimensions in "
            "pairs (hidden_size=60 / num_heads=4 = 15); choose --hidden and --heads with an even quotient (e.g. "
            "--hidden 64)",
        ),
        (["--model", "llama3.2-1b", "--hidden", "4100", "--heads", "100"], "error: --hidden: the head dimension must"),
    ],
)
def test_bad_llama_input_exits_2_with_one_line(capsys, args, expected):
    assert main([*args, "--global-batch-size", "64", "--gpus", "8"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), captured.err
