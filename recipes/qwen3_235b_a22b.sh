#!/usr/bin/env bash
# qwen3-235b-a22b (Qwen3-MoE shapes): 16 node(s) x 8 H100 80GB, tp 4 x pp 16 x dp 2, experts over ep 8,
# sequence parallel on, recompute none, attention sdpa,
# micro-batch 1 x 512 accumulation = 1024 sequences of 4096.
# Chosen by `python -m ds_megatron.tune --model qwen3-235b-a22b --gpu h100-sxm --gpus 128 --global-batch-size 1024`;
# regenerate with scripts/moe_configs.py.  Pass the model's own tokenizer directory as --tokenizer.
# Usage: [HOSTFILE=hostfile] bash recipes/qwen3_235b_a22b.sh --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=16
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/qwen3_235b_a22b.json "$@"
