"""The tuner's attention-kernel dimension (eager vs sdpa) and its GPU presets: memory and time models, the search,
the report's explanations, the generated config, and the --gpu flag with its overrides.  Fast, in-process."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from ds_megatron.config import resolve
from ds_megatron.memory import activation_bytes_per_layer, lse_bytes_per_layer
from ds_megatron.tune import GPUS, Candidate, Pins, build_cluster, build_model_shape, evaluate, search, step_time
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.memory_model import layer_activation_bytes
from ds_megatron.tune.training.empirical import top_candidates
from ds_megatron.tune.training.report import format_report
from ds_megatron.tune.training.time_model import EAGER_BACKWARD_BYTES, EAGER_FORWARD_BYTES, stage_times

S = 2048
# (size, global batch, GPUs): GPT-3's batch sizes (0.5M, 2M and 3.2M tokens) on one node, 8 nodes and 128 nodes
GPT3_RUNS = [("gpt3-1.3b", 512, 8), ("gpt3-13b", 1024, 64), ("gpt3-175b", 1536, 1024)]


def _spec(size: str):
    return build_model_shape(size, None, None, None, None, S)


def _timed_search(gpu: str, size: str, batch: int, gpus: int):
    start = time.perf_counter()
    result = search(_spec(size), build_cluster(gpu, gpus, 8), batch)
    return result, time.perf_counter() - start


@pytest.fixture(scope="module")
def searches():
    """Every preset x GPT-3 size, searched once, with its wall time.  The fifteen searches are independent and pure
    Python (about 8 s in all): they run on a process per core instead of on the test process's one core."""
    runs = [(gpu, size, batch, gpus) for gpu in GPUS for size, batch, gpus in GPT3_RUNS]
    workers = min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_timed_search, *zip(*runs)))
    return {(gpu, size): result for (gpu, size, _, _), result in zip(runs, results)}


# presets


