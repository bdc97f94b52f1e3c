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


# torch.cuda.get_device_name() strings and their dense bf16 peaks (ds_megatron/gpus.py gives the sources)
DEVICE_PEAKS = {
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA H100 80GB HBM3": 989,
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA H200": 989,
    "NVIDIA H200 NVL": 835,
    "NVIDIA GH200 480GB": 989,
    "NVIDIA B200": 2250,
    "NVIDIA L40S": 362,
}


@pytest.mark.parametrize("name", list(DEVICE_PEAKS))
def test_peak_from_the_full_device_name(name):
    assert lookup_peak_tflops(name) == DEVICE_PEAKS[name]


def test_unknown_gpu_gives_no_mfu_and_one_message(capsys):
    """A name the table does not know (a substring match would give an H800 or an H100 variant the H100 SXM's
    figure) gets no peak, so no MFU, and one message naming the setting that supplies it."""
    for name in ("NVIDIA H800", "NVIDIA H100", "Tesla V100-SXM2-16GB", "NVIDIA GB300"):
        assert lookup_peak_tflops(name) is None
        assert lookup_peak_tflops(name) is None
        err = capsys.readouterr().err
        assert err.count("--peak-tflops") == 1 and repr(name) in err, err
    assert throughput(2.0, 8, 1024, 4, 512, 1000, 4, "none", None, lookup_peak_tflops("NVIDIA H800"))["mfu"] is None
    assert lookup_peak_tflops(None) is None and capsys.readouterr().err == ""  # CPU: nothing to say


def test_tuner_presets_read_the_same_peaks():
    from ds_megatron.gpus import DENSE_BF16_TFLOPS
    from ds_megatron.tune import GPUS

    assert GPUS["h100-sxm"].peak_tflops == lookup_peak_tflops("NVIDIA H100 80GB HBM3") == DENSE_BF16_TFLOPS["h100-sxm"]
    assert GPUS["h100-pcie"].peak_tflops == lookup_peak_tflops("NVIDIA H100 PCIe") == 756
    assert GPUS["a100-80gb"].peak_tflops == lookup_peak_tflops("NVIDIA A100-SXM4-80GB") == 312


def test_hfu_of_selective_recompute_counts_its_modules():
    """The run's recompute as the trainer reads it: selective over the MLP activation (the shipped Llama 3 8B
    config) re-runs no matmul, so HFU equals MFU; over the core attention HFU adds its forward."""
    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.flops import core_attention_forward_flops
    from ds_megatron.metrics import recompute_fields

    llama = dict(family="llama", num_heads=32, num_kv_heads=8, intermediate_size=14336)
    args = (2.0, 8, 8192, 32, 4096, 128256, 8)
    mlp_act = recompute_fields(RecomputeSection(policy="selective", modules=("mlp_act",)), 1, 32)
    t = throughput(*args, peak_tflops=989.0, **mlp_act, **llama)
    assert t["hfu"] == t["mfu"]
    core = recompute_fields(RecomputeSection(policy="selective"), 1, 32)
    assert core["recompute_modules"] == ("core_attn",)
    t = throughput(*args, peak_tflops=989.0, **core, **llama)
    extra = 32 * core_attention_forward_flops(8, 8192, 4096) / 2.0 / 8 / 1e12 / 989.0
    assert t["hfu"] == pytest.approx(t["mfu"] + extra)
    block = recompute_fields(RecomputeSection(policy="full", method="block", num_layers=3), 4, 32)
    assert block == {"recompute": "full", "recomputed_layers": 12, "recompute_modules": ()}


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
