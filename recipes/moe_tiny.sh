#!/usr/bin/env bash
# The CPU demo of the mixture-of-experts family: moe-tiny (Qwen3-MoE layout: 4 layers, h 128, 4 heads, 2 KV heads, layer 0 a dense SwiGLU 352,
# layers 1-3 routed: 8 experts of width 64, top 2) on 4 CPU processes (tp 2 x pp 2, sequence parallel, selective recompute of core_attn and moe).
# Usage: bash recipes/moe_tiny.sh [train_gpt.py flags]   (what `make demo-moe` runs)
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=4
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
${DEEPSPEED:-deepspeed} --num_gpus "$GPUS_PER_NODE" recipes/train_gpt.py --deepspeed_config ds_configs/moe_tiny.json "$@"
