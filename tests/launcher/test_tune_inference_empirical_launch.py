"""The launcher tests of ``tests/unit/test_tune_inference_empirical.py``: that file's docstring states their subject."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from test_tune_inference_empirical import ROOT, SHAPE

from ds_megatron.tune.inference import probe
from ds_megatron.tune.inference.cli import main

# One core of this machine, with room: benchmarks/inference_accuracy.py's cpu_figures measured 96-154 GFLOP/s (fp32
# GEMM) and 7.7-15.9 GB/s (copy) depending on the load; a fitted efficiency above 1 is refused, so the figures must
# never undercut the machine (0.1 TFLOP/s did on a quiet one: its prefill beat that peak).  Their ratio is what
# shapes the ranking (where decode turns compute-bound); the fitted efficiency absorbs their common scale.
CPU_CORE = (0.4, 32.0)


@pytest.mark.slow
def test_empirical_mode_measures_eight_candidates_and_ranks_them_after_calibration(tmp_path, capsys, monkeypatch):
    """tp 1 and 2 at batches 1, 4, 16 and 64: eight candidates in one launch of 2 processes, plus a ninth tp-1
    candidate whose batch no machine holds: it fails out of memory and the others still run.  After the
    refit, the predicted TPOT and tokens/s rank the measured ones with Spearman >= 0.8 (both correlations are
    printed before calibration too)."""
    from inference_accuracy import save_random_llama, tune_args

    hf_dir = save_random_llama(tmp_path / "llama", **SHAPE)
    plan = probe.launch_plan

    def plan_with_a_huge_batch(result, hf, options, runs):
        p = plan(result, hf, options, runs)
        p["candidates"].insert(4, {"index": 99, "tp": 1, "batch": 10**9})  # one more tp-1 candidate, last of its tp
        return p

    monkeypatch.setattr(probe, "launch_plan", plan_with_a_huge_batch)
    original = probe.record_outcomes
    huge = {}

    def keep_the_huge_one(runs, out, *args):
        huge.update(probe.read_results(out)[1].get(99, {}))
        return original(runs, out, *args)

    monkeypatch.setattr(probe, "record_outcomes", keep_the_huge_one)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = argparse.Namespace(prompt=32, output=16, batch_sizes="1,4,16,64", repeats=2, max_minutes=4)
    out = tmp_path / "tune.json"
    argv = tune_args(hf_dir, args, *CPU_CORE)[1:] + ["--empirical-dir", str(tmp_path / "runs"), "--json", str(out)]
    start = time.monotonic()
    code = main(argv)
    wall = time.monotonic() - start
    text = capsys.readouterr().out
    assert code == 0, text[-6000:]
    assert wall < 4 * 60 + 10, text[-3000:]
    emp = json.loads(out.read_text())["empirical"]
    assert [(x["world_size"], x["returncode"]) for x in emp["launches"]] == [(2, 0)]  # tp 1 and 2 in one launch
    assert huge["status"] == "out of memory" and "alloc" in huge["reason"].lower(), huge
    runs = emp["runs"]
    assert [r["status"] for r in runs] == ["ok"] * 8, json.dumps(runs, indent=1)[-3000:]
    assert all(r["measured"]["tpot"] > 0 and r["decode_steps"] == 2 * 15 for r in runs)
    rho = emp["spearman"]
    assert emp["calibration"] is not None, json.dumps(emp, indent=1)[-3000:]
    print({k: v for k, v in rho.items()}, emp["calibration"]["note"], f"{wall:.0f} s")
    assert rho["tpot"]["analytic"] is not None and rho["tokens_per_s"]["analytic"] is not None
    assert rho["tpot"]["calibrated"] >= 0.8 and rho["tokens_per_s"]["calibrated"] >= 0.8, (rho, text[-4000:])
    assert "rank correlation (Spearman)" in text and "final winner (measured)" in text
