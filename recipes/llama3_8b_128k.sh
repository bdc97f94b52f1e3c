#!/usr/bin/env bash
# llama3-8b continued at 131,072 tokens (Llama 3 shapes): 4 node(s) x 8 H100 80GB, tp 2 x cp 8 (ring) x pp 1 x dp 2,
# sequence parallel on, recompute selective of layernorm, attention sdpa,
# micro-batch 1 x 16 accumulation = 32 sequences of 131072.
# Chosen by `python -m ds_megatron.tune --model llama3-8b --seq-length 131072 --gpu h100-sxm --gpus 32 --global-batch-size 32 --attention sdpa`;
# regenerate with scripts/llama_long_configs.py.  Pass a Llama 3 tokenizer directory (vocabulary 128,256) as --tokenizer.
# On nodes of 8 H200 (140 GiB) the tuner picks tp 2 x cp 4 (ring) x pp 1 x dp 4, recompute none
# (40.6 s/step against 41.4 here): regenerate with search_long("h200") for those.
# Usage: [HOSTFILE=hostfile] bash recipes/llama3_8b_128k.sh --init-from-hf LLAMA31_8B_DIR --data "my/corpus/*.jsonl" --tokenizer DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=4
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/llama3_8b_128k.json "$@"
