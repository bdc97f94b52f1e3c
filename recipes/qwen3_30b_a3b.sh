#!/usr/bin/env bash
# qwen3-30b-a3b (Qwen3-MoE shapes): 4 node(s) x 8 H100 80GB, tp 1 x pp 2 x dp 16, experts over ep 8,
# sequence parallel off, recompute none, attention sdpa,
# micro-batch 1 x 64 accumulation = 1024 sequences of 4096.
# Chosen by `python -m ds_megatron.tune --model qwen3-30b-a3b --gpu h100-sxm --gpus 32 --global-batch-size 1024`;
# regenerate with scripts/moe_configs.py.  Pass the model's own tokenizer directory as --tokenizer.
# Usage: [HOSTFILE=hostfile] bash recipes/qwen3_30b_a3b.sh --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=4
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/qwen3_30b_a3b.json "$@"
