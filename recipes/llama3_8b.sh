#!/usr/bin/env bash
# llama3-8b (Llama 3 shapes): 1 node(s) x 8 H100 80GB, tp 1 x pp 2 x dp 4,
# sequence parallel off, recompute selective of mlp_act, layernorm, attention sdpa,
# micro-batch 1 x 128 accumulation = 512 sequences of 8192.
# Chosen by `python -m ds_megatron.tune --model llama3-8b --gpu h100-sxm --gpus 8 --global-batch-size 512`;
# regenerate with scripts/llama_configs.py.  Pass a Llama 3 tokenizer directory (vocabulary 128,256) as --tokenizer.
# Usage: [HOSTFILE=hostfile] bash recipes/llama3_8b.sh --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=1
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/llama3_8b.json "$@"
