#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020): 128 node(s) x 8 A100 80GB, tp 8 x pp 8 x dp 16,
# sequence parallel on, recompute selective, attention eager,
# micro-batch 1 x 96 accumulation = 1536 sequences of 2048.
# Chosen by `python -m ds_megatron.tune --model gpt3-175b --gpu a100-80gb --gpus 1024 --global-batch-size 1536 --tp 8 --pp 8 --micro-batch-size 1 --sequence-parallel --recompute selective --attention eager`;
# regenerate with scripts/gpt3_configs.py.  The paper's layout (Korthikanti et al. 2022), pinned.
# Usage: [HOSTFILE=hostfile] bash recipes/paper/gpt3_175b_a100.sh --data "my/corpus/*.jsonl" [more train_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
NODES=128
GPUS_PER_NODE=8
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP communication and compute issue in order (needed for overlap)
deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
  recipes/train_gpt.py --deepspeed_config ds_configs/paper/gpt3_175b_a100.json "$@"
