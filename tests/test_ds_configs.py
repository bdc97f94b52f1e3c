"""Every JSON in ds_configs/ validates for the GPU count its launch script in recipes/ asks for (batch arithmetic
included), and the GPT-3 configs carry the published hyperparameters (Brown et al. 2020, Table 2.1)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds_megatron.config import resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
GPT3 = {  # name: (tokens per batch, learning rate)
    "125m": (0.5e6, 6.0e-4),
    "350m": (0.5e6, 3.0e-4),
    "760m": (0.5e6, 2.5e-4),
    "1.3b": (1e6, 2.0e-4),
    "2.7b": (1e6, 1.6e-4),
    "6.7b": (2e6, 1.2e-4),
    "13b": (2e6, 1.0e-4),
    "175b": (3.2e6, 0.6e-4),
}


def intended_world_size(config: Path) -> int:
    script = (ROOT / "recipes" / f"{config.stem}.sh").read_text()
    nodes = int(re.search(r"^NODES=(\d+)", script, re.M).group(1))
    per_node = int(re.search(r"^GPUS_PER_NODE=(\d+)", script, re.M).group(1))
    assert f"ds_configs/{config.name}" in script
    return nodes * per_node


def test_every_size_has_a_config_and_a_recipe():
    names = {p.stem for p in CONFIGS}
    assert {f"gpt3_{n}" for n in GPT3} | {"gpt_tiny"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_validates_for_its_cluster(config):
    cfg = json.loads(config.read_text())
    run = resolve(cfg, intended_world_size(config))
    assert run.global_batch_size == run.micro_batch_size * run.grad_accum_steps * run.dp


@pytest.mark.parametrize("name", sorted(GPT3))
def test_gpt3_hyperparameters(name):
    cfg = json.loads((ROOT / "ds_configs" / f"gpt3_{name}.json").read_text())
    run = resolve(cfg, intended_world_size(ROOT / "ds_configs" / f"gpt3_{name}.json"))
    tokens, lr = GPT3[name]
    assert run.model.seq_length == 2048 and run.model.vocab_size == 50257
    assert abs(run.global_batch_size * 2048 - tokens) / tokens < 0.05
    opt = cfg["optimizer"]["params"]
    assert opt["lr"] == lr and opt["betas"] == [0.9, 0.95] and opt["weight_decay"] == 0.1
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"]["enabled"] and cfg["zero_optimization"]["stage"] == 1
    assert cfg["data_types"]["grad_accum_dtype"] == "fp32"
    sched = cfg["scheduler"]["params"]
    assert sched["cos_min_ratio"] == 0.1
    assert abs(sched["warmup_num_steps"] * run.global_batch_size * 2048 - 375e6) / 375e6 < 0.1
    assert run.tp <= 8  # tensor parallelism stays inside a node of 8
    if run.tp > 1:
        assert run.section.parallel.sequence_parallel
