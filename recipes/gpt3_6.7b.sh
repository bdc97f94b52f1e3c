#!/usr/bin/env bash
# GPT-3 6.7B (Brown et al. 2020): 4 node(s) x 8 H100 80GB, tp 1 x pp 4 x dp 8,
# sequence parallel off, recompute none, attention sdpa,
# micro-batch 2 x 64 accumulation = 1024 sequences of 2048.
# Chosen by `python -m ds_megatron.tune --model gpt3-6.7b --gpu h100-sxm --gpus 32 --global-batch-size 1024`;
# regenerate with scripts/gpt3_configs.py.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_6.7b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=4
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_6.7b.json "$@"
