"""The analytic tuner on the routed families: parameter counts against the published model cards and against the
torch model (whole and per TP rank), and a search for Qwen3-30B-A3B whose winner fits the memory it claims."""

from __future__ import annotations

import pytest

from ds_megatron.config.shape import layers_per_stage
from ds_megatron.model import FAMILIES, family_of
from ds_megatron.model.family import RoutedShape
from ds_megatron.model.qwen3_moe import active_block_params, dense_block_params, routed_block_params
from ds_megatron.tune import build_cluster, build_model_shape, search
from ds_megatron.tune.core.memory_model import GIB, block_param_count, stage_memory, total_param_count

# The model cards: total and activated parameters (Qwen3 technical report, Table 1 / the Hub cards; Mixtral's
# paper: 46.7B total, 12.9B active), to the digits published.
CARDS = [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9), ("mixtral-8x7b", 46.7e9, 12.9e9)]
# Qwen2-MoE's cards (the shared expert counted in both): Qwen1.5-MoE-A2.7B 14.3B total, 2.7B activated;
# Qwen2-57B-A14B 57B total, 14B activated.
CARDS += [("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9), ("qwen2-57b-a14b", 57e9, 14e9)]


def _shape(name: str):
    return build_model_shape(name, None, None, None, None, None)


def _active(model) -> int:
    """Parameters a token passes through: the embedding and output layer, the final norm and every block's
    attention, router, k of its experts and a shared expert with its gate."""
    routed = RoutedShape.of(model)
    config = family_of(model).config
    qkv_bias = getattr(config, "qkv_bias", False)
    blocks = model.num_layers * active_block_params(model.hidden_size, routed, config.qk_norm, qkv_bias)
    return total_param_count(model) - model.num_layers * block_param_count(model) + blocks


@pytest.mark.parametrize("name,total,active", CARDS)
def test_parameter_counts_match_the_model_cards(name, total, active):
    model = _shape(name)
    # The cards give two or three significant digits, cut rather than rounded at times (Qwen3-30B-A3B's 3.353B
    # activated is published as 3.3B): within 2% of each figure.
    print(f"\n{name}: total {total_param_count(model) / 1e9:.3f}B, active {_active(model) / 1e9:.3f}B")
    assert total_param_count(model) == pytest.approx(total, rel=0.02)
    assert _active(model) == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_block_params_count_the_torch_block_whole_and_per_tp_rank(family):
    """The routed block's parameters, whole and per TP rank (a split parameter's numel / t, by the family's plan),
    equal the torch block's: every expert stored, the router and norms replicated (Qwen2-MoE: heads of h / a, the
    q/k/v biases split with their rows, a shared expert split as the dense MLP and its gate replicated)."""
    fam = FAMILIES[family]
    d, shared = (16, {"shared_expert_intermediate_size": 40}) if family == "qwen2_moe" else (32, {})
    config = fam.config(
        vocab_size=128, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=d,
        intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, **shared,
    )  # fmt: skip
    block = fam.torch_side().block(config)
    routed = RoutedShape(4, 2, d, 8, 2, 48, True, shared.get("shared_expert_intermediate_size", 0))
    qkv_bias = getattr(config, "qkv_bias", False)
    assert any(n.startswith("mlp.shared_expert") for n, _ in block.named_parameters()) == bool(shared)
    for tp in (1, 2, 4):
        held = sum(
            p.numel() // (tp if fam.split_dim(f"{fam.block_prefix}0.{n}") is not None else 1)
            for n, p in block.named_parameters()
        )
        assert routed_block_params(64, tp, routed, config.qk_norm, qkv_bias) == held, (family, tp)
    if family == "mixtral":  # every layer routed (a value Mixtral fixes)
        return
    dense = fam.torch_side().block(fam.config(**{**config.__dict__, "mlp_only_layers": (0,)}))
    for tp in (1, 2, 4):
        held = sum(
            p.numel() // (tp if fam.split_dim(f"{fam.block_prefix}0.{n}") is not None else 1)
            for n, p in dense.named_parameters()
        )
        assert dense_block_params(64, 96, tp, routed, config.qk_norm, qkv_bias) == held, (family, tp, "dense")


def test_the_dense_layers_of_mlp_only_layers_are_dense_in_the_tuner():
    """moe-tiny's layer 0 is dense (``mlp_only_layers``): the tuner counts its parameters as the torch model's, and
    at pp 2 the first rank holds it as a dense block: a SwiGLU's weights, activations and GEMMs in place of the
    experts', no all-to-all or routed pass, one routed block of two on that rank."""
    import dataclasses

    from ds_megatron.model import model_config
    from ds_megatron.tune import Candidate, step_time
    from ds_megatron.tune.core.memory_model import (
        dense_block_param_count,
        layer_activation_bytes,
        rank_dense_blocks,
        rank_param_counts,
    )
    from ds_megatron.tune.training.time_model import stage_times

    tiny = build_model_shape("moe-tiny", None, None, None, 1024, 256)
    routed = dataclasses.replace(tiny, mlp_only_layers=())  # the same shape with every layer routed
    torch_model = FAMILIES[tiny.family].torch_side().model(model_config(tiny))
    assert total_param_count(tiny) == sum(p.numel() for p in torch_model.parameters()) < total_param_count(routed)
    cand = Candidate(tp=1, pp=2, dp=2, sequence_parallel=False, micro_batch_size=1, num_micro_batches=4,
                     recompute="none", attention="sdpa", ep=2)  # fmt: skip
    assert rank_dense_blocks(tiny, cand) == (1, 0) and rank_dense_blocks(routed, cand) == (0, 0)
    first, last = rank_param_counts(tiny, cand)
    swapped = dense_block_param_count(tiny) - block_param_count(tiny, 1, ep=2)  # a SwiGLU of 352, half the experts
    assert (first - swapped, last) == rank_param_counts(routed, cand)
    (mem_first, mem_last), (routed_first, routed_last) = stage_memory(tiny, cand), stage_memory(routed, cand)
    dense_bytes = layer_activation_bytes(tiny, cand, "none", dense=True)
    assert dense_bytes < layer_activation_bytes(tiny, cand, "none")
    assert mem_first.activation_bytes < routed_first.activation_bytes
    assert mem_last.activation_bytes == routed_last.activation_bytes
    cluster = build_cluster("h100-sxm", 4, 4)
    (t_first, _), (r_first, _) = stage_times(tiny, cluster, cand), stage_times(routed, cluster, cand)
    assert t_first.ep_comm_s == pytest.approx(r_first.ep_comm_s / 2)  # one routed block of the two
    assert t_first.routed_passes_s == pytest.approx(r_first.routed_passes_s / 2)
    assert t_first.flops != r_first.flops
    assert step_time(tiny, cluster, cand, 8).mfu != step_time(routed, cluster, cand, 8).mfu


def test_the_tuner_finds_a_layout_for_qwen3_30b_a3b_that_fits():
    """The search runs for a MoE size and its winner's memory, recomputed from the model, fits the GPU with the
    stated margin; every ranked candidate fits (at micro-batch 1: the search over ep as well as tp, pp and dp costs
    as much as the unpinned one did before ep was searched)."""
    from ds_megatron.tune import Pins

    model = _shape("qwen3-30b-a3b")
    cluster = build_cluster("h100-sxm", 64, 8)
    result = search(model, cluster, 512, Pins(micro_batch_size=1))
    fitting = [e for e in result.evaluations if e.fits]
    assert fitting and result.evaluations[0] is fitting[0], "the winner is a candidate that fits"
    winner = fitting[0]
    assert stage_memory(model, winner.candidate) == (winner.first, winner.last)
    capacity = cluster.gpu_memory_gb * GIB
    assert all(stage.required_bytes <= capacity for e in fitting for stage in (e.first, e.last))
    # the first stage's weights hold all 128 experts of each of its blocks (bf16, 2 bytes each), split over TP at
    # ep 1, E / ep whole ones at ep > 1
    cand = winner.candidate
    split = cand.ep if cand.ep > 1 else cand.tp
    experts = layers_per_stage(model.num_layers, cand.pp) * 128 * 3 * 2048 * 768 // split
    assert winner.first.params_bytes / 2 > experts


def test_moe_recompute_and_the_routed_collectives_in_the_tuner():
    """``--recompute-modules moe`` is searched for a routed model (and refused for a dense one): it stores less
    than no recompute and re-runs the experts' GEMMs; the routed block's extra collectives cost time under SP and
    nothing for a dense model."""
    import dataclasses

    from ds_megatron.config import ConfigError
    from ds_megatron.tune import Candidate, Pins
    from ds_megatron.tune.core.memory_model import layer_activation_bytes
    from ds_megatron.tune.training.time_model import recomputed_experts_s, routed_comm_s

    model = _shape("qwen3-30b-a3b")
    cluster = build_cluster("h100-sxm", 64, 8)
    result = search(model, cluster, 512, Pins(recompute_modules=("moe",)))
    assert {e.candidate.recompute_label() for e in result.evaluations} == {"selective[moe]"}
    cand = result.evaluations[0].candidate
    plain = dataclasses.replace(cand, recompute="none", recompute_modules=())
    assert layer_activation_bytes(model, cand, "selective") < layer_activation_bytes(model, plain, "none")
    assert recomputed_experts_s(model, cluster, cand, 6) > 0 == recomputed_experts_s(model, cluster, plain, 6)
    sp = Candidate(tp=2, pp=1, dp=32, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8, recompute="none")
    assert routed_comm_s(model, cluster, sp, 48, 0) > 0
    assert routed_comm_s(_shape("llama3-8b"), cluster, sp, 32, 0) == 0
    with pytest.raises(ConfigError, match="moe applies to routed experts only"):
        search(_shape("llama3-8b"), cluster, 512, Pins(recompute_modules=("moe",)))


def test_the_inference_command_serves_a_routed_model(capsys):
    """``inference`` ranks serving layouts of a mixture of experts (tests/unit/test_tune_inference.py checks its
    terms): every expert held, the winner fits."""
    from ds_megatron.tune.__main__ import main

    args = ["inference", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-sxm"]
    assert main([*args, "--prompt-length", "512", "--output-length", "128"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("inference: qwen3-30b-a3b") and "winner: tp " in out


def test_the_written_moe_config_resolves_with_moe_recompute(tmp_path, capsys):
    """The winner written for a routed size (with ``moe`` recompute pinned) is a config the loader resolves: the
    named size brings the experts' layout, the modules are the winner's."""
    import json

    from ds_megatron.config import resolve
    from ds_megatron.tune.__main__ import main

    path = tmp_path / "winner.json"
    args = ["--model", "qwen3-30b-a3b", "--global-batch-size", "512", "--gpus", "64", "--gpu", "h100-sxm"]
    assert main([*args, "--recompute-modules", "moe", "--write-config", str(path)]) == 0
    capsys.readouterr()
    cfg = json.loads(path.read_text())
    assert cfg["ds_megatron"]["recompute"]["modules"] == ["moe"]
    assert cfg["ds_megatron"]["parallel"]["ep"] > 1  # moe recompute at ep > 1: the run trains it, the tuner models it
    run = resolve(cfg, 64)
    assert run.model.num_experts == 128 and run.model.experts_per_token == 8 and run.model.head_dim == 128


def test_the_shared_expert_in_the_tuners_time_and_memory():
    """A Qwen2-MoE block's shared expert in the tuner: its GEMMs (n tokens through gate|up and down, F_s / t wide,
    and its h -> 1 gate), one more TP collective each way per block (its input gathered, its output reduced, as the
    dense MLP's), its weights and activations in the memory model; against the same shape without it."""
    import dataclasses

    from ds_megatron.tune import Candidate
    from ds_megatron.tune.core.matmuls import block_matmuls
    from ds_megatron.tune.core.memory_model import layer_activation_bytes
    from ds_megatron.tune.training.time_model import routed_comm_s, stage_time

    model = _shape("qwen1.5-moe-a2.7b")
    without = dataclasses.replace(model, shared_expert_intermediate_size=0)
    cluster = build_cluster("h100-sxm", 8, 8)
    cand = Candidate(
        tp=2, pp=1, dp=4, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8, recompute="none"
    )
    ops = {op.name: op for op in block_matmuls(model, cand)}
    tokens = model.seq_length * cand.micro_batch_size
    assert ops["shared expert gate, up"].flops == 2 * 2 * tokens * 2048 * (5632 // 2)  # two matmuls, F_s / t wide
    assert ops["shared expert down"].flops == 2 * tokens * (5632 // 2) * 2048
    assert ops["shared expert's gate"].flops == 2 * tokens * 2048
    assert set(ops) - {op.name for op in block_matmuls(without, cand)} == {
        "shared expert gate, up",
        "shared expert down",
        "shared expert's gate",
    }
    n = 24
    with_shared, plain = stage_time(model, cluster, cand, n, "middle"), stage_time(without, cluster, cand, n, "middle")
    dense_units = plain.tp_comm_s - routed_comm_s(without, cluster, cand, n, 0)  # 4 collectives per block
    assert with_shared.tp_comm_s - plain.tp_comm_s == pytest.approx(dense_units / 2)  # 2 more per block
    assert with_shared.compute_s > plain.compute_s and with_shared.flops > plain.flops
    assert block_param_count(model, 2) - block_param_count(without, 2) == 3 * 2048 * 5632 // 2 + 2048
    assert layer_activation_bytes(model, cand, "none") > layer_activation_bytes(without, cand, "none")
