"""The family's state-dict adapter (``checkpoint/adapter.py``) on the mixture-of-experts families, at the state-dict
level: our model's state dict -> transformers' published names (one linear per expert; Mixtral's
``block_sparse_moe.experts.<e>.w1/w3/w2``; Qwen2-MoE's shared expert and its gate as held) -> a directory
transformers loads into weights equal to ours, computing our logits -> back,
from the layout transformers writes by default and from its stacked one; the pre-flight's header check and the
import readers take those files; an incomplete set of experts is refused in one line.  The dense families' paths
(GPT-2's Conv1D transposes, base-model prefixes, ignored buffers, TP shards) are tested by the import, export and
reshard tests that run through the same adapter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.checkpoint.hf_import import check_hf_tensors, read_stored, tensor_files
from ds_megatron.config import ConfigError
from ds_megatron.model import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, build_model, family_of

SMALL = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts_per_tok=2)
CONFIGS = {
    # layer 0 dense (its MLP keeps Llama's names), layer 1 routed
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, num_layers=2, intermediate_size=48, moe_intermediate_size=16, num_experts=3, mlp_only_layers=(0,)
    ),
    "mixtral": lambda: MixtralConfig(
        **SMALL, num_layers=2, intermediate_size=16, moe_intermediate_size=16, num_experts=3
    ),
    # and a shared expert of width 24 with its gate, q/k/v biases
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL,
        num_layers=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=3,
        mlp_only_layers=(0,),
        shared_expert_intermediate_size=24,
    ),
}
# One routed layer's stored names, as transformers' save_pretrained writes them (read in transformers 5.24's
# conversion_mapping.py and checked below against what it writes): the router and expert 2's three linears.
PUBLISHED = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.2.gate_proj.weight", "mlp.experts.2.up_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.2.w1.weight"),
    "qwen2_moe": (
        "mlp.gate.weight",
        "mlp.experts.2.gate_proj.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight",
        "self_attn.q_proj.bias",
        "self_attn.v_proj.bias",
    ),
}


# The batch the logits are compared on, drawn from its own generator (not the process's RNG, which earlier tests
# move): with random tiny weights 2 of 8 seeds put a token's k-th and (k+1)-th experts within fp32 rounding of each
# other, where ours and transformers' routers may pick differently (logits then ~2.6e-4 apart, the probability gap
# times the two experts' difference); seed 0 has no such tie.
IDS_SEED = 0


def _model_and_dir(name: str, tmp_path):
    """Our model (random weights) and a transformers directory of its state dict in the published layout."""
    cfg = CONFIGS[name]()
    ours = build_model(cfg, seed=7)
    with torch.no_grad():  # the experts start as zeros until initialised by name: make every expert distinct
        for p in ours.parameters():
            p.copy_(torch.randn_like(p))
    adapter = StateDictAdapter.of(cfg)
    hf_dir = tmp_path / "ours"
    hf_dir.mkdir()
    save_file(adapter.to_hf_state_dict(ours.state_dict()), str(hf_dir / "model.safetensors"))
    cfg.to_hf().save_pretrained(hf_dir)
    return cfg, ours, adapter, hf_dir


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_state_dict_round_trip_through_transformers(name, tmp_path):
    import transformers

    cfg, ours, adapter, hf_dir = _model_and_dir(name, tmp_path)
    state = ours.state_dict()
    written = load_file(hf_dir / "model.safetensors")
    block = "model.layers.1."
    assert all(block + key in written for key in PUBLISHED[name]), sorted(written)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in written)  # one linear per expert
    # transformers loads the published layout into its stacked experts: weights equal to ours, name for name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(loaded).__name__ == family_of(cfg).hf_architecture
    theirs = loaded.state_dict()
    assert theirs.keys() == state.keys()
    assert all(torch.equal(theirs[k], state[k]) for k in state), [
        k for k in state if not torch.equal(theirs[k], state[k])
    ]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(IDS_SEED))
    with torch.no_grad():  # and computes what ours computes
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    # what transformers writes by default is what the adapter writes; both it and the stacked layout read back
    for fmt, original in (("published", True), ("stacked", False)):
        out = tmp_path / fmt
        loaded.save_pretrained(out, save_original_format=original)
        files = load_file(out / "model.safetensors")
        if original:
            assert files.keys() == written.keys() and all(torch.equal(files[k], written[k]) for k in files)
        back = adapter.from_hf_state_dict(files)
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state), fmt
        # the readers of import and --init-from-hf: the pre-flight's header check, then each tensor from its files
        where, shapes = check_hf_tensors(out, cfg, "--hf")
        assert shapes.keys() == state.keys()
        read = {n: read_stored(adapter, n, where[n], lambda t: load_file(t.path)[t.key]) for n in shapes}
        assert all(torch.equal(read[k], state[k]) for k in state), fmt


def test_an_incomplete_set_of_experts_is_refused_before_anything(tmp_path):
    cfg, _, adapter, hf_dir = _model_and_dir("mixtral", tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    lost = "model.layers.1.block_sparse_moe.experts.1.w3.weight"
    del tensors[lost]
    save_file(tensors, str(hf_dir / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"--hf: a tensor disagrees .*experts\.gate_up_proj: .* \(.*experts\.1\.w3"):
        check_hf_tensors(hf_dir, cfg, "--hf")
    with pytest.raises(ValueError, match="not one per expert and part of 3"):
        adapter.from_hf_state_dict(tensors)
    # a stacked tensor and one expert's linears for the same parameter: two layouts in one file
    tensors[lost] = torch.zeros(16, 32)
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(3, 32, 32)
    save_file(tensors, str(hf_dir / "model.safetensors"))
    with pytest.raises(ConfigError, match="a tensor disagrees"):
        check_hf_tensors(hf_dir, cfg, "--hf")
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensor_files(hf_dir, adapter)


def test_a_rank_at_ep_2_holds_whole_experts_and_files_hold_the_tp_shards():
    """At ep > 1 a rank's stacked expert tensors are its experts, whole (dim 0 cut over ep); what checkpoint files
    hold (``saved_shard``) stays the TP rule's shard at any ep, so a checkpoint does not depend on ep; every other
    parameter is cut alike by both.  Qwen3-MoE with 4 experts at tp 2: EP rank 1 holds experts 2 and 3."""
    from ds_megatron.parallelize import ParallelContext
    from ds_megatron.topology import Group

    cfg = Qwen3MoeConfig(
        **SMALL, num_layers=2, intermediate_size=48, moe_intermediate_size=16, num_experts=4, mlp_only_layers=(0,)
    )
    at_ep1 = StateDictAdapter.of(cfg, tp=2)
    at_ep2 = StateDictAdapter(ParallelContext(cfg, Group(rank=1, size=2), True, None, ep=Group(rank=1, size=2)))
    state = {n: torch.randn_like(p) for n, p in build_model(cfg, seed=7).state_dict().items()}
    gate_up, down = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"
    for name, full in state.items():
        assert torch.equal(at_ep2.saved_shard(name, full), at_ep1.shard(name, full, tp_rank=1)), name
        if name in (gate_up, down):
            assert torch.equal(at_ep2.shard(name, full), full[2:]), name
        else:
            assert torch.equal(at_ep2.shard(name, full), at_ep1.shard(name, full, tp_rank=1)), name
    # the TP rule cuts each expert's gate rows and up rows apart: not dim 0
    assert at_ep2.saved_shard(gate_up, state[gate_up]).shape == (4, 16, 32)


def test_expert_tp_ranks_hold_tp_shards_of_their_experts_and_save_what_ep_1_saves():
    """At ep 2 with expert_tp = tp 2 a rank holds its EP rank's experts cut by the TP rule (``shard``); its EP
    group's experts gathered along dim 0 are the ep 1 run's TP shard, which the save writes as it is
    (``saved_from_gathered``), so checkpoints at expert_tp = tp are those of every other layout at that tp; at
    expert_tp 1 the gathered whole experts are cut by the TP rule instead."""
    from ds_megatron.parallelize import ParallelContext
    from ds_megatron.topology import Group

    cfg = Qwen3MoeConfig(
        **SMALL, num_layers=2, intermediate_size=48, moe_intermediate_size=16, num_experts=4, mlp_only_layers=(0,)
    )
    at_ep1 = StateDictAdapter.of(cfg, tp=2)
    state = {n: torch.randn_like(p) for n, p in build_model(cfg, seed=7).state_dict().items()}
    for tp_rank in range(2):
        ranks = [
            StateDictAdapter(ParallelContext(cfg, Group(rank=tp_rank, size=2), True, None, ep=Group(rank=e, size=2),
                                             expert_tp=2))
            for e in range(2)
        ]  # fmt: skip
        whole = StateDictAdapter(ParallelContext(cfg, Group(rank=tp_rank, size=2), True, None, ep=Group(size=2)))
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            full, saved = state[name], at_ep1.shard(name, state[name], tp_rank=tp_rank)
            gathered = torch.cat([r.shard(name, full) for r in ranks])
            assert torch.equal(gathered, saved), name
            assert torch.equal(ranks[0].saved_from_gathered(name, gathered), saved), name
            assert torch.equal(whole.saved_from_gathered(name, full), saved), name
            assert ranks[1].shard(name, full).shape[0] == 2 and ranks[1].shard(name, full).numel() == full.numel() // 4
