#!/usr/bin/env bash
# GPT-3 2.7B (Brown et al. 2020): 2 node(s) x 8 H100 80GB, tp 1 x pp 2 x dp 8,
# sequence parallel off, recompute none, attention sdpa,
# micro-batch 2 x 32 accumulation = 512 sequences of 2048.
# Chosen by `python -m ds_megatron.tune --model gpt3-2.7b --gpu h100-sxm --gpus 16 --global-batch-size 512`;
# regenerate with scripts/gpt3_configs.py.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_2.7b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=2
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_2.7b.json "$@"
