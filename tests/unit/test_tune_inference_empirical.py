"""The inference tuner's empirical mode (``inference --empirical``): the calibration fit and the failure reporting on
fake measurements, the launch loop with a fake launch, and (slow) real measured runs of a small exported Llama on 2
CPU processes under DeepSpeed's inference engine."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from ds_megatron.tune import build_cluster, build_model_shape
from ds_megatron.tune.core.calibration import FIT_TERMS
from ds_megatron.tune.inference import empirical as ie
from ds_megatron.tune.inference import probe
from ds_megatron.tune.inference.cli import main
from ds_megatron.tune.inference.empirical import (
    final_ranking,
    fit_inference_model,
    recalibrate,
    run_inference_empirical,
)
from ds_megatron.tune.inference.empirical_report import format_inference_empirical
from ds_megatron.tune.inference.model import (
    Serving,
    Workload,
    evaluate_serving,
    inference_time,
    search_inference,
)
from ds_megatron.tune.inference.probe import InferenceEmpiricalOptions, InferenceRun, measured_figures, record_outcomes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
# The small Llama of benchmarks/inference_accuracy.py, as the tuner reads it from its config.json.
SHAPE = dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=4096, context=256)
MODEL = build_model_shape(
    None, 4, 512, 8, 4096, 256, family="llama", kv_heads=4, intermediate_size=1408, tie_word_embeddings=False
)
CPU2 = build_cluster(None, 2, 2, gpu_memory_gb=16, peak_tflops=0.05, memory_gbps=10)
WORK = Workload(32, 16, weight_dtype="fp32", kv_dtype="fp32", batch_sizes=(1, 8, 32))
OPTIONS = InferenceEmpiricalOptions(max_minutes=2, device="cpu")


@pytest.fixture(scope="module")
def result():
    return search_inference(MODEL, CPU2, WORK)


def _runs(result, statuses=None) -> list[InferenceRun]:
    picked = ie.top_candidates(result, 6)
    return [InferenceRun(i + 1, i + 1, e) for i, e in enumerate(picked)]


def _truth(result) -> object:
    """Compute efficiency 0.3 (the bandwidth efficiency in the cluster's ratio: the fit scales both), collectives of
    0.4 ms, 3 ms per forward."""
    return dataclasses.replace(ie.with_efficiency(result.cluster, 0.3), intra_node_latency_s=4e-4, step_overhead_s=3e-3)


def _measure_from(cluster, result, runs) -> None:
    """Exact 'measurements': the inference model itself at ``cluster``'s constants."""
    for r in runs:
        t = inference_time(result.model, cluster, r.evaluation.serving, result.workload)
        r.status, r.reason = "ok", None
        r.measured = measured_figures(r.evaluation.serving, result.workload, t.ttft_s, t.tpot_s)


def test_the_six_candidates_are_tp_1_and_2_at_every_batch_in_one_launch(result):
    picked = ie.top_candidates(result, 6)
    assert [(e.serving.tp, e.serving.pp) for e in picked] == [(1, 1)] * 3 + [(2, 1)] * 3
    assert sorted(e.serving.batch for e in picked) == [1, 1, 8, 8, 32, 32]
    assert {e.serving.replicas for e in picked if e.serving.tp == 1} == {2}  # the replicas are counted, not run
    assert probe.launch_groups([1, 2, 1, 2]) == [(1, 2)]
    assert probe.launch_groups([4, 1, 2, 8]) == [(1, 8), (2,), (4,)]  # a tp between 1 and the world: its own launch
    assert (
        probe.launch_groups([2, 4]) == [(2,), (4,)]
        and probe.launch_groups([1]) == [(1,)]
        and probe.launch_groups([]) == []
    )


def test_a_gpt2_is_measured_at_tp_1_only(capsys):
    gpt2 = build_model_shape(None, 4, 256, 4, 2048, 256)
    result = search_inference(gpt2, CPU2, WORK)
    assert {e.serving.tp for e in result.evaluations} == {1, 2}
    assert {e.serving.tp for e in ie.top_candidates(result, 6)} == {1}
    assert "AutoTP refuses GPT-2" in ie.not_measured(result, next(e for e in result.evaluations if e.serving.tp == 2))


def test_a_fixed_overhead_adds_to_every_forward(result):
    s = Serving(2, 1, 8, 1)
    plain = inference_time(MODEL, CPU2, s, WORK)
    more = inference_time(MODEL, dataclasses.replace(CPU2, step_overhead_s=0.004), s, WORK)
    assert more.ttft_s - plain.ttft_s == pytest.approx(0.004) and more.tpot_s - plain.tpot_s == pytest.approx(0.004)


def test_measured_tokens_per_s_counts_every_replica():
    s = Serving(1, 1, 8, 2)  # 2 replicas of 8 requests, 16 output tokens each, TTFT 0.1 s, TPOT 0.01 s
    f = measured_figures(s, WORK, 0.1, 0.01)
    assert f.tokens_per_s == pytest.approx(2 * 8 * 16 / (0.1 + 15 * 0.01))


def test_fit_recovers_efficiency_latency_and_overhead_and_reranks(result):
    runs = _runs(result)
    _measure_from(_truth(result), result, runs)
    cal = fit_inference_model(result, runs)
    assert set(cal.terms) == {"efficiency", "latency", "overhead"}, cal.note
    assert cal.efficiency == pytest.approx(0.3, rel=1e-6)
    assert cal.intra_node_latency_s == pytest.approx(4e-4, rel=1e-6)
    assert cal.step_overhead_s == pytest.approx(3e-3, rel=1e-6) and cal.rms_error < 1e-9
    assert cal.num_measurements == 12  # TTFT and TPOT of each run

    emp = ie.InferenceEmpiricalResult(OPTIONS, 60, runs)
    recalibrate(result, emp)
    for r in runs:
        assert r.calibrated.tpot == pytest.approx(r.measured.tpot, rel=1e-6)
        assert r.calibrated.ttft == pytest.approx(r.measured.ttft, rel=1e-6)
    for name in ie.FIGURES:
        assert emp.spearman[name][1] == pytest.approx(1.0), name


def test_fit_with_the_efficiency_alone_when_the_runs_say_no_more(result):
    runs = _runs(result)[:3]  # tp 1 only: no collective to fit a latency to
    _measure_from(ie.with_efficiency(result.cluster, 0.4), result, runs)
    cal = fit_inference_model(result, runs, extra_terms=FIT_TERMS)
    assert cal.terms == ("efficiency",) and cal.efficiency == pytest.approx(0.4, rel=1e-6)


def test_a_measurement_faster_than_the_peak_is_refused(result):
    runs = _runs(result)[:2]
    _measure_from(result.cluster, result, runs)
    for r in runs:
        r.measured = dataclasses.replace(r.measured, ttft=r.measured.ttft / 100, tpot=r.measured.tpot / 100)
    with pytest.raises(ValueError, match="beat the peak"):
        fit_inference_model(result, runs)
    emp = ie.InferenceEmpiricalResult(OPTIONS, 60, runs)
    recalibrate(result, emp)  # the model is kept and said so
    assert emp.calibration is None and "calibration failed, the analytic model is kept" in emp.calibration_note


def test_no_final_winner_when_the_measured_figures_miss_the_limits():
    limited = search_inference(MODEL, CPU2, dataclasses.replace(WORK, max_tpot_s=0.05))
    assert limited.winner is not None  # predicted: every TPOT under 50 ms
    runs = _runs(limited)
    _measure_from(ie.with_efficiency(CPU2, 0.005), limited, runs)  # measured: far slower
    emp = ie.InferenceEmpiricalResult(OPTIONS, 60, runs)
    recalibrate(limited, emp)
    assert emp.final and emp.winner is None
    text = format_inference_empirical(emp)
    assert "no configuration meets the limits (measured where measured)" in text and "final winner" not in text


def _lines(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "res')  # a line cut by a kill
    return path


OK = {"status": "ok", "ttft_s": 0.05, "tpot_s": 0.01, "ttfts_s": [0.05] * 3, "decode_steps": 45, "peak_mem_gb": 0.5}


def test_outcomes_of_a_launch_killed_at_its_timeout(result, tmp_path):
    runs = _runs(result)[:4]
    out = _lines(
        tmp_path / "r.jsonl",
        {"event": "start", "index": 1},
        {"event": "result", "index": 1, **OK},
        {"event": "start", "index": 2},
        {"event": "result", "index": 2, "status": "out of memory", "reason": "OutOfMemoryError: CUDA out of memory"},
        {"event": "start", "index": 3},
    )
    record_outcomes(runs, out, None, "", 30.0, WORK)
    assert [r.status for r in runs] == ["ok", "out of memory", "timeout", "not run"]
    assert runs[0].measured.tpot == 0.01 and runs[0].decode_steps == 45
    assert "CUDA out of memory" in runs[1].reason and runs[2].reason.startswith("timeout after 30 s")
    final = final_ranking(search_inference(MODEL, CPU2, WORK), runs)
    shown = {f.evaluation.serving: f.source for f in final}
    assert runs[1].evaluation.serving not in shown and runs[2].evaluation.serving not in shown  # failures never win
    assert shown[runs[0].evaluation.serving] == "measured" and shown[runs[3].evaluation.serving] == "predicted"


def test_outcomes_of_a_crash_and_of_a_launch_that_never_started(result, tmp_path):
    runs = _runs(result)[:3]
    out = _lines(tmp_path / "r.jsonl", {"event": "start", "index": 1}, {"event": "result", "index": 1, **OK})
    with open(out, "a") as f:
        f.write('\n{"event": "start", "index": 2}\n')
    log = "Traceback (most recent call last):\nRuntimeError: shm all-reduce failed\n[launch.py:123] exiting"
    record_outcomes(runs, out, 1, log, 30.0, WORK)
    assert [r.status for r in runs] == ["ok", "failed", "not run"]  # #3 may run in a new launch
    assert runs[1].reason == "exit 1: RuntimeError: shm all-reduce failed"

    runs = _runs(result)[:3]  # in rounds: #1 and #3 had their requests cut short by #2's crash, not failed
    starts = [{"event": "start", "index": i, "request": q} for q in (0, 1) for i in (1, 2, 3)][:-1]
    record_outcomes(runs, _lines(tmp_path / "rounds.jsonl", *starts), 1, log, 30.0, WORK)
    assert [r.status for r in runs] == ["not run", "failed", "not run"]

    runs = _runs(result)  # loading the tp-2 model crashed: every tp-2 candidate failed, tp 1's results kept
    events = [{"event": "build", "tp": 1}, *({"event": "start", "index": i, "request": 0} for i in (1, 2, 3))]
    events += [{"event": "result", "index": i, **OK} for i in (1, 2, 3)] + [{"event": "build", "tp": 2}]
    record_outcomes(runs, _lines(tmp_path / "build.jsonl", *events), 1, log, 30.0, WORK)
    assert [r.status for r in runs] == ["ok"] * 3 + ["failed"] * 3
    assert runs[3].reason == "loading the model at tp 2: exit 1: RuntimeError: shm all-reduce failed"

    runs = _runs(result)[:2]
    record_outcomes(runs, tmp_path / "missing.jsonl", 2, "error: --num_gpus: the world size must equal tp", 30, WORK)
    assert [r.status for r in runs] == ["failed", "failed"]
    assert runs[0].reason == "launch failed before it: exit 2: error: --num_gpus: the world size must equal tp"


def test_the_launch_loop_reports_a_crash_per_candidate_and_relaunches_the_rest(result, tmp_path, monkeypatch):
    """A fake launch (no deepspeed): one launch holds tp 1 and 2 and crashes in its second candidate; the others run
    in a new launch; the final ranking leaves the crashed one out."""
    truth = _truth(result)
    launches = []

    def fake_run_process(cmd, log_path, timeout_s, env):
        plan = json.loads(Path(cmd[cmd.index("--plan") + 1]).read_text())
        out = Path(cmd[cmd.index("--out") + 1])
        launches.append([c["index"] for c in plan["candidates"]])
        with open(out, "w") as f:
            for c in plan["candidates"]:
                f.write(json.dumps({"event": "start", "index": c["index"]}) + "\n")
                if c["index"] == 2:
                    log_path.write_text("Fatal Python error: Segmentation fault\n")
                    return -11, 1.0
                s = Serving(c["tp"], 1, c["batch"], 2 // c["tp"])
                t = inference_time(MODEL, truth, s, WORK)
                rec = {"status": "ok", "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "ttfts_s": [t.ttft_s]}
                f.write(json.dumps({"event": "result", "index": c["index"], **rec, "decode_steps": 15}) + "\n")
        log_path.write_text("")
        return 0, 1.0

    monkeypatch.setattr(probe, "run_process", fake_run_process)
    said = []
    options = dataclasses.replace(OPTIONS, work_dir=str(tmp_path))
    emp = run_inference_empirical(result, str(tmp_path), options, time.monotonic() + 120, say=said.append)
    assert launches == [[1, 2, 3, 4, 5, 6], [3, 4, 5, 6]]
    assert [r.status for r in emp.runs] == ["ok", "failed", "ok", "ok", "ok", "ok"]
    assert emp.runs[1].reason == "exit -11: Fatal Python error: Segmentation fault"
    assert any("#2 tp 1, batch" in line and "failed" in line for line in said), said
    assert emp.calibration is not None and emp.calibration.efficiency == pytest.approx(0.3, rel=1e-4)
    assert emp.runs[1].evaluation.serving not in {f.evaluation.serving for f in emp.final}
    assert emp.winner.source == "measured"
    data = emp.as_dict()
    assert data["runs"][1]["status"] == "failed" and "replicas" in data["replicas_note"]


def test_a_budget_too_small_for_a_launch_runs_nothing_and_keeps_the_model(result, tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "run_process", lambda *a: pytest.fail("launched past the budget"))
    options = dataclasses.replace(OPTIONS, work_dir=str(tmp_path))
    emp = run_inference_empirical(result, str(tmp_path), options, time.monotonic() + 8, say=lambda s: None)
    assert {r.status for r in emp.runs} == {"not run"} and not emp.launches
    assert "no candidate was measured" in emp.calibration_note and emp.winner.source == "predicted"


HF_ARGS = ["--gpus", "2", "--gpus-per-node", "2", "--prompt-length", "32", "--output-length", "16"]


@pytest.mark.parametrize(
    "extra,setting",
    [
        (["--empirical"], "--max-minutes: required with --empirical"),
        (["--empirical", "--max-minutes", "1", "--empirical-top", "0"], "--empirical-top: must be at least 1"),
        (["--empirical", "--max-minutes", "1", "--kv-dtype", "fp8"], "--weight-dtype: the measuring run loads"),
        (["--empirical", "--max-minutes", "0"], "--max-minutes: must be positive"),
    ],
)
def test_cli_refuses_bad_empirical_requests_in_one_line(extra, setting, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **HF_CONFIG}))
    assert main(["--hf-dir", str(tmp_path), *HF_ARGS, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {setting}"), err


def test_cli_empirical_needs_an_exported_model(capsys):
    assert main(["--model", "llama3-8b", "--gpu", "h200", *HF_ARGS, "--empirical", "--max-minutes", "1"]) == 2
    assert "error: --empirical: measures an exported transformers model" in capsys.readouterr().err


HF_CONFIG = {
    "num_hidden_layers": SHAPE["layers"],
    "hidden_size": SHAPE["hidden"],
    "num_attention_heads": SHAPE["heads"],
    "num_key_value_heads": SHAPE["kv_heads"],
    "intermediate_size": SHAPE["ffn"],
    "vocab_size": SHAPE["vocab"],
    "max_position_embeddings": SHAPE["context"],
    "tie_word_embeddings": False,
}


def test_the_test_shape_is_the_exported_one(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **HF_CONFIG}))
    from ds_megatron.tune.inference.cli import hf_model_shape

    shape = hf_model_shape(str(tmp_path), None)
    assert dataclasses.replace(shape, dropout=MODEL.dropout) == MODEL  # dropout plays no part in inference
    assert evaluate_serving(MODEL, CPU2, Serving(1, 1, 1, 2), WORK).fits


# Real runs: the small Llama on 2 gloo CPU processes under deepspeed.init_inference.
