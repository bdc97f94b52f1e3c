"""Write ds_configs/llama3_<size>.json and recipes/llama3_<size>.sh: the layout chosen by the tuner
(``python -m ds_megatron.tune``) for nodes of 8 H100 SXM GPUs, plus the training hyperparameters below.

    .venv/bin/python scripts/llama_configs.py   # rewrites the four configs and recipes

Hyperparameters (Touvron et al. 2023, Llama 2, sec. 2.2, which Llama 3 keeps for these sizes): AdamW betas (0.9,
0.95), eps 1e-5, weight decay 0.1, clipping 1.0, 2,000 linear warm-up steps, cosine decay to 10% of the peak; peak
learning rates from ds_megatron.config.sizes (3e-4; 1.5e-4 for 70B); 4M-token batches (512 sequences of 8,192).
The token budget is ours: 500B tokens (119,209 steps), a recipe-sized run rather than Llama 3's 15T.
bf16 with ZeRO-1 and fp32 gradient accumulation, no dropout (Llama pretraining uses none).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ds_megatron.config.sizes import LEARNING_RATES

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 512
SEQ = 8192
TOKENS = 500e9
WARMUP_STEPS = 2000
SIZES = {  # file stem: (named size, GPUs)
    "llama3_1b": ("llama3.2-1b", 8),
    "llama3_3b": ("llama3.2-3b", 8),
    "llama3_8b": ("llama3-8b", 8),
    "llama3_70b": ("llama3-70b", 64),
}


def tuned(size: str, gpus: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "c.json"
        cmd = [sys.executable, "-m", "ds_megatron.tune", "--model", size, "--gpu", "h100-sxm"]
        cmd += ["--global-batch-size", str(GLOBAL_BATCH), "--gpus", str(gpus), "--write-config", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        return json.loads(out.read_text())


def config(stem: str, size: str, gpus: int) -> dict:
    cfg = tuned(size, gpus)
    steps = int(TOKENS // (GLOBAL_BATCH * SEQ))
    cfg["optimizer"]["params"].update(lr=LEARNING_RATES[size], eps=1e-5)
    cfg["scheduler"] = {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": steps,
            "warmup_num_steps": WARMUP_STEPS,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.1,
            "warmup_type": "linear",
        },
    }
    cfg["steps_per_print"] = 1_000_000_000
    section = cfg["ds_megatron"]
    section["model"] = {"size": size, "attention": section["model"]["attention"], "dropout": 0.0}
    section["train"] = {"train_iters": steps, "log_interval": 10, "eval_interval": 1000, "eval_iters": 10, "seed": 1234}
    section["data"] = {"path": None, "tokenizer": None, "num_proc": 16}
    section["logging"] = {"wandb_project": "ds_megatron"}
    section["checkpoint"] = {"save": f"checkpoints/{stem}", "save_interval": 1000, "keep_last": 3}
    return cfg


def recipe(stem: str, size: str, gpus: int, cfg: dict) -> str:
    par, rc = cfg["ds_megatron"]["parallel"], cfg["ds_megatron"]["recompute"]["policy"]
    nodes = gpus // 8
    dp = gpus // (par["tp"] * par["pp"])
    sp = "on" if par["sequence_parallel"] else "off"
    attention = cfg["ds_megatron"]["model"]["attention"]
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    return f"""#!/usr/bin/env bash
# {size} (Llama 3 shapes): {nodes} node(s) x 8 H100 80GB, tp {par["tp"]} x pp {par["pp"]} x dp {dp},
# sequence parallel {sp}, recompute {rc}, attention {attention},
# micro-batch {micro} x {gas} accumulation = {GLOBAL_BATCH} sequences of {SEQ}.
# Chosen by `python -m ds_megatron.tune --model {size} --gpu h100-sxm --gpus {gpus} --global-batch-size {GLOBAL_BATCH}`;
# regenerate with scripts/llama_configs.py.  Pass a Llama 3 tokenizer directory (vocabulary 128,256) as --tokenizer.
# Usage: [HOSTFILE=hostfile] bash recipes/{stem}.sh --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES={nodes}
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${{HOSTFILE:-hostfile}}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \\
  recipes/train_gpt.py --deepspeed_config ds_configs/{stem}.json "$@"
"""


def main() -> None:
    for stem, (size, gpus) in SIZES.items():
        cfg = config(stem, size, gpus)
        (ROOT / "ds_configs" / f"{stem}.json").write_text(json.dumps(cfg, indent=2) + "\n")
        path = ROOT / "recipes" / f"{stem}.sh"
        path.write_text(recipe(stem, size, gpus, cfg))
        path.chmod(0o755)
        print(f"wrote ds_configs/{stem}.json and recipes/{stem}.sh")


if __name__ == "__main__":
    main()
