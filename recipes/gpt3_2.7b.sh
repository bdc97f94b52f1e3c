#!/usr/bin/env bash
# GPT-3 2.7B (Brown et al. 2020): 2 node(s) x 8 GPUs (80 GB), tp 2 x pp 1 x dp 8,
# sequence parallel on, recompute selective, micro-batch 8 x 8 accumulation = 512 sequences of 2048.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_2.7b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=2
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_2.7b.json "$@"
