#!/usr/bin/env bash
# GPT-3 125M (Brown et al. 2020): 1 node(s) x 8 GPUs (80 GB), tp 1 x pp 1 x dp 8,
# sequence parallel off, recompute none, micro-batch 8 x 4 accumulation = 256 sequences of 2048.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_125m.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_125m.json "$@"
