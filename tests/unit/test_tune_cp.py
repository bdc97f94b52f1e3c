"""The tuner with context parallelism: cp and cp_comm in the search space (world = tp x cp x pp x dp) under the
run's own CP rules, the memory model at s / cp, the time model's ring (a hop hidden behind one chunk pair's
attention, or not), the a2a's all-to-alls and the gradient average over dp x cp, and a 128k-token Llama 3 8B on
nodes of 8 GPUs where no cp 1 layout fits.  Fast, in-process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ds_megatron.memory import rotary_table_bytes
from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.links import link
from ds_megatron.tune.core.matmuls import core_attention_matmuls, matmul_s
from ds_megatron.tune.core.memory_model import ACT_BYTES, stage_activation_bytes, stage_memory
from ds_megatron.tune.training.report import why_ahead
from ds_megatron.tune.training.search import ranked_step
from ds_megatron.tune.training.space import CP_MIN_SEQ_LENGTH, enumerate_candidates
from ds_megatron.tune.training.time_model import cp_comm_s, dp_comm_s, ring_pass_s
from ds_megatron.tune.training.written import ds_config

LONG = 131072


def _llama8b(seq_length: int = LONG):
    return build_model_shape("llama3-8b", None, None, None, None, seq_length)


def _cand(**kw) -> Candidate:
    base = dict(tp=2, pp=1, dp=1, sequence_parallel=True, micro_batch_size=1, num_micro_batches=32)
    base.update(recompute="none", attention="sdpa", cp=4, cp_comm="ring")
    base.update(kw)
    return Candidate(**base)


def test_cp_is_chosen_at_128k_on_8_gpu_nodes_where_cp1_does_not_fit():
    # Two nodes of 8 H100 with 28 GiB each for training.  (With all 80 GiB, cp 1 fits: tp 8, SP, full recompute
    # needs 42.6 GiB.)  At cp 1 the last stage keeps the logits [s, V/t] in bf16 and fp32, 12.6 GB at tp 8, which no
    # pipeline depth splits: the best cp 1 layout (tp 8, pp 2) needs 30.1 GiB.  cp 2 halves every sequence term.
    # Full recompute is the least memory a layout can take, so pinning it keeps the search short and loses no fit.
    model, pins = _llama8b(), Pins(attention="sdpa", recompute="full")
    result = search(model, build_cluster("h100-sxm", 16, 8, gpu_memory_gb=28), 32, pins)
    cp1 = [e for e in result.evaluations if e.candidate.cp == 1]
    assert cp1 and not any(e.fits for e in cp1)
    assert min(e.required_bytes for e in cp1) / 2**30 == pytest.approx(30.1, abs=0.1)
    assert result.winner is not None and result.winner.candidate.cp > 1
    c = result.winner.candidate
    assert c.tp * c.cp * c.pp * c.dp == 16 and c.num_micro_batches == 32 // (c.dp * c.micro_batch_size)


def test_short_sequences_search_cp1_only_unless_pinned():
    model = _llama8b(8192)
    assert 8192 < CP_MIN_SEQ_LENGTH
    cluster = build_cluster("h100-sxm", 8, 8)
    candidates, _ = enumerate_candidates(model, cluster, 512, Pins(attention="sdpa", pp=1))
    assert {c.cp for c in candidates} == {1}
    pinned, _ = enumerate_candidates(model, cluster, 512, Pins(attention="sdpa", pp=1, cp=2))
    assert {c.cp for c in pinned} == {2} and {c.cp_comm for c in pinned} == {"ring", "a2a"}
    assert all(c.tp * c.cp * c.dp == 8 for c in pinned)
    # eager's core_attn is offered at cp > 1 too (the run checkpoints the whole cp_comm call); sdpa's never
    both, _ = enumerate_candidates(model, cluster, 512, Pins(pp=1, cp=2))
    assert any("core_attn" in c.recompute_modules for c in both if c.attention == "eager")
    assert not any("core_attn" in c.recompute_modules for c in both if c.attention == "sdpa")


def test_the_runs_cp_rules_are_mirrored():
    cluster = build_cluster("h100-sxm", 16, 8)
    # 8 KV heads: at tp 2 there are 4 per TP rank, so the a2a cannot split them over cp 8
    _, rejected = enumerate_candidates(_llama8b(), cluster, 32, Pins(tp=2, pp=1, cp=8, attention="sdpa"))
    assert any("a2a needs the num_kv_heads per TP rank divisible by cp" in r.reason for r in rejected)
    # a sequence the load-balanced layout cannot cut (2 cp = 16 chunks; under SP also cp x tp)
    model = _llama8b(131072 + 8)
    candidates, rejected = enumerate_candidates(model, cluster, 32, Pins(tp=2, pp=1, cp=8, attention="sdpa"))
    assert not candidates
    assert any("seq_length divisible by 2 x cp = 16" in r.reason for r in rejected)
    # attention dropout (a GPT's 0.1) cannot run with cp > 1
    gpt = build_model_shape("gpt3-1.3b", None, None, None, None, 32768)
    candidates, rejected = enumerate_candidates(gpt, cluster, 32, Pins(cp=2, pp=1))
    assert not candidates and any("attention dropout" in r.reason for r in rejected)


def test_memory_splits_the_sequence_and_zero1_over_dp_x_cp():
    model = _llama8b()
    base = stage_memory(model, _cand(cp=1, dp=4))[0]
    split = stage_memory(model, _cand(cp=4, dp=1))[0]
    assert split.optimizer_bytes == pytest.approx(base.optimizer_bytes)  # ZeRO-1 over the 4 ranks either way
    assert split.params_bytes == base.params_bytes
    assert split.activation_bytes < base.activation_bytes / 3.5  # the sequence terms / 4, plus the ring buffers


def test_each_gpu_adds_the_rotary_tables_once():
    # A Llama's cos/sin tables ([s/cp, d] each, shared by every block of the process) on each pipeline end, at pp 1
    # and pp 2; a GPT (learned positions) has none.
    model = _llama8b()
    for cand in (_cand(cp=4), _cand(cp=8, pp=2, num_micro_batches=16)):
        tables = rotary_table_bytes(LONG, 4096, 32, cand.cp, family="llama", act_bytes=ACT_BYTES)
        assert tables == 2 * (LONG // cand.cp) * 128 * ACT_BYTES
        for stage, act in zip(stage_memory(model, cand), stage_activation_bytes(model, cand)):
            assert stage.activation_bytes == act + tables
    gpt = build_model_shape("gpt3-1.3b", None, None, None, None, 2048)
    gpt_cand = _cand(cp=1, tp=1, sequence_parallel=False, micro_batch_size=1, num_micro_batches=8)
    assert [m.activation_bytes for m in stage_memory(gpt, gpt_cand)] == list(stage_activation_bytes(gpt, gpt_cand))


def test_a_tie_in_time_ranks_the_smaller_cp_first():
    # cp 8 x dp 2 x micro-batch 1 and cp 16 x dp 1 x micro-batch 2 hold the same tokens per GPU: the same predicted
    # step; the cp 16 one needs less memory (its rotary tables are half as long), yet cp 8 ranks first.
    pins = Pins(attention="sdpa", tp=2, pp=1, recompute="selective")
    result = search(_llama8b(), build_cluster("h100-sxm", 32, 8), 32, pins)
    mods = result.winner.candidate.recompute_modules
    same = [e for e in result.ranked if e.candidate.cp in (8, 16) and e.candidate.recompute_modules == mods]
    cp8 = next(e for e in same if e.candidate.cp == 8 and e.candidate.micro_batch_size == 1)
    cp16 = next(e for e in same if e.candidate.cp == 16 and e.candidate.micro_batch_size == 2)
    assert cp8.time.step_s == pytest.approx(cp16.time.step_s, rel=1e-12)
    assert cp16.required_bytes < cp8.required_bytes
    assert result.ranked.index(cp8) < result.ranked.index(cp16)
    # The two sums differ in their last bits; the report calls them a tie, as the ranking does.
    why = why_ahead(cp8, cp16, 1, 2)
    assert "as fast (ranked ahead on smaller cp)" in why[1], why[1]
    assert ranked_step(41.38) == ranked_step(41.38 * (1 + 1e-15))


def test_gradients_are_averaged_over_dp_x_cp_like_dp():
    model, cluster = _llama8b(), build_cluster("h100-sxm", 16, 8)
    assert dp_comm_s(model, cluster, _cand(cp=4, dp=2)) == pytest.approx(dp_comm_s(model, cluster, _cand(cp=1, dp=8)))


def test_ring_pass_takes_the_longer_of_compute_and_hop():
    assert ring_pass_s(1.0, 0.5, 4) == 4.0  # compute-bound: every hop hides behind the block in hand
    assert ring_pass_s(1.0, 2.0, 4) == 7.0  # comm-bound: 3 hops of 2 s, then the last block


def _ring_parts(model, cluster, cand):
    b, d = cand.micro_batch_size, model.hidden_size // model.num_heads
    kv_bytes = 2 * b * model.num_kv_heads / cand.tp * (model.seq_length // cand.cp) * d * 2
    step = matmul_s(core_attention_matmuls(model, cand), cluster) / cand.cp
    return kv_bytes, step, link(cluster, cand.tp * cand.cp > cluster.gpus_per_node)


def test_ring_hides_behind_compute_or_not():
    model = _llama8b()
    cand = _cand(tp=2, cp=4)  # 8 ranks: one node
    # Compute-bound (NVLink): only the dK/dV accumulator's last hop home (bf16) is exposed, per block.
    nvlink = build_cluster("h100-sxm", 8, 8)
    kv_bytes, step, (gbps, latency) = _ring_parts(model, nvlink, cand)
    assert latency + kv_bytes / (gbps * 1e9) < step  # the forward hop is shorter than one chunk pair
    home = latency + kv_bytes / (gbps * 1e9)
    assert cp_comm_s(model, nvlink, cand, 32, 0) == pytest.approx(32 * home)
    # Comm-bound (a slow link): each forward hop exceeds the block in hand by (hop - step), the backward's by
    # (hop_b - 2 step); ring_pass_s - cp x step is what the compute does not hide.  A backward step sends the K/V and
    # the dK/dV accumulator as the ring does: bf16 on the first hop (one block's grads), fp32 on the middle ones
    # (3x the K/V's bytes), bf16 home.
    slow = dataclasses.replace(nvlink, intra_node_gbps=1.0)
    kv_bytes, step, (gbps, latency) = _ring_parts(model, slow, cand)
    hop = latency + kv_bytes / (gbps * 1e9)
    hop_first, hop_b = (2 * latency + n * kv_bytes / (gbps * 1e9) for n in (2, 3))
    assert hop > step and hop_first > 2 * step
    forward = 3 * (hop - step)
    home = latency + kv_bytes / (gbps * 1e9)
    backward = (hop_first - 2 * step) + 2 * (hop_b - 2 * step) + home
    assert cp_comm_s(model, slow, cand, 32, 0) == pytest.approx(32 * (forward + backward))
    # a recomputed forward (full recompute, or core_attn's checkpoint of the whole cp_comm call) runs the ring again
    assert cp_comm_s(model, slow, cand, 32, 32) == pytest.approx(32 * (2 * forward + backward))
    core = dataclasses.replace(cand, recompute="selective", attention="eager", recompute_modules=("core_attn",))
    eager_parts = _ring_parts(model, slow, core)
    eager_forward = 3 * (eager_parts[0] / (gbps * 1e9) + latency - eager_parts[1])
    eager_backward = (hop_first - 2 * eager_parts[1]) + 2 * (hop_b - 2 * eager_parts[1]) + home
    assert cp_comm_s(model, slow, core, 32, 0) == pytest.approx(32 * (2 * eager_forward + eager_backward))


def test_ring_at_cp2_sends_its_accumulator_in_bf16():
    """At cp 2 the accumulator's two hops are its first and its last one home, both bf16: a backward step's hop
    carries twice the K/V's bytes (K/V and accumulator), the home hop the K/V's bytes."""
    model = _llama8b()
    cand = _cand(tp=4, cp=2)
    slow = dataclasses.replace(build_cluster("h100-sxm", 8, 8), intra_node_gbps=1.0)
    kv_bytes, step, (gbps, latency) = _ring_parts(model, slow, cand)
    hop, hop_b = latency + kv_bytes / (gbps * 1e9), 2 * latency + 2 * kv_bytes / (gbps * 1e9)
    assert hop > step and hop_b > 2 * step
    expected = (hop - step) + (hop_b - 2 * step) + latency + kv_bytes / (gbps * 1e9)
    assert cp_comm_s(model, slow, cand, 32, 0) == pytest.approx(32 * expected)


def test_ring_crosses_the_network_when_tp_x_cp_exceeds_a_node():
    model = _llama8b()
    cluster = build_cluster("h100-sxm", 32, 8)
    inside, across = _cand(tp=2, cp=4), _cand(tp=2, cp=8)
    assert _ring_parts(model, cluster, inside)[2] == link(cluster, False)
    assert _ring_parts(model, cluster, across)[2] == link(cluster, True)
    faster_network = dataclasses.replace(cluster, inter_node_gbps=400.0)
    assert cp_comm_s(model, faster_network, across, 32, 0) < cp_comm_s(model, cluster, across, 32, 0)
    assert cp_comm_s(model, faster_network, inside, 32, 0) == cp_comm_s(model, cluster, inside, 32, 0)


def test_a2a_charges_two_all_to_alls_each_way():
    model, cluster = _llama8b(), build_cluster("h100-sxm", 8, 8)
    cand = _cand(tp=2, cp=4, cp_comm="a2a")
    gbps, latency = link(cluster, False)
    d, rows = 128, LONG // 4
    q_bytes, kv_bytes = 32 / 2 * rows * d * 2, 2 * 8 / 2 * rows * d * 2
    one_way = 2 * latency + 3 / 4 * (2 * q_bytes + kv_bytes) / (gbps * 1e9)  # q, k, v in one; the context
    assert cp_comm_s(model, cluster, cand, 32, 0) == pytest.approx(2 * 32 * one_way)
    assert cp_comm_s(model, cluster, cand, 32, 8) == pytest.approx((2 * 32 + 8) * one_way)
    assert cp_comm_s(model, cluster, _cand(cp=1), 32, 0) == 0.0


def test_records_and_configs_name_cp_only_when_used():
    cp1, cp4 = _cand(cp=1, dp=4), _cand(cp=4)
    assert "cp" not in cp1.settings() and cp4.settings()["cp"] == 4 and cp4.settings()["cp_comm"] == "ring"
    model = _llama8b()
    result = search(model, build_cluster("h100-sxm", 8, 8), 32, Pins(tp=2, cp=4, pp=1, attention="sdpa"))
    written = ds_config(result, result.winner)["ds_megatron"]["parallel"]
    assert (written["tp"], written["cp"], written["cp_comm"], written["pp"]) == (
        2,
        4,
        result.winner.candidate.cp_comm,
        1,
    )
    assert written["cp_comm"] in ("ring", "a2a")
    short = search(_llama8b(8192), build_cluster("h100-sxm", 8, 8), 512, Pins(pp=1, attention="sdpa"))
    assert "cp" not in ds_config(short, short.winner)["ds_megatron"]["parallel"]
    assert "cp_comm_s" not in short.winner.time.as_dict()


def test_cli_pins_cp(tmp_path, capsys):
    args = ["--model", "llama3-8b", "--seq-length", "131072", "--global-batch-size", "32", "--gpus", "8"]
    args += ["--gpu", "h100-sxm", "--pp", "1", "--attention", "sdpa"]
    out = tmp_path / "out.json"
    assert main([*args, "--cp", "4", "--cp-comm", "a2a", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cp 4 a2a" in text and "  cp  " in text.splitlines()[4]
    rows = json.loads(out.read_text())["candidates"]
    assert {(r["cp"], r["cp_comm"]) for r in rows} == {(4, "a2a")}
    assert main([*args, "--cp-comm", "a2a"]) == 2
    assert "error: --cp-comm: chooses the exchange of cp > 1 only" in capsys.readouterr().err
    assert main([*args, "--cp", "4", "--cp-comm", "allgather"]) == 2
    assert "error: --cp-comm: unknown exchange" in capsys.readouterr().err


def test_the_shipped_128k_config_is_the_tuners_choice():
    # The file against its generator, its recipe's GPU count and the loader (its miniature run is in
    # tests/unit/test_shipped_configs.py, with every shipped config).
    import re
    import sys

    from ds_megatron.config import resolve

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import llama_long_configs as long

    shipped = json.loads((root / "ds_configs" / f"{long.STEM}.json").read_text())
    result = long.search_long()  # 4 nodes of 8 H100 80GB
    tuned = long.tune(result)
    assert long.config(tuned.config) == shipped
    # cp 1 layouts fit (full or selective recompute at tp 8), but a cp > 1 one is faster: less recompute and tp 2's
    # collectives instead of tp 8's, with every ring hop hidden behind a chunk pair's attention
    assert any(e.fits and e.candidate.cp == 1 for e in result.evaluations)
    best_cp1 = next(e for e in result.ranked if e.candidate.cp == 1)
    assert best_cp1.time.step_s > 1.05 * result.winner.time.step_s
    assert best_cp1.time.tp_comm_s > 4 * result.winner.time.tp_comm_s
    par = shipped["ds_megatron"]["parallel"]
    assert (par["tp"], par["cp"], par["cp_comm"], par["pp"]) == (2, 8, "ring", 1)
    script = (root / "recipes" / f"{long.STEM}.sh").read_text()
    nodes = int(re.search(r"^NODES=(\d+)", script, re.M).group(1))
    assert nodes * 8 == par["tp"] * par["cp"] * par["pp"] * tuned.dp == long.GPUS
    run = resolve(shipped, long.GPUS)  # the loader takes it as the recipe launches it
    assert (run.tp, run.cp, run.pp, run.dp, run.model.seq_length) == (2, 8, 1, 2, 131072)
    assert run.global_batch_size == 32 == run.micro_batch_size * run.grad_accum_steps * run.dp
