"""Expert parallelism in the training tuner: what ep changes in the memory and time models (hand-computed on
Qwen3-30B-A3B's shape), that the search proposes only the ep values the run's rules accept, that it picks ep > 1
where the experts' memory leaves nothing else (Qwen3-235B-A22B), and what it shows and writes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.ep_rules import check_ep, check_expert_tp, resolved_expert_tp, valid_ep_values
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.core.matmuls import block_matmuls
from ds_megatron.tune.core.memory_model import (
    block_param_count,
    ep_dispatch_bytes,
    layer_activation_bytes,
    recompute_transient_bytes,
    stage_memory,
)
from ds_megatron.tune.training.time_model import ep_comm_s, routed_comm_s, stage_time

# Qwen3-30B-A3B: h 2048, 48 layers, 128 experts of width 768, top 8, s 4096
H, E, K, F, S, L = 2048, 128, 8, 768, 4096, 48
EXPERTS = 3 * E * H * F  # every expert's gate, up and down of one block


@pytest.fixture(scope="module")
def qwen3_30b():
    return build_model_shape("qwen3-30b-a3b", None, None, None, None, None)


def _cand(ep: int, **changes) -> Candidate:
    """tp 2 + SP, pp 4, dp 8 (64 GPUs), one sequence per micro-batch, no recompute, at ``ep``."""
    base = Candidate(tp=2, pp=4, dp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=64,
                     recompute="none", attention="sdpa", ep=ep)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_ep_divides_the_experts_weights_gradients_and_optimizer_state(qwen3_30b):
    """At ep 8 a rank holds 16 whole experts per block (3 E h F / 8) in place of every expert split over tp 2
    (3 E h F / 2); weights 2 and gradients 6 bytes each; the experts' fp32 masters and Adam moments (12 bytes)
    are partitioned over the expert-DP group, tp x dp / ep = 2 ranks, the rest over dp = 8."""
    at_1, at_8 = block_param_count(qwen3_30b, 2, 1), block_param_count(qwen3_30b, 2, 8)
    assert at_1 - at_8 == EXPERTS // 2 - EXPERTS // 8 == 226_492_416
    first_1, _ = stage_memory(qwen3_30b, _cand(1))
    first_8, _ = stage_memory(qwen3_30b, _cand(8))
    blocks = L // 4
    params = first_1.params_bytes / 2 - blocks * (EXPERTS // 2 - EXPERTS // 8)  # the first stage's at ep 8
    experts = blocks * EXPERTS // 8
    assert first_8.params_bytes == 2 * params and first_8.grads_bytes == 6 * params
    assert first_8.optimizer_bytes == 12 * (params - experts) / 8 + 12 * experts / 2
    assert first_1.optimizer_bytes == 12 * first_1.params_bytes / 2 / 8  # ep 1: everything over dp
    # at ep 16 = tp x dp the expert-DP group is one rank: the experts' optimizer state is not partitioned
    first_16, _ = stage_memory(qwen3_30b, _cand(16))
    experts_16 = blocks * EXPERTS // 16
    params_16 = first_16.params_bytes / 2
    assert first_16.optimizer_bytes == 12 * (params_16 - experts_16) / 8 + 12 * experts_16


def test_ep_keeps_the_routed_tokens_of_this_rank_and_holds_the_dispatch_buffers(qwen3_30b):
    """ep 1 under SP keeps the experts' h-wide tensors for all s b gathered tokens on each TP rank; ep > 1 for the
    rank's own s b / t: the routed copies and the expert outputs (k h bf16 each), pair order and token index
    (2 x 8 k), the pair weights (4 k), and the dispatch's two permutations (2 x 8 k) per token
    (tests/unit/test_memory_moe.py measures the layer at ep 2 to the byte).
    The all-to-all's send and receive buffers (s b / t x k x h bf16 each) are held one layer at a time."""
    per_token = 2 * K * H * 2 + 2 * 8 * K + 4 * K  # 65,696 bytes
    assert per_token == 65_696
    at_1 = layer_activation_bytes(qwen3_30b, _cand(1), "none")
    at_8 = layer_activation_bytes(qwen3_30b, _cand(8), "none")
    offsets = 4 * E - 4 * E // 8  # the grouped GEMM's int32 offsets: its E / ep experts' at ep 8
    assert at_1 - at_8 == pytest.approx(S * per_token - S // 2 * (per_token + 2 * 8 * K) + offsets, abs=1e-3)
    assert ep_dispatch_bytes(qwen3_30b, _cand(8)) == 2 * (S // 2) * K * H * 2 == 134_217_728
    assert ep_dispatch_bytes(qwen3_30b, _cand(1)) == 0
    with_buffers = recompute_transient_bytes(qwen3_30b, _cand(8), 12)
    assert with_buffers == 134_217_728  # no recompute: the buffers are the only transient


def test_ep_runs_the_experts_per_expert_and_exchanges_over_the_ep_group(qwen3_30b):
    """The expert GEMMs: at ep 1 each TP rank runs all 128 experts F/t wide on its s b tokens' k pairs (256 rows
    each); at ep 8 its 16 whole experts on the EP group's tokens (8 ranks x s b / t x k / E = 1,024 rows each):
    the same FLOPs.  The all-to-alls: per block forward the counts' exchange, the dispatch and the combine of
    s b / t x k rows of h bf16 ((ep - 1) / ep leaving the GPU), backward two more; inside a node on NVLink, at
    ep 16 across two nodes the slower of the NVLink and network shares."""
    cluster = build_cluster("h100-sxm", 64, 8)
    rows = {op.name: op for op in block_matmuls(qwen3_30b, _cand(1), ep=1)}
    rows_8 = {op.name: op for op in block_matmuls(qwen3_30b, _cand(8), ep=8)}
    assert rows["experts gate, up"].flops == 2.0 * (S * K / E) * H * (F // 2) * 2 * E
    assert rows_8["experts gate, up"].flops == 2.0 * (8 * S // 2 * K / E) * H * F * 2 * (E // 8)
    assert rows["experts down"].flops == rows_8["experts down"].flops
    assert rows["experts gate, up"].flops == rows_8["experts gate, up"].flops
    assert rows_8["experts down"].bytes == 2 * (1024 * F + F * H + 1024 * H) * (E // 8)

    moved = S // 2 * K * H * 2
    a2a = 20e-6 + 7 / 8 * moved / 450e9
    counts = 20e-6 + 7 / 8 * E * 8 / 450e9
    assert ep_comm_s(qwen3_30b, cluster, _cand(8), 12, 0) == pytest.approx(12 * (counts + 2 * a2a) + 12 * 2 * a2a)
    assert ep_comm_s(qwen3_30b, cluster, _cand(8), 12, 12) == pytest.approx(24 * (counts + 2 * a2a) + 12 * 2 * a2a)
    a2a_16 = 50e-6 + max(7 / 16 * moved / 450e9, 8 / 16 * moved / 50e9)
    counts_16 = 50e-6 + max(7 / 16 * E * 8 / 450e9, 8 / 16 * E * 8 / 50e9)
    assert ep_comm_s(qwen3_30b, cluster, _cand(16), 1, 0) == pytest.approx(counts_16 + 4 * a2a_16)
    assert ep_comm_s(qwen3_30b, cluster, _cand(1), 12, 0) == 0
    # at ep > 1 the routed MLP gathers nothing over TP: its two TP collectives per block pass drop out, and the
    # routing pairs' all-gather with them (the statistics' all-reduce stays)
    t_1, t_8 = (
        stage_time(qwen3_30b, cluster, _cand(1), 12, "middle"),
        stage_time(qwen3_30b, cluster, _cand(8), 12, "middle"),
    )
    assert routed_comm_s(qwen3_30b, cluster, _cand(8), 12, 0) < routed_comm_s(qwen3_30b, cluster, _cand(1), 12, 0)
    assert t_8.tp_comm_s < t_1.tp_comm_s and t_8.ep_comm_s > 0 == t_1.ep_comm_s


def test_the_search_proposes_only_the_ep_values_the_rules_accept(qwen3_30b):
    """Every candidate's (ep, expert_tp) is one the run's folding forms (``config.ep_rules.check_expert_tp`` and
    ``check_ep``), each layout is searched at every such pair: whole experts at every ep, experts split over tp > 1
    at every ep > 1 (tp > 1 without SP has ep > 1 only so); a dense model's candidates have no ep."""
    result = search(qwen3_30b, build_cluster("h100-sxm", 16, 8), 256, Pins(micro_batch_size=1, attention="sdpa"))
    layouts: dict[tuple, set] = {}
    for e in result.evaluations:
        c = e.candidate
        check_expert_tp(c.expert_tp, c.ep, c.tp)
        check_ep(c.ep, c.tp, c.cp, c.dp, c.sequence_parallel, E, resolved_expert_tp(c.expert_tp, c.ep, c.tp))
        layouts.setdefault((c.tp, c.cp, c.dp, c.sequence_parallel), set()).add((c.ep, c.expert_tp_size))
    assert any(ep > 1 for pairs in layouts.values() for ep, _ in pairs)
    assert any(ep > 1 and etp > 1 for pairs in layouts.values() for ep, etp in pairs)
    for (tp, cp, dp, sp), pairs in layouts.items():
        whole = {(ep, tp if ep == 1 else 1) for ep in valid_ep_values(tp, cp, dp, sp, E)}
        split = {(ep, tp) for ep in valid_ep_values(tp, cp, dp, sp, E, expert_tp=tp) if ep > 1 and tp > 1}
        assert pairs == whole | split, (tp, cp, dp, sp)
        assert sp or tp == 1 or all(etp == tp for _, etp in pairs)
    # and the run's loader takes each (tp, pp, dp, SP, ep, expert_tp) the search proposes, as the tuner writes it
    from ds_megatron.tune.training.written import ds_config

    firsts = {}
    for e in result.evaluations:
        c = e.candidate
        firsts.setdefault((c.tp, c.pp, c.dp, c.sequence_parallel, c.ep, c.expert_tp), e)
    for e in firsts.values():
        run = resolve(ds_config(result, e), 16)
        par, c = run.section.parallel, e.candidate
        assert (run.tp, run.pp, run.dp, par.ep, par.expert_tp) == (c.tp, c.pp, c.dp, c.ep, c.expert_tp)
    dense = search(build_model_shape("llama3.2-1b", None, None, None, None, None), build_cluster("h100-sxm", 8, 8), 64)
    assert {e.candidate.ep for e in dense.evaluations} == {None}
    assert all("ep" not in e.as_dict() for e in dense.evaluations[:5])


def test_refused_ep_families_carry_the_rules_words(qwen3_30b):
    """Selective moe recompute is searched at every ep (at ep > 1 the local experts re-run on their dispatched
    rows: less stored, their forward GEMMs once more, the all-to-alls not again); a pinned ep that does not split
    the experts, or one on a dense model, is refused before the search."""
    import dataclasses

    from ds_megatron.tune.core.memory_model import layer_activation_bytes
    from ds_megatron.tune.training.time_model import ep_comm_s, recomputed_experts_s

    cluster = build_cluster("h100-sxm", 16, 8)
    result = search(qwen3_30b, cluster, 256, Pins(recompute_modules=("moe",), micro_batch_size=1, attention="sdpa"))
    assert {e.candidate.ep for e in result.evaluations} >= {1, 2, 8}
    assert not [r for r in result.rejections if "moe" in r.family.get("recompute_modules", "")]
    cand = next(e.candidate for e in result.evaluations if e.candidate.ep == 8)
    plain = dataclasses.replace(cand, recompute="none", recompute_modules=())
    assert layer_activation_bytes(qwen3_30b, cand, "selective") < layer_activation_bytes(qwen3_30b, plain, "none")
    assert recomputed_experts_s(qwen3_30b, cluster, cand, 24) > 0 == recomputed_experts_s(qwen3_30b, cluster, plain, 24)
    assert ep_comm_s(qwen3_30b, cluster, cand, 24, 0) == ep_comm_s(qwen3_30b, cluster, plain, 24, 0)
    unpinned = search(qwen3_30b, cluster, 256, Pins(micro_batch_size=1, attention="sdpa", pp=2))
    assert any(e.candidate.ep > 1 and "moe" in e.candidate.recompute_modules for e in unpinned.evaluations)
    with pytest.raises(ConfigError, match="each EP rank holds num_experts / ep experts"):
        search(qwen3_30b, cluster, 256, Pins(ep=3))
    with pytest.raises(ConfigError, match="this model has none"):
        search(build_model_shape("llama3-8b", None, None, None, None, None), cluster, 256, Pins(ep=2))
    pinned = search(qwen3_30b, cluster, 256, Pins(ep=4, micro_batch_size=1, attention="sdpa"))
    assert {e.candidate.ep for e in pinned.evaluations} == {4}
    refused = [r for r in pinned.rejections if r.family.get("ep") == 4 and r.required_bytes is None]
    without_sp = [r for r in refused if r.family.get("sequence_parallel") is False]
    assert without_sp and all("without sequence parallelism tp ranks share theirs" in r.reason for r in without_sp)
    # tp > 1 without SP takes ep 4 only with the experts split over TP (the EP group over one tp index's ranks)
    split = [e.candidate for e in pinned.evaluations if e.candidate.tp > 1 and not e.candidate.sequence_parallel]
    assert split and all(c.expert_tp == c.tp for c in split)


def test_the_experts_memory_forces_ep_for_qwen3_235b_a22b():
    """Qwen3-235B-A22B on 16 nodes of 8 H100 cut into 4 pipeline stages: at ep 1 a stage's 57B expert parameters
    split over at most tp 4 (its 4 KV heads) need 112 GiB of weights and gradients alone, so no ep 1 candidate
    fits; with whole experts ep 16 and 32 do, with each expert split over tp t those where ep x t is 16 or more
    (the same share of the experts per GPU), and the search picks one.  On 8 nodes no layout fits at all (20 bytes
    per parameter: 68 GiB per GPU before activations and the margin)."""
    model = build_model_shape("qwen3-235b-a22b", None, None, None, None, None)
    pins = Pins(pp=4, micro_batch_size=1, attention="sdpa", recompute="full")
    result = search(model, build_cluster("h100-sxm", 128, 8), 1024, pins)
    assert result.winner is not None and result.winner.candidate.ep > 1
    assert {e.candidate.ep for e in result.ranked if e.candidate.expert_tp is None} == {16, 32}
    split = [e.candidate for e in result.ranked if e.candidate.expert_tp is not None]
    assert split and min(c.ep * c.expert_tp for c in split) == 16
    assert not [e for e in result.evaluations if e.candidate.ep == 1 and e.fits]
    assert search(model, build_cluster("h100-sxm", 64, 8), 1024, pins).winner is None


def test_the_report_the_json_and_the_written_config_name_ep(tmp_path, capsys):
    """The table has an ep column and the active-parameter note for a routed model, --json names each
    candidate's ep beside tp, and the written config carries the winner's ep and resolves for its GPUs."""
    from ds_megatron.tune.__main__ import main

    out, cfg = tmp_path / "out.json", tmp_path / "cfg.json"
    args = ["--model", "qwen3-30b-a3b", "--global-batch-size", "256", "--gpus", "16", "--gpu", "h100-sxm"]
    args += [
        "--micro-batch-size",
        "1",
        "--attention",
        "sdpa",
        "--top",
        "3",
        "--json",
        str(out),
        "--write-config",
        str(cfg),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("rank"))
    assert header.split()[:6] == ["rank", "tp", "pp", "dp", "ep", "sp"]
    assert "MFU and HFU count the active parameters" in text
    data = json.loads(out.read_text())
    assert list(data["winner"])[:4] == ["tp", "pp", "dp", "ep"]
    assert all("ep" in c for c in data["candidates"])
    written = json.loads(cfg.read_text())
    assert written["ds_megatron"]["parallel"]["ep"] == data["winner"]["ep"]
    run = resolve(written, 16)
    assert run.section.parallel.ep == data["winner"]["ep"]


def test_the_shipped_qwen3_30b_a3b_config_is_the_tuners_choice():
    """ds_configs/qwen3_30b_a3b.json is what its generator writes from the tuner's winner on 4 nodes of 8 H100:
    experts over ep 8 inside each node, predicted 1.17x faster than the best ep 1 layout (which recomputes moe)."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import moe_configs

    stem = "qwen3_30b_a3b"
    size, gpus, batch, lr = moe_configs.SIZES[stem]
    tuned = moe_configs.tune(size, gpus, batch)
    shipped = json.loads((root / "ds_configs" / f"{stem}.json").read_text())
    assert moe_configs.config(stem, size, tuned.config, lr, tuned.model.seq_length) == shipped
    assert shipped["ds_megatron"]["parallel"]["ep"] == 8 == tuned.winner.candidate.ep
    best_ep1 = search(tuned.model, build_cluster("h100-sxm", gpus, 8), batch, Pins(ep=1)).winner
    assert best_ep1.time.step_s > 1.12 * tuned.winner.time.step_s  # predicted 1.17x
