#!/usr/bin/env bash
# GPT-3 760M (Brown et al. 2020): 1 node(s) x 8 H100 80GB, tp 1 x pp 1 x dp 8,
# sequence parallel off, recompute none, attention sdpa,
# micro-batch 16 x 2 accumulation = 256 sequences of 2048.
# Chosen by `python -m ds_megatron.tune --model gpt3-760m --gpu h100-sxm --gpus 8 --global-batch-size 256`;
# regenerate with scripts/gpt3_configs.py.
# Usage: [HOSTFILE=hostfile] bash recipes/gpt3_760m.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/gpt3_760m.json "$@"
