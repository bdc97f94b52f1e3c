"""The tuner's empirical mode (python -m ds_megatron.tune --empirical): real short runs on 4 CPU processes, a failing
candidate, the time budget, and the pure-Python parts (Spearman, recalibration, budget, failure reasons)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ds_megatron.config import resolve
from ds_megatron.tune import Cluster, Measurement, build_model_shape, calibrate, fit_time_model, search, step_time
from ds_megatron.tune.__main__ import main
from ds_megatron.tune.core.calibration import FIT_TERMS
from ds_megatron.tune.core.launch import failure_reason, run_process, wait_group_gone
from ds_megatron.tune.core.session import FIRST_RUN_S, HANG_FACTOR, MIN_LAUNCH_S, plan_timeout, spearman
from ds_megatron.tune.training.empirical import ProbeRun, final_ranking
from ds_megatron.tune.training.probe import EmpiricalOptions, ProbeResult, probe_config, read_metrics

TINY = build_model_shape("gpt-tiny", None, None, None, 1024, 128)
CPU4 = Cluster(num_gpus=4, gpus_per_node=4, gpu_memory_gb=3, peak_tflops=0.05)
TINY_ARGS = [
    "--model",
    "gpt-tiny",
    "--vocab",
    "1024",
    "--seq-length",
    "128",
    "--global-batch-size",
    "16",
    "--gpus",
    "4",
    "--gpus-per-node",
    "4",
    "--gpu-memory-gb",
    "3",
    "--gpu-peak-tflops",
    "0.05",
]


@pytest.fixture(scope="module")
def tiny():
    return search(TINY, CPU4, 16)


# Spearman


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their average rank: x ranks [1, 2.5, 2.5, 4], y ranks [1, 2, 3, 4] -> Pearson of the ranks
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5.0))
    assert spearman([0.1, 0.5, 0.3], [1.0, 3.0, 2.0]) == pytest.approx(1.0)
    assert spearman([1.0], [2.0]) is None  # too few points
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a constant has no ranking
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


# Recalibration


def _spread(result):
    """Six candidates whose compute, collective count and slots differ (so the fit can tell the terms apart)."""
    keys = [(1, 1, 4, "none"), (1, 1, 1, "full/uniform/1"), (4, 1, 16, "none"), (2, 2, 4, "selective")]
    keys += [(2, 1, 2, "full/uniform/1"), (1, 4, 1, "none")]
    picked = []
    for tp, pp, b, label in keys:
        picked.append(
            next(
                e.candidate
                for e in result.ranked
                if (e.candidate.tp, e.candidate.pp, e.candidate.micro_batch_size) == (tp, pp, b)
                and e.candidate.recompute_label() == label
            )
        )
    return picked


def _measure(truth: Cluster, cands) -> list[Measurement]:
    """Exact 'measurements' from the time model itself, recorded against the default cluster."""
    return [Measurement(TINY, CPU4, c, 16, step_time(TINY, truth, c, 16).step_s) for c in cands]


def test_fit_recovers_efficiency_latency_and_overhead(tiny):
    truth = Cluster(
        num_gpus=4,
        gpus_per_node=4,
        gpu_memory_gb=3,
        peak_tflops=0.05,
        efficiency=0.2,
        intra_node_latency_s=3e-3,
        step_overhead_s=0.05,
    )
    cal = fit_time_model(_measure(truth, _spread(tiny)), extra_terms=FIT_TERMS)
    assert set(cal.terms) == {"efficiency", "latency", "overhead"}, cal.note
    assert cal.efficiency == pytest.approx(0.2, rel=1e-6)
    assert cal.intra_node_latency_s == pytest.approx(3e-3, rel=1e-6)
    assert cal.step_overhead_s == pytest.approx(0.05, rel=1e-6)
    assert cal.rms_error < 1e-9 < cal.rms_error_efficiency_only
    applied = cal.apply(CPU4)
    for m in _measure(truth, _spread(tiny)):
        assert step_time(TINY, applied, m.candidate, 16).step_s == pytest.approx(m.step_time_s, rel=1e-6)
    # without extra terms: the efficiency alone, whatever the data
    plain = fit_time_model(_measure(truth, _spread(tiny)))
    assert plain.terms == ("efficiency",) and plain.intra_node_latency_s is None and plain.step_overhead_s == 0


def test_fit_adds_nothing_to_an_exact_efficiency_fit_and_needs_enough_runs(tiny):
    truth = Cluster(num_gpus=4, gpus_per_node=4, gpu_memory_gb=3, peak_tflops=0.05, efficiency=0.3)
    cal = fit_time_model(_measure(truth, _spread(tiny)), extra_terms=FIT_TERMS)
    assert cal.terms == ("efficiency",) and cal.efficiency == pytest.approx(0.3, rel=1e-6)
    assert calibrate(_measure(truth, _spread(tiny))) == pytest.approx(0.3, rel=1e-6)
    # three runs: an extra term would leave fewer than two more runs than parameters
    lagged = Cluster(num_gpus=4, gpus_per_node=4, gpu_memory_gb=3, peak_tflops=0.05, intra_node_latency_s=5e-3)
    cal = fit_time_model(_measure(lagged, _spread(tiny)[:3]), extra_terms=FIT_TERMS)
    assert cal.terms == ("efficiency",) and "needs 4 runs" in cal.note
    with pytest.raises(ValueError, match="beat the peak"):
        fit_time_model([Measurement(TINY, CPU4, _spread(tiny)[0], 16, 1e-4)])


# Budget


def test_plan_timeout():
    # before any run: the fair share of the budget, but at least FIRST_RUN_S (the first run builds the data cache)
    assert plan_timeout(600, 3, []) == pytest.approx(200)
    assert plan_timeout(300, 3, []) == pytest.approx(FIRST_RUN_S)
    assert plan_timeout(50, 3, []) == pytest.approx(50)  # never past the budget
    assert plan_timeout(MIN_LAUNCH_S - 1, 3, []) is None  # no run finishes that fast
    # after runs: at least HANG_FACTOR x the slowest finished run, no launch if a typical run no longer fits
    assert plan_timeout(200, 2, [30, 20]) == pytest.approx(100)
    assert plan_timeout(100, 4, [30]) == pytest.approx(HANG_FACTOR * 30)
    assert plan_timeout(29, 1, [30]) is None
    assert plan_timeout(31, 1, [30]) == pytest.approx(31)


def test_final_ranking_prefers_measurements_and_drops_failures(tiny):
    first, second, third = tiny.ranked[:3]
    runs = [ProbeRun(1, 1, first, first.time.step_s), ProbeRun(2, 2, second, second.time.step_s)]
    runs.append(ProbeRun(3, 3, third, third.time.step_s))
    runs[0].outcome = ProbeResult("failed", "exit 2: error: boom", None)
    runs[1].outcome = ProbeResult("ok", None, 10 * second.time.step_s, [1.0], 0.5)  # measured much slower
    final = final_ranking(tiny.ranked, runs)  # run 3 was not run: predicted
    assert first.candidate not in [f.evaluation.candidate for f in final]
    assert final[0].evaluation.candidate == third.candidate and final[0].source == "predicted"
    assert [f.source for f in final].count("measured") == 1
    measured = next(f for f in final if f.source == "measured")
    assert measured.step_s == pytest.approx(10 * second.time.step_s)
    assert [f.step_s for f in final] == sorted(f.step_s for f in final)


# Probe: config, process groups, failure reasons, metrics


def test_probe_config_is_a_short_fp32_run_that_resolves(tiny, tmp_path):
    cache = f"ds_megatron.data.cache_dir={tmp_path / 'cache'}"
    settings = EmpiricalOptions(1, steps=5, warmup=2, device="cpu", extra_sets=(cache,))
    e = next(e for e in tiny.ranked if e.candidate.tp == 2 and e.candidate.pp == 2 and e.candidate.sequence_parallel)
    cfg = probe_config(tiny, e, settings, tmp_path / "run")
    assert "bf16" not in cfg and "zero_optimization" not in cfg
    sec = cfg["ds_megatron"]
    assert sec["train"]["train_iters"] == 7 and sec["train"]["log_interval"] == 1
    assert sec["train"]["generate_tokens"] == 0 and sec["train"]["eval_iters"] == 1
    assert sec["logging"] == {"wandb_project": None, "run_dir": str(tmp_path / "run")}
    assert sec["data"]["cache_dir"] == str(tmp_path / "cache")
    run = resolve(cfg, 4)
    assert (run.tp, run.pp, run.dp, run.micro_batch_size) == (2, 2, 1, e.candidate.micro_batch_size)
    gpu = probe_config(tiny, e, dataclasses.replace(settings, device="gpu"), tmp_path)
    assert gpu["bf16"] == {"enabled": True} and gpu["zero_optimization"] == {"stage": 1}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_wait_group_gone_waits_for_live_members_only():
    member = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert not wait_group_gone(member.pid, timeout_s=0.2)  # a live member: still there after the timeout
        os.kill(member.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(member.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        # exited and not yet reaped by its parent (this process): a zombie holds no memory or port, so gone
        assert Path(f"/proc/{member.pid}/stat").exists()
        assert wait_group_gone(member.pid, timeout_s=5)
    finally:
        member.kill()
        member.wait()
    assert wait_group_gone(member.pid, timeout_s=0)  # reaped: no member at all


def test_run_process_kills_the_whole_group_on_timeout(tmp_path):
    pid_file = tmp_path / "child.pid"
    # a launcher and its rank: a shell (it starts in milliseconds, so a short timeout still finds the child started)
    parent = f"sleep 60 & echo $! > {str(pid_file)!r}; echo started; sleep 60"
    start = time.monotonic()
    code, duration = run_process(["sh", "-c", parent], tmp_path / "out.log", 1.0, dict(os.environ))
    assert code is None and 0.9 < duration < 10 and time.monotonic() - start < 10
    assert "started" in (tmp_path / "out.log").read_text()
    pid = int(pid_file.read_text())
    # gone when run_process returns, not some time later: the group's SIGKILLed members can take over a second to
    # exit on a loaded machine, and a caller checking then found them still running
    assert not _alive(pid), "the grandchild survived the timeout"
    code, _ = run_process(["sh", "-c", "exit 3"], tmp_path / "o.log", 30, dict(os.environ))
    assert code == 3


def test_failure_reasons():
    launcher = "[2026-01-01 00:00:00,000] [ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = 2"
    config = "noise\nerror: ds_megatron.x: unknown key (valid keys: a, b); did you mean 'a'?\n" + launcher
    assert failure_reason(2, config, 60) == (
        "failed",
        "exit 2: error: ds_megatron.x: unknown key (valid keys: a, b); did you mean 'a'?",
    )
    trace = "Traceback (most recent call last):\n  File 'x.py'\nRuntimeError: shapes do not match\n" + launcher
    assert failure_reason(1, trace, 60) == ("failed", "exit 1: RuntimeError: shapes do not match")
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n" + launcher
    status, reason = failure_reason(1, oom, 60)
    assert status == "out of memory" and "Tried to allocate" in reason
    assert failure_reason(None, "", 42.4) == ("timeout", "timeout after 42 s (process group killed)")
    assert "SIGKILL" in failure_reason(-9, "", 60)[1]
    assert failure_reason(5, "", 60) == ("failed", "exit 5: no output")


def test_read_metrics_drops_the_warmup(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "step_ms": 100.0 * s, "peak_mem_gb": 0.1 * s} for s in range(1, 6)]
    records.append({"step": 5, "val_loss": 3.0})
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 6, "step_')  # a line cut by a kill
    times, peak = read_metrics(path, warmup_steps=2)
    assert times == pytest.approx([0.3, 0.4, 0.5]) and peak == pytest.approx(0.5)
    assert read_metrics(tmp_path / "missing.jsonl", 2) == ([], None)


def test_cli_refuses_bad_empirical_requests(capsys):
    assert main([*TINY_ARGS, "--empirical"]) == 2
    assert "--max-minutes: required with --empirical" in capsys.readouterr().err
    assert main([*TINY_ARGS, "--empirical", "--max-minutes", "1", "--gpus-per-node", "2"]) == 2
    assert "runs on this machine only" in capsys.readouterr().err
    assert main([*TINY_ARGS, "--empirical", "--max-minutes", "0"]) == 2
    assert main([*TINY_ARGS, "--empirical", "--max-minutes", "1", "--empirical-steps", "0"]) == 2


def test_cli_takes_the_fitted_constants(tmp_path, capsys):
    base, shifted = tmp_path / "base.json", tmp_path / "shifted.json"
    assert main([*TINY_ARGS, "--json", str(base)]) == 0
    assert main([*TINY_ARGS, "--step-overhead-s", "0.5", "--intra-node-latency-us", "20", "--json", str(shifted)]) == 0
    a, b = json.loads(base.read_text())["winner"], json.loads(shifted.read_text())["winner"]
    assert b["step_time_s"] == pytest.approx(a["step_time_s"] + 0.5) and b["time"]["overhead_s"] == 0.5
    slow = tmp_path / "slow.json"
    assert main([*TINY_ARGS, "--intra-node-latency-us", "5000", "--json", str(slow)]) == 0
    data = json.loads(slow.read_text())
    assert data["cluster"]["intra_node_latency_s"] == pytest.approx(5e-3) and data["winner"]["tp"] == 1
    assert "latency 5,000 us intra-node" in capsys.readouterr().out
    assert main([*TINY_ARGS, "--intra-node-latency-us", "-1"]) == 2
    assert "--intra-node-latency-us: must not be negative" in capsys.readouterr().err


# Real runs: 4 gloo CPU processes, the tiny model
