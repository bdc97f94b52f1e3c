#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020): 128 node(s) x 8 GPUs (80 GB), tp 8 x pp 8 x dp 16,
# sequence parallel on, recompute selective, micro-batch 1 x 96 accumulation = 1536 sequences of 2048.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_175b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=128
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_175b.json "$@"
