"""What the per-size config generators (scripts/gpt3_configs.py, scripts/llama_configs.py, scripts/moe_configs.py)
share: ask the tuner (``ds_megatron.tune``) for the layout of a named size on nodes of 8 GPUs, give a config the
training sections every shipped config has, and write the config with its launch script in recipes/.

A family's script owns its hyperparameters and token budget; this module owns how a tuned layout becomes a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ds_megatron.config import ModelShape
from ds_megatron.tune import Pins, build_cluster, build_model_shape, search
from ds_megatron.tune.training.search import Evaluation
from ds_megatron.tune.training.written import ds_config

ROOT = Path(__file__).resolve().parent.parent
GPUS_PER_NODE = 8
GPU_LABELS = {"h100-sxm": "H100 80GB", "a100-80gb": "A100 80GB"}  # the recipes' one-line description of a node


@dataclass(frozen=True)
class Tuned:
    """The tuner's winner for one size: its config (DeepSpeed keys and the layout) and its predictions."""

    config: dict
    winner: Evaluation
    model: ModelShape
    command: str  # the tuner command that reproduces the choice

    @property
    def dp(self) -> int:
        return self.winner.candidate.dp


def tune(size: str, gpus: int, global_batch: int, gpu: str = "h100-sxm", pins: Pins | None = None) -> Tuned:
    """The tuner's winner for ``size`` on ``gpus`` GPUs of ``gpu`` (nodes of 8) at ``global_batch`` sequences."""
    model = build_model_shape(size, None, None, None, None, None)
    result = search(model, build_cluster(gpu, gpus, GPUS_PER_NODE), global_batch, pins or Pins())
    if result.winner is None:
        raise SystemExit(f"{size} on {gpus} x {gpu}: no configuration fits")
    command = f"python -m ds_megatron.tune --model {size} --gpu {gpu} --gpus {gpus} --global-batch-size {global_batch}"
    for flag, value in _pin_flags(pins or Pins()):
        command += f" {flag}{'' if value is None else f' {value}'}"
    return Tuned(ds_config(result, result.winner), result.winner, model, command)


def _pin_flags(pins: Pins) -> list[tuple[str, object]]:
    flags: list[tuple[str, object]] = []
    dims = (("tp", "--tp"), ("cp", "--cp"), ("cp_comm", "--cp-comm"), ("pp", "--pp"), ("dp", "--dp"), ("ep", "--ep"))
    for name, flag in (*dims, ("micro_batch_size", "--micro-batch-size")):
        if getattr(pins, name) is not None:
            flags.append((flag, getattr(pins, name)))
    if pins.sequence_parallel is not None:
        flags.append(("--sequence-parallel" if pins.sequence_parallel else "--no-sequence-parallel", None))
    for name in ("recompute", "attention", "zero"):
        if getattr(pins, name) is not None:
            flags.append((f"--{name}", getattr(pins, name)))
    if pins.recompute_modules is not None:
        flags.append(("--recompute-modules", ",".join(pins.recompute_modules)))
    for name in ("schedule", "virtual_stages"):
        if getattr(pins, name) is not None:
            flags.append((f"--{name.replace('_', '-')}", getattr(pins, name)))
    return flags


def warmup_cosine(total_steps: int, warmup_steps: int) -> dict:
    """DeepSpeed's WarmupCosineLR: linear warm-up from 0, cosine decay to 10% of the peak."""
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": total_steps,
            "warmup_num_steps": warmup_steps,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.1,
            "warmup_type": "linear",
        },
    }


def run_sections(stem: str, train_iters: int) -> dict:
    """The "ds_megatron" sections every shipped config has after its model and layout: training length and
    cadence, data (pass your corpus with --data), wandb logging, checkpoints under checkpoints/<stem>."""
    train = {"train_iters": train_iters, "log_interval": 10, "eval_interval": 1000, "eval_iters": 10, "seed": 1234}
    return {
        "train": train,
        "data": {"path": None, "tokenizer": None, "num_proc": 16},
        "logging": {"wandb_project": "ds_megatron"},
        "checkpoint": {"save": f"checkpoints/{stem}", "save_interval": 1000, "keep_last": 3},
    }


def recipe(stem: str, title: str, tuned: Tuned, gpu: str, generator: str, note: str, usage: str) -> str:
    """The launch script: the node count, the layout and where it came from in comments, then deepspeed."""
    cfg = tuned.config
    par, recompute = cfg["ds_megatron"]["parallel"], cfg["ds_megatron"]["recompute"]
    rc = recompute["policy"] + (f" of {', '.join(recompute['modules'])}" if "modules" in recompute else "")
    cp = par.get("cp", 1)  # world = tp x cp x pp x dp
    gpus = par["tp"] * cp * par["pp"] * tuned.dp
    nodes = max(1, gpus // GPUS_PER_NODE)
    cp_text = f"cp {cp} ({par['cp_comm']}) x " if cp > 1 else ""
    sp = "on" if par["sequence_parallel"] else "off"
    ep_text = f", experts over ep {par['ep']}" if "ep" in par else ""  # a mixture of experts' layout
    attention = cfg["ds_megatron"]["model"]["attention"]
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    return f"""#!/usr/bin/env bash
# {title}: {nodes} node(s) x 8 {GPU_LABELS[gpu]}, tp {par["tp"]} x {cp_text}pp {par["pp"]} x dp {tuned.dp}{ep_text},
# sequence parallel {sp}, recompute {rc}, attention {attention},
# micro-batch {micro} x {gas} accumulation = {cfg["train_batch_size"]} sequences of {tuned.model.seq_length}.
# Chosen by `{tuned.command}`;
# regenerate with {generator}.{f"  {note}" if note else ""}
# Usage: [HOSTFILE=hostfile] bash recipes/{stem}.sh {usage}
set -euo pipefail
cd "$(dirname "$0")/{"/".join([".."] * (stem.count("/") + 1))}"
NODES={nodes}
GPUS_PER_NODE={GPUS_PER_NODE}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${{HOSTFILE:-hostfile}}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \\
  recipes/train_gpt.py --deepspeed_config ds_configs/{stem}.json "$@"
"""


def write(stem: str, cfg: dict, script: str) -> None:
    """ds_configs/<stem>.json and recipes/<stem>.sh (executable); ``stem`` may hold a subdirectory."""
    config = ROOT / "ds_configs" / f"{stem}.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(cfg, indent=2) + "\n")
    path = ROOT / "recipes" / f"{stem}.sh"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)
    print(f"wrote ds_configs/{stem}.json and recipes/{stem}.sh")
