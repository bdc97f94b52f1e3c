#!/usr/bin/env bash
# The CPU demo: a tiny GPT on 4 CPU processes (tp 2 x pp 2, sequence parallel, selective recompute).
# Usage: bash recipes/gpt_tiny.sh [train_gpt.py flags]   (what `make demo` runs)
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=4
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
${DEEPSPEED:-deepspeed} --num_gpus "$GPUS_PER_NODE" recipes/train_gpt.py --deepspeed_config ds_configs/gpt_tiny.json "$@"
