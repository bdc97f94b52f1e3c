"""Every JSON in ds_configs/ validates for the GPU count its launch script in recipes/ asks for (batch arithmetic
included), and the GPT-3 configs carry the published hyperparameters (Brown et al. 2020, Table 2.1).  The paper
variant in ds_configs/paper/ (not globbed with ds_configs/*.json, so it has no miniature run) is checked here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds_megatron.config import resolve

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
PAPER_175B = ROOT / "ds_configs" / "paper" / "gpt3_175b_a100.json"  # Korthikanti et al. 2022's layout on A100s
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
    """Nodes x GPUs per node of the config's recipe: ds_configs/a/b.json is launched by recipes/a/b.sh."""
    stem = config.relative_to(ROOT / "ds_configs").with_suffix("")
    script = (ROOT / "recipes" / f"{stem}.sh").read_text()
    nodes = int(re.search(r"^NODES=(\d+)", script, re.M).group(1))
    per_node = int(re.search(r"^GPUS_PER_NODE=(\d+)", script, re.M).group(1))
    assert f"ds_configs/{stem}.json" in script
    return nodes * per_node


def test_every_size_has_a_config_and_a_recipe():
    names = {p.stem for p in CONFIGS}
    assert {f"gpt3_{n}" for n in GPT3} | {"gpt_tiny", "moe_tiny"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_validates_for_its_cluster(config):
    cfg = json.loads(config.read_text())
    run = resolve(cfg, intended_world_size(config))
    assert run.global_batch_size == run.micro_batch_size * run.grad_accum_steps * run.dp


@pytest.mark.parametrize(
    "name,path",
    [(n, ROOT / "ds_configs" / f"gpt3_{n}.json") for n in sorted(GPT3)] + [("175b", PAPER_175B)],
    ids=[*sorted(GPT3), "paper-175b-a100"],
)
def test_gpt3_hyperparameters(name, path):
    cfg = json.loads(path.read_text())
    run = resolve(cfg, intended_world_size(path))
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
    assert abs(sched["total_num_steps"] * run.global_batch_size * 2048 - 260e9) / 260e9 < 1e-3
    assert run.tp <= 8  # tensor parallelism stays inside a node of 8
    if run.tp > 1:
        assert run.section.parallel.sequence_parallel


def test_paper_variant_resolves_for_its_1024_a100s():
    """GPT-3 175B as Korthikanti et al. 2022 train it (Table 3: tp 8, pp 8, SP, selective recompute, eager
    attention, micro-batch 1) on 1,024 GPUs with GPT-3's batch of 1,536 sequences."""
    assert PAPER_175B not in CONFIGS and intended_world_size(PAPER_175B) == 1024
    run = resolve(json.loads(PAPER_175B.read_text()), 1024)
    assert (run.tp, run.pp, run.dp, run.micro_batch_size, run.grad_accum_steps) == (8, 8, 16, 1, 96)
    assert run.section.parallel.sequence_parallel and run.section.recompute.policy == "selective"
    assert run.model.attention == "eager" and run.model.num_layers == 96 and run.model.hidden_size == 12288


def test_bf16_gradients_are_reduced_in_fp32_unless_the_config_says_otherwise():
    """DeepSpeed all-reduces the BF16 optimizer's fp32-accumulated gradients over dp x cp in
    communication_data_type, the model's dtype when unset (bf16); the DeepSpeed config ds_megatron hands it sets fp32
    for every shipped bf16 config, keeps a user's own value, and leaves runs without the BF16 optimizer alone."""
    from ds_megatron.engine import deepspeed_config_for

    bf16 = [c for c in [*CONFIGS, PAPER_175B] if (json.loads(c.read_text()).get("bf16") or {}).get("enabled")]
    assert len(bf16) >= 13
    for config in bf16:
        cfg = json.loads(config.read_text())
        assert "communication_data_type" not in cfg, config.name
        notes: list[str] = []
        ds = deepspeed_config_for(resolve(cfg, intended_world_size(config)), notes)
        assert ds["communication_data_type"] == "fp32", config.name
        assert any("communication_data_type fp32" in n for n in notes), notes
        for own in ("bf16", "fp32"):
            mine = deepspeed_config_for(resolve({**cfg, "communication_data_type": own}, intended_world_size(config)))
            assert mine["communication_data_type"] == own
    tiny = ROOT / "ds_configs" / "gpt_tiny.json"  # fp32: DeepSpeed already reduces in fp32
    ds = deepspeed_config_for(resolve(json.loads(tiny.read_text()), intended_world_size(tiny)))
    assert "communication_data_type" not in ds


def test_every_shipped_config_names_its_attention_kernel():
    """The default kernel (sdpa) never decides a shipped run: the paper variant and the tiny CPU demos (selective
    recompute of the core, the paper's, which needs the materialised softmax) name eager, the sized GPT-3 and Llama
    configs sdpa."""
    kernels = {
        c.relative_to(ROOT / "ds_configs").as_posix(): json.loads(c.read_text())["ds_megatron"]["model"].get(
            "attention"
        )
        for c in [*CONFIGS, PAPER_175B]
    }
    eager = {"paper/gpt3_175b_a100.json", "gpt_tiny.json", "llama_tiny.json", "moe_tiny.json"}
    assert {name for name, kernel in kernels.items() if kernel == "eager"} == eager
    assert all(kernel == "sdpa" for name, kernel in kernels.items() if name not in eager), kernels
