"""Expert tensor parallelism in the training tuner (``parallel.expert_tp`` = tp at ep > 1): what splitting each
expert's width over TP changes in the memory and time models against whole experts (hand-computed on
Qwen3-30B-A3B's shape), that the pins and the run's rules decide which splits are searched, and what the report,
``--json`` and the written config say.  The activation formula at expert_tp = tp is measured to the byte in
``tests/unit/test_memory_moe.py``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_megatron.config import ConfigError, resolve
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.core.matmuls import block_matmuls
from ds_megatron.tune.core.memory_model import (
    block_param_count,
    ep_dispatch_bytes,
    layer_activation_bytes,
    stage_memory,
)
from ds_megatron.tune.training.time_model import ep_comm_s, routed_comm_s, stage_time

# Qwen3-30B-A3B: h 2048, 48 layers, 128 experts of width 768, top 8, s 4096
H, E, K, F, S, L = 2048, 128, 8, 768, 4096, 48
EXPERTS = 3 * E * H * F  # every expert's gate, up and down of one block


@pytest.fixture(scope="module")
def qwen3_30b():
    return build_model_shape("qwen3-30b-a3b", None, None, None, None, None)


def _cand(ep: int, expert_tp: int | None = None, **changes) -> Candidate:
    """tp 2 + SP, pp 4, dp 8 (64 GPUs), one sequence per micro-batch, no recompute, at ``ep`` and ``expert_tp``."""
    base = Candidate(tp=2, pp=4, dp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=64,
                     recompute="none", attention="sdpa", ep=ep, expert_tp=expert_tp)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_a_default_split_has_one_spelling():
    """expert_tp equal to the run's resolution (tp at ep 1, 1 at ep > 1) is stored as unset: one layout, one
    candidate; the records name the resolved split beside ep."""
    assert _cand(8, 1) == _cand(8) and _cand(1, 2) == _cand(1)
    assert _cand(8, 2).expert_tp == 2 and _cand(8, 2).experts_split_at_ep
    assert _cand(8).settings()["expert_tp"] == 1 and _cand(8, 2).settings()["expert_tp"] == 2
    assert _cand(1).settings()["expert_tp"] == 2
    assert list(_cand(8, 2).settings())[:5] == ["tp", "pp", "dp", "ep", "expert_tp"]


def test_split_experts_divide_the_model_states_by_ep_times_tp(qwen3_30b):
    """At ep 4 with expert_tp 2 a rank holds F / 2 of 32 experts per block (3 E h F / 8 in place of whole experts'
    3 E h F / 4); their optimizer state is partitioned over the expert-DP group, cp x dp / ep = 2 ranks (whole
    experts under SP: tp x dp / ep = 4), the rest over dp = 8."""
    whole, split = block_param_count(qwen3_30b, 2, 4), block_param_count(qwen3_30b, 2, 4, 2)
    assert whole - split == EXPERTS // 4 - EXPERTS // 8
    blocks = L // 4
    for cand, experts, expert_dp in ((_cand(4, 2), EXPERTS // 8, 2), (_cand(4), EXPERTS // 4, 4)):
        first, _ = stage_memory(qwen3_30b, cand)
        params = first.params_bytes / 2
        assert first.grads_bytes == 6 * params
        assert first.optimizer_bytes == 12 * (params - blocks * experts) / 8 + 12 * blocks * experts / expert_dp


def test_split_experts_keep_the_tp_groups_tokens(qwen3_30b):
    """With experts split over TP every tp rank runs the TP group's s b tokens (gathered under SP, as the dense
    MLP's): the routed copies, expert outputs, pair indices, weights and the dispatch's permutations (4 k h + 36 k
    bytes per token in bf16) are kept for s b tokens, where whole experts keep them for the rank's s b / t; the
    dispatch buffers hold 2 x s b k h bf16."""
    whole, split = _cand(8), _cand(8, 2)
    kept = S * (4 * K * H + 36 * K)  # bf16: the routed copies and outputs (2 k h each), 8 + 8 + 4 + 16 k bytes
    diff = layer_activation_bytes(qwen3_30b, split, "none") - layer_activation_bytes(qwen3_30b, whole, "none")
    assert diff == kept - kept / 2
    assert ep_dispatch_bytes(qwen3_30b, split) == 2 * S * K * H * 2 == 2 * ep_dispatch_bytes(qwen3_30b, whole)


def test_split_experts_gemms_collectives_and_all_to_alls(qwen3_30b):
    """At ep 8 with expert_tp 2: 16 local experts, F / 2 wide, on the EP group's tokens per expert (ep s b k / E =
    2,048 rows: the TP group's tokens, gathered) where whole experts take 1,024 rows F wide, the same FLOPs; the
    routed MLP's TP collectives are the dense MLP's (as at ep 1); the all-to-alls carry the s b k rows every tp rank
    runs over a group of one tp index's ranks, tp apart: ep 8 spans 16 GPUs, two nodes, 4 of its ranks in each."""
    gemms = {op.name: op for op in block_matmuls(qwen3_30b, _cand(8, 2), ep=8, expert_tp=2)}
    whole = {op.name: op for op in block_matmuls(qwen3_30b, _cand(8), ep=8)}
    rows = 8 * S * K // E
    assert rows == 2048
    assert gemms["experts gate, up"].flops == 2 * rows * H * (F // 2) * 2 * (E // 8)
    assert gemms["experts down"].flops == whole["experts down"].flops
    assert gemms["experts down"].bytes != whole["experts down"].bytes
    cluster = build_cluster("h100-sxm", 64, 8)
    t_1, t_split = (stage_time(qwen3_30b, cluster, c, 12, "middle") for c in (_cand(1), _cand(8, 2)))
    assert t_split.tp_comm_s == t_1.tp_comm_s
    assert routed_comm_s(qwen3_30b, cluster, _cand(8, 2), 12, 0) == routed_comm_s(qwen3_30b, cluster, _cand(1), 12, 0)
    moved = S * K * H * 2  # the s b tokens' k rows, h wide, bf16
    a2a = 50e-6 + max(3 / 8 * moved / 450e9, 4 / 8 * moved / 50e9)
    counts = 50e-6 + max(3 / 8 * E * 8 / 450e9, 4 / 8 * E * 8 / 50e9)
    assert ep_comm_s(qwen3_30b, cluster, _cand(8, 2), 1, 0) == pytest.approx(counts + 4 * a2a)
    # ep 4 split spans 8 GPUs: one node, NVLink; whole experts at ep 8 under SP: 8 consecutive ranks, half the rows
    inside = 20e-6 + 3 / 4 * moved / 450e9
    assert ep_comm_s(qwen3_30b, cluster, _cand(4, 2), 1, 0) == pytest.approx(20e-6 + 3 / 4 * E * 8 / 450e9 + 4 * inside)
    half = 20e-6 + 7 / 8 * moved / 2 / 450e9
    assert ep_comm_s(qwen3_30b, cluster, _cand(8), 1, 0) == pytest.approx(20e-6 + 7 / 8 * E * 8 / 450e9 + 4 * half)


def test_the_pins_pick_the_split(qwen3_30b):
    """``--expert-tp`` keeps the layouts of that split the run accepts; at tp 2 without SP only split experts take
    ep > 1, and whole ones are refused in the rule's words; on a dense model the pin is refused."""
    cluster = build_cluster("h100-sxm", 16, 8)
    base = dict(tp=2, micro_batch_size=1, attention="sdpa", recompute="none")
    split = search(qwen3_30b, cluster, 256, Pins(**base, expert_tp=2))
    assert {e.candidate.expert_tp_size for e in split.evaluations} == {2}
    assert {e.candidate.ep for e in split.evaluations} >= {1, 2, 8}
    whole = search(qwen3_30b, cluster, 256, Pins(**base, sequence_parallel=False, expert_tp=1))
    assert not whole.evaluations
    assert any("each routed expert is split over expert_tp ranks" in r.reason for r in whole.rejections)
    pinned = search(qwen3_30b, cluster, 256, Pins(**base, sequence_parallel=False, ep=4))
    assert pinned.evaluations and {(e.candidate.ep, e.candidate.expert_tp) for e in pinned.evaluations} == {(4, 2)}
    with pytest.raises(ConfigError, match="this model has none"):
        search(build_model_shape("llama3-8b", None, None, None, None, None), cluster, 256, Pins(expert_tp=2))


def test_the_report_the_json_and_the_written_config_name_expert_tp(tmp_path, capsys):
    """A winner with split experts: the table has an etp column after ep, the winner line says ``expert_tp 2``,
    ``--json`` names ``expert_tp`` after ``ep``, and the written config sets ``parallel.expert_tp`` (only there:
    the default split is left to the loader) and resolves for its GPUs."""
    from ds_megatron.tune.__main__ import main

    out, cfg = tmp_path / "out.json", tmp_path / "cfg.json"
    args = ["--model", "qwen3-30b-a3b", "--global-batch-size", "256", "--gpus", "16", "--gpu", "h100-sxm", "--tp", "2"]
    args += ["--no-sequence-parallel", "--ep", "4", "--micro-batch-size", "1", "--attention", "sdpa", "--top", "3"]
    assert main([*args, "--json", str(out), "--write-config", str(cfg)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("rank"))
    assert header.split()[:7] == ["rank", "tp", "pp", "dp", "ep", "etp", "sp"]
    assert "ep 4, expert_tp 2, SP off" in next(line for line in text.splitlines() if line.startswith("winner:"))
    data = json.loads(out.read_text())
    assert list(data["winner"])[:5] == ["tp", "pp", "dp", "ep", "expert_tp"] and data["winner"]["expert_tp"] == 2
    written = json.loads(cfg.read_text())
    assert written["ds_megatron"]["parallel"]["expert_tp"] == 2
    run = resolve(written, 16)
    assert (run.section.parallel.ep, run.section.parallel.expert_tp) == (4, 2)
    whole = search(build_model_shape("qwen3-30b-a3b", None, None, None, None, None), build_cluster("h100-sxm", 16, 8),
                   256, Pins(tp=1, ep=8, micro_batch_size=1, attention="sdpa"))  # fmt: skip
    from ds_megatron.tune.training.written import ds_config

    assert "expert_tp" not in ds_config(whole, whole.winner)["ds_megatron"]["parallel"]
