#!/usr/bin/env bash
# The prepared GPU check: one NVIDIA GPU (made for an H200), under 8 minutes.  Trains a GPT-3 1.3B-shaped model
# (8 of its 24 layers, s 2048, bf16, ZeRO-1) through the ds_megatron pipeline engine for recompute none / selective /
# full with eager and sdpa attention; prints one markdown table (step time, tokens/s, MFU, HFU, peak memory, the
# analytic activation prediction) and writes it to ${OUT:-benchmarks/results}/gpu_check.md.  Then one inference
# measurement: TTFT and TPOT of a Llama 3.2 1B-shaped exported model (random weights, built locally) at batch 1 and
# 16 under DeepSpeed's inference engine, against the inference tuner's prediction (gpu_inference.md).  Last, the
# context-parallel kernels: the ring's chunked flash attention with its log-sum-exp merge (every CP rank played in
# turn on the one GPU) against one whole-sequence flash call, time, peak memory and error (gpu_cp_kernel.md).
#
# Python: $PYTHON if set, else .venv/bin/python when its torch sees a GPU, else python3.  A machine without deepspeed
# or transformers and without network (the lent GPU machines) installs the wheels that `bash benchmarks/gpu_wheels.sh`
# put in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
if ! "$PY" -c "import deepspeed, transformers" 2>/dev/null; then
  [ -d .whl ] || { echo "gpu_check: deepspeed or transformers is missing and there is no .whl/ (run benchmarks/gpu_wheels.sh)"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds_site .whl/*.whl
  export PYTHONPATH=/tmp/ds_site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"

export CUDA_DEVICE_MAX_CONNECTIONS=1 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29511}
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
# 8 minutes in all: 310 s for the training steps, 140 s for the inference measurement (build, save, two launches),
# 30 s for the CP kernels (s 16k and 64k, cp 2/4/8: a few seconds of flash on an H200; the rest is start-up).
timeout 310 "$PY" benchmarks/gpu_step.py --markdown "$OUT/gpu_check.md" "$@"
timeout 140 "$PY" benchmarks/gpu_inference.py --markdown "$OUT/gpu_inference.md" --max-minutes 2
timeout 30 "$PY" benchmarks/gpu_cp_kernel.py --markdown "$OUT/gpu_cp_kernel.md"