def test_preset_table_holds_the_datasheet_figures():
    assert set(GPUS) == {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200"}
    figures = {
        n: (p.memory_gb, p.peak_tflops, p.memory_gbps, p.intra_node_gbps, p.inter_node_gbps) for n, p in GPUS.items()
    }
    assert figures["a100-40gb"] == (40, 312, 1555, 300, 25)
    assert figures["a100-80gb"] == (80, 312, 2039, 300, 25)
    assert figures["h100-sxm"] == (80, 989, 3350, 450, 50)
    assert figures["h100-pcie"] == (80, 756, 2000, 64, 25)
    assert figures["h200"] == (140, 989, 4800, 450, 50)


def test_explicit_values_override_the_preset():
    cl = build_cluster("h100-sxm", 64, 8, gpu_memory_gb=40, inter_node_gbps=25, efficiency=0.6)
    assert (cl.gpu_memory_gb, cl.peak_tflops, cl.memory_gbps, cl.intra_node_gbps, cl.inter_node_gbps) == (
        40,
        989,
        3350,
        450,
        25,
    )
    assert cl.efficiency == 0.6 and cl.gpu == "h100-sxm with --gpu-memory-gb 40, --inter-node-gbps 25"
    plain = build_cluster(None, 64, 8)  # no --gpu: the a100-80gb figures, unlabelled
    assert (plain.gpu_memory_gb, plain.peak_tflops, plain.memory_gbps, plain.gpu) == (80, 312, 2039, None)
    same = build_cluster("h200", 64, 8, peak_tflops=989)  # a flag equal to the preset changes nothing
    assert same.gpu == "h200"


def test_cli_preset_with_overrides(tmp_path, capsys):
    out = tmp_path / "tune.json"
    args = ["--model", "gpt3-1.3b", "--global-batch-size", "512", "--gpus", "16", "--gpu", "h100-sxm"]
    assert main([*args, "--gpu-memory-gb", "40", "--memory-gbps", "3000", "--top", "2", "--json", str(out)]) == 0
    cl = json.loads(out.read_text())["cluster"]
    assert (cl["gpu_memory_gb"], cl["peak_tflops"], cl["memory_gbps"], cl["intra_node_gbps"]) == (40, 989, 3000, 450)
    assert cl["inter_node_gbps"] == 50 and cl["gpu"] == "h100-sxm with --gpu-memory-gb 40, --memory-gbps 3000"
    assert (
        "cluster: 16 x h100-sxm with --gpu-memory-gb 40, --memory-gbps 3000 (2 node(s) x 8), 40 GiB, 989 TFLOP/s"
        in (capsys.readouterr().out)
    )
    assert main([*args[:-1], "h100-sxn"]) == 2
    assert "error: command line: argument --gpu: invalid choice: 'h100-sxn'" in capsys.readouterr().err


# the search over kernels


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("size", [r[0] for r in GPT3_RUNS])
def test_every_preset_picks_sdpa_for_gpt3(searches, gpu, size):
    result, wall_s = searches[(gpu, size)]
    w = result.winner
    assert w is not None and wall_s < 10.0
    report = format_report(result)
    assert w.candidate.attention == "sdpa" or "the winner uses eager attention" in report
    assert w.candidate.attention == "sdpa"  # and here it always is: sdpa is faster and needs less memory
    # the same configuration with eager attention (evaluated directly: eager is searched with other module sets)
    twin = evaluate(
        result.model, result.cluster, dataclasses.replace(w.candidate, attention="eager"), result.global_batch_size
    )
    assert twin.time.step_s > w.time.step_s and twin.required_bytes > w.required_bytes
    assert "why rank 1 is ahead of rank 2 (which differs in: " in report
    assert "best eager-attention candidate: rank " in report
    c = w.candidate
    print(
        f"\n{gpu} {size}: tp {c.tp} pp {c.pp} dp {c.dp} SP {c.sequence_parallel} b {c.micro_batch_size} "
        f"{c.recompute_label()} {c.attention}: {w.time.step_s:.3f} s/step, MFU {w.time.mfu:.1%}, "
        f"{w.required_bytes / 2**30:.1f} GiB; searched {len(result.evaluations)} in {wall_s:.2f} s"
    )


def test_175b_search_covers_both_kernels_in_under_10_s(searches):
    result, wall_s = searches[("a100-80gb", "gpt3-175b")]
    assert wall_s < 10.0
    kernels = {e.candidate.attention for e in result.evaluations}
    assert kernels == {"eager", "sdpa"}
    sets = {(e.candidate.attention, e.candidate.recompute_modules) for e in result.evaluations}
    assert {modules for kernel, modules in sets if kernel == "sdpa"} == {
        (),
        ("mlp_act",),
        ("layernorm",),
        ("mlp_act", "layernorm"),
    }
    assert {modules for kernel, modules in sets if kernel == "eager"} == {
        (),
        ("core_attn",),
        ("core_attn", "mlp_act", "layernorm"),
    }
    eager = sum(e.candidate.attention == "eager" for e in result.evaluations)
    selective = sum(e.candidate.recompute == "selective" for e in result.evaluations)
    # per (layout, SP, b): eager has two selective sets, sdpa three, and the same other policies
    assert len(result.evaluations) == 2 * eager + selective // 5
    family = {"attention": "sdpa", "recompute": "selective", "recompute_modules": "core_attn"}
    assert any(r.family == family for r in result.rejections)
    assert result.common is not None and result.common.candidate.attention == "eager"
    print(f"\n175B on 1024 GPUs: {len(result.evaluations)} candidates searched in {wall_s:.3f} s")


def test_pins_on_the_kernel(capsys):
    model, cluster = _spec("gpt3-13b"), build_cluster("a100-80gb", 64, 8)
    eager = search(model, cluster, 1024, Pins(attention="eager"))
    assert {e.candidate.attention for e in eager.evaluations} == {"eager"}
    assert "the winner uses eager attention because attention was pinned to eager" in format_report(eager)
    core = search(model, cluster, 1024, Pins(recompute_modules=("core_attn",)))
    assert {(e.candidate.attention, e.candidate.recompute_label()) for e in core.evaluations} == {
        ("eager", "selective")
    }
    assert "because --recompute-modules includes core_attn" in format_report(core)
    args = ["--model", "gpt3-13b", "--global-batch-size", "1024", "--gpus", "64"]
    assert main([*args, "--attention", "sdpa", "--recompute-modules", "mlp_act,core_attn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --recompute-modules: core_attn recomputes the s x s")


def test_report_explains_why_the_winner_beats_the_runner_up():
    """One layout pinned down to the kernel: ranks 1 and 2 differ only in it, and the runner-up line says so and
    names the time part it changes (the eager score passes)."""
    model = _spec("gpt3-1.3b")
    cluster = build_cluster("a100-80gb", 8, 8)
    result = search(
        model, cluster, 512, Pins(tp=2, pp=1, micro_batch_size=4, sequence_parallel=False, recompute="none")
    )
    text = format_report(result)
    first, second = result.ranked[:2]
    assert (first.candidate.attention, second.candidate.attention) == ("sdpa", "eager")
    assert "which differs in: attention sdpa instead of eager" in text and "eager score passes 0.0000 vs" in text


# memory and time of the two kernels


def test_memory_model_uses_the_kernel():
    model = _spec("gpt3-13b")
    cand = Candidate(8, 4, 2, True, 2, 64, "none", attention="sdpa")
    s, b, h, a, t = S, 2, model.hidden_size, model.num_heads, 8
    sdpa = layer_activation_bytes(model, cand, "none")
    assert sdpa == activation_bytes_per_layer(s, b, h, a, t, True, "none", attention="sdpa")
    eager_selective = layer_activation_bytes(model, dataclasses.replace(cand, attention="eager"), "selective")
    assert sdpa == pytest.approx(eager_selective + lse_bytes_per_layer(s, b, a, t))


def test_eager_pays_its_score_passes_at_the_memory_bandwidth():
    model = _spec("gpt3-13b")
    cluster = build_cluster("h100-sxm", 64, 8)
    base = Candidate(8, 4, 2, True, 1, 64, "none", attention="sdpa")
    n = model.num_layers // 4
    scores = 1 * model.num_heads / 8 * S * S  # [b, a/t, s, s] per TP rank
    bandwidth = cluster.memory_gbps * 1e9
    assert EAGER_FORWARD_BYTES == 33 and EAGER_BACKWARD_BYTES == 35
    for policy, forwards in (("none", n), ("selective", 2 * n), ("full", 2 * n)):
        eager = dataclasses.replace(base, attention="eager", recompute=policy)
        first, _ = stage_times(model, cluster, eager)
        assert first.attention_s == pytest.approx(
            scores * (forwards * EAGER_FORWARD_BYTES + n * EAGER_BACKWARD_BYTES) / bandwidth
        )
    sdpa_time = step_time(model, cluster, base, 128)
    eager_time = step_time(model, cluster, dataclasses.replace(base, attention="eager"), 128)
    assert sdpa_time.attention_s == 0.0 and eager_time.attention_s > 0.0
    # The same matmul FLOPs, but eager's Q K^T writes the s x s scores to HBM and its x V reads them back.
    flops = [t.matmul_efficiency * t.compute_s for t in (eager_time, sdpa_time)]
    assert flops[0] == pytest.approx(flops[1]) and eager_time.compute_s > sdpa_time.compute_s
    extra = eager_time.compute_s - sdpa_time.compute_s + eager_time.attention_s
    # and the data-parallel reduction's exposed share, which eager's longer backward hides more of
    hidden = sdpa_time.dp_comm_s - eager_time.dp_comm_s
    assert hidden > 0.0 and eager_time.step_s == pytest.approx(sdpa_time.step_s + extra - hidden)
    slower_memory = dataclasses.replace(cluster, memory_gbps=cluster.memory_gbps / 2)
    assert step_time(model, slower_memory, dataclasses.replace(base, attention="eager"), 128).attention_s == (
        pytest.approx(2 * eager_time.attention_s)
    )


@pytest.mark.parametrize(
    "extra,kernel", [([], "sdpa"), (["--attention", "eager", "--recompute", "selective"], "eager")]
)
def test_written_config_carries_the_kernel(tmp_path, capsys, extra, kernel):
    path = tmp_path / "winner.json"
    args = ["--model", "gpt3-13b", "--global-batch-size", "1024", "--gpus", "64", "--gpu", "h100-sxm"]
    assert main([*args, *extra, "--write-config", str(path)]) == 0
    capsys.readouterr()
    cfg = json.loads(path.read_text())
    assert cfg["ds_megatron"]["model"]["attention"] == kernel
    run = resolve(cfg, 64)
    assert run.micro_batch_size * run.grad_accum_steps * run.dp == 1024


def test_empirical_on_cpu_measures_one_kernel_per_configuration():
    model = build_model_shape("gpt-tiny", None, None, None, 1024, 128)
    result = search(model, build_cluster(None, 4, 4, gpu_memory_gb=3, peak_tflops=0.05), 16)
    cpu = top_candidates(result.ranked, 3, "cpu")
    keys = {dataclasses.replace(e.candidate, attention="eager") for e in cpu}
    assert len(cpu) == 3 and len(keys) == 3
    assert top_candidates(result.ranked, 3, "gpu") == result.ranked[:3]
