#!/usr/bin/env bash
# The CPU demo: a tiny Llama (4 layers, h 128, 4 heads, 2 KV heads, SwiGLU 352) on 4 CPU processes (tp 2 x pp 2, sequence parallel, selective recompute).
# Usage: bash recipes/llama_tiny.sh [train_gpt.py flags]   (what `make demo-llama` runs)
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=4
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
${DEEPSPEED:-deepspeed} --num_gpus "$GPUS_PER_NODE" recipes/train_gpt.py --deepspeed_config ds_configs/llama_tiny.json "$@"
