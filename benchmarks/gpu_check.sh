#!/usr/bin/env bash
# The prepared GPU check, in two parts; part 1 takes one NVIDIA GPU (made for an H200) and under 8 minutes from a
# fresh clone.
#
# Part 1, one GPU.  Trains a GPT-3 1.3B-shaped model (8 of its 24 layers, s 2048, bf16, ZeRO-1) through the
# ds_megatron pipeline engine for recompute none / selective / full with eager and sdpa attention, each configuration
# in its own process (no engine's memory is left in the next one's peak): one markdown table (step time, tokens/s,
# MFU, HFU, peak memory, the analytic activation prediction) in ${OUT:-benchmarks/results}/gpu_check.md.  Then one
# inference measurement: TTFT and TPOT of a Llama 3.2 1B-shaped exported model (random weights, built locally) at
# batch 1 and 16 under DeepSpeed's inference engine, against the inference tuner's prediction (gpu_inference.md).
# Then the context-parallel kernels: the ring's chunked flash attention with its log-sum-exp merge (every CP rank
# played in turn on the one GPU) against one whole-sequence flash call, time, peak memory and error
# (gpu_cp_kernel.md).  Last, the fused output layer + cross entropy against the unfused one at V 128,256, s 8,192,
# and a Llama 3 8B block with its memory-bound pieces compiled (Triton) against eager: time and peak memory
# (gpu_kernels.md).
#
# Part 2, when two or more GPUs are visible: the loss of tp 2 with sequence parallelism (4 GPUs: also tp 2 x pp 2
# and tp 2 x cp 2, each with SP) against tp 1 on one GPU, one process per GPU under the deepspeed launcher (NCCL),
# and each layout's step time; appended to gpu_check.md (benchmarks/gpu_parallel.py).
#
# Every step runs under its own time limit (below); a step that fails or runs out of time is reported in its table
# and at the end, the next steps still run, and the script then exits 1.
#
# Python: $PYTHON if set, else .venv/bin/python when its torch sees a GPU, else python3.  A machine without deepspeed
# or transformers and without network (the lent GPU machines) installs the wheels that `bash benchmarks/gpu_wheels.sh`
# put in ${WHEELS:-.whl}/ for its Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"

# Seconds each step may take (each can be set from the environment).  Part 1 adds up to
# 30 + 6 x 35 + 15 + 120 + 45 + 50 = 470 s, under 8 minutes; the times in the comments are estimates, not yet measured.
# The install and the GPU's name (not enforced): pip from the wheels, two Python start-ups, about 15 s.
BUDGET_INSTALL=${BUDGET_INSTALL:-30}
# One training configuration: start-up (torch, deepspeed, ~6 s), an engine of ~0.5B parameters, 7 steps (< 1 s each).
BUDGET_TRAIN_CONFIG=${BUDGET_TRAIN_CONFIG:-35}
# The training table from the configurations' results (a Python start-up importing torch and deepspeed).
BUDGET_TABLE=${BUDGET_TABLE:-15}
# Inference: build and save the 1B model (about 20 s), then the tuner's measured runs within their own budget.
BUDGET_INFERENCE=${BUDGET_INFERENCE:-120}
INFERENCE_MINUTES=${INFERENCE_MINUTES:-1.3}
# The CP kernels at s 16k and 64k, cp 2/4/8, with the fp32 reference: about 15 s of GPU work and the start-up.
BUDGET_CP=${BUDGET_CP:-45}
# The fused loss (two paths, 7 calls each, ~13 GB peak unfused) and the block's six Triton graphs compiled: ~35 s.
BUDGET_KERNELS=${BUDGET_KERNELS:-50}
# Part 2: tp 1 of the 4-layer model on one GPU, then each layout's launch (NCCL set-up, engine, 6 steps).
BUDGET_PARALLEL_REF=${BUDGET_PARALLEL_REF:-60}
BUDGET_PARALLEL=${BUDGET_PARALLEL:-90}

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
if ! "$PY" -c "import deepspeed, transformers" 2>/dev/null; then
  tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  [ -f "$WHEELS/$tag.txt" ] || {
    echo "gpu_check: deepspeed or transformers is missing and $WHEELS/$tag.txt is not there: run" \
      "GPU_PYTHONS=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') bash benchmarks/gpu_wheels.sh" \
      "on a machine with network and bring $WHEELS/ here"
    exit 2
  }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links "$WHEELS" \
    --target /tmp/ds_site -r "$WHEELS/$tag.txt"
  export PYTHONPATH=/tmp/ds_site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")

