#!/usr/bin/env bash
# mixtral-8x7b (Mixtral shapes): 8 node(s) x 8 H100 80GB, tp 1 x cp 8 (ring) x pp 4 x dp 2, experts over ep 8,
# sequence parallel off, recompute none, attention sdpa,
# micro-batch 1 x 64 accumulation = 128 sequences of 32768.
# Chosen by `python -m ds_megatron.tune --model mixtral-8x7b --gpu h100-sxm --gpus 64 --global-batch-size 128`;
# regenerate with scripts/moe_configs.py.  Pass the model's own tokenizer directory as --tokenizer.
# Usage: [HOSTFILE=hostfile] bash recipes/mixtral_8x7b.sh --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=8
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/mixtral_8x7b.json "$@"
