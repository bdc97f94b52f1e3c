"""Logging pieces that need no processes: throughput formulas and wandb's fallback to offline."""

from __future__ import annotations

import json

import pytest

from ds_megatron.flops import model_flops_per_step
from ds_megatron.metrics import MetricsLogger, WandbRun, lookup_peak_tflops, throughput


def test_throughput_and_mfu():
    t = throughput(2.0, 8, 1024, 4, 512, 1000, 4, "full", None, peak_tflops=100.0)
    model = model_flops_per_step(8, 1024, 4, 512, 1000)
    assert t["tokens_per_s"] == 8 * 1024 / 2.0
    assert t["tflops_per_gpu"] == pytest.approx(model / 2.0 / 4 / 1e12)
    assert t["mfu"] == pytest.approx(t["tflops_per_gpu"] / 100.0)
    assert t["hfu"] > t["mfu"]  # full recompute executes one more forward
    assert throughput(2.0, 8, 1024, 4, 512, 1000, 4, "none", None, None)["mfu"] is None
    assert lookup_peak_tflops("NVIDIA H200") == 989.0 and lookup_peak_tflops(None) is None


def test_misconfigured_wandb_warns_then_runs_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = WandbRun("proj", "name", ("t",), "not-a-mode", {"a": 1}, tmp_path, None)
    assert "warning: wandb (not-a-mode) failed" in capsys.readouterr().err
    assert run.run is not None and run.id
    logger = MetricsLogger(tmp_path, 10, 0, True, run)
    logger.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.5
    assert list((tmp_path / "wandb").glob("offline-run-*"))
