#!/usr/bin/env bash
# GPT-3 13B (Brown et al. 2020): 8 node(s) x 8 GPUs (80 GB), tp 8 x pp 1 x dp 8,
# sequence parallel on, recompute selective, micro-batch 4 x 32 accumulation = 1024 sequences of 2048.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_13b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=8
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_13b.json "$@"