export CUDA_DEVICE_MAX_CONNECTIONS=1 MASTER_ADDR=127.0.0.1 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
PORT=${MASTER_PORT:-29511}
FAILED=()

# step NAME SECONDS COMMAND...: run COMMAND under its limit; on failure or timeout, note it and go on.
step() {
  local name=$1 seconds=$2 rc=0
  shift 2
  timeout --kill-after=10 "$seconds" "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    [ "$rc" = 124 ] && echo "gpu_check: $name ran out of its $seconds s" || echo "gpu_check: $name failed ($rc)"
    FAILED+=("$name")
  fi
}

# Part 1: one GPU, one process per training configuration (the names gpu_step.py --config takes).
ONE_GPU=(env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1)  # and a MASTER_PORT of its own per process
ROWS="$OUT/gpu_check.rows.jsonl"
rm -f "$ROWS"
for config in eager:none eager:selective eager:full sdpa:none sdpa:selective sdpa:full; do
  step "train $config" "$BUDGET_TRAIN_CONFIG" "${ONE_GPU[@]}" MASTER_PORT=$((PORT++)) "$PY" benchmarks/gpu_step.py --config "$config" --rows "$ROWS" "$@"
done
step "train table" "$BUDGET_TABLE" "$PY" benchmarks/gpu_step.py --rows "$ROWS" --markdown "$OUT/gpu_check.md" "$@"
step inference "$BUDGET_INFERENCE" "${ONE_GPU[@]}" MASTER_PORT=$((PORT++)) "$PY" benchmarks/gpu_inference.py --markdown "$OUT/gpu_inference.md" \
  --max-minutes "$INFERENCE_MINUTES"
step "cp kernels" "$BUDGET_CP" "${ONE_GPU[@]}" MASTER_PORT=$((PORT++)) "$PY" benchmarks/gpu_cp_kernel.py --markdown "$OUT/gpu_cp_kernel.md"
step "fused loss and compiled block" "$BUDGET_KERNELS" "$PY" benchmarks/gpu_kernels.py --markdown "$OUT/gpu_kernels.md"

# Part 2: two or more GPUs.
if [ "$NGPU" -ge 2 ]; then
  PROWS="$OUT/gpu_parallel.rows.jsonl"
  rm -f "$PROWS"
  LAYOUTS=(2,1,1,sp)
  [ "$NGPU" -ge 4 ] && LAYOUTS+=(2,2,1,sp 2,1,2,sp)
  step "parallel 1,1,1" "$BUDGET_PARALLEL_REF" "${ONE_GPU[@]}" MASTER_PORT=$((PORT++)) "$PY" benchmarks/gpu_parallel.py --layout 1,1,1 --rows "$PROWS"
  for layout in "${LAYOUTS[@]}"; do
    IFS=, read -r tp pp cp _ <<<"$layout"
    step "parallel $layout" "$BUDGET_PARALLEL" env -u RANK -u LOCAL_RANK -u WORLD_SIZE "$PY" -m deepspeed.launcher.runner \
      --num_gpus $((tp * pp * cp)) --master_port $((PORT++)) benchmarks/gpu_parallel.py --layout "$layout" --rows "$PROWS"
  done
  step "parallel table" "$BUDGET_TABLE" "$PY" benchmarks/gpu_parallel.py --table "$PROWS" --expect 1,1,1 "${LAYOUTS[@]}" \
    --markdown "$OUT/gpu_check.md"
else
  echo "gpu_check: $NGPU GPU visible, part 2 (tp 2 over NCCL) needs 2 or more"
fi

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: failed or out of time: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: every step finished"
