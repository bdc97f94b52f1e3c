#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020): 128 node(s) x 8 H100 80GB, tp 4 x pp 16 x dp 16,
# sequence parallel on, recompute none, attention sdpa,
# micro-batch 1 x 96 accumulation = 1536 sequences of 2048.
# Chosen by `python -m ds_megatron.tune --model gpt3-175b --gpu h100-sxm --gpus 1024 --global-batch-size 1536`;
# regenerate with scripts/gpt3_configs.py.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_175b.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=128
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_175b.json "$@"
