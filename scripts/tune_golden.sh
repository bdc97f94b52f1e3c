#!/bin/bash
# Every output of the analytic tuner for 60 command lines (reports, --json, --write-config, each kind of bad input,
# --help), the Python API over the paper's Table 5 runs, the paper-accuracy table and the empirical mode (fake
# launches: scripts/tune_golden_empirical.py), into OUTDIR.  Run it before
# and after a change to ds_megatron/tune and diff the two folders: a refactoring must leave them byte-identical
# (the search time is masked).   bash scripts/tune_golden.sh OUTDIR   (from the repository root)
set -u
ROOT=$(pwd)
OUT=$1; rm -rf "$OUT"; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
n=0
run() {
  n=$((n+1)); local d="$OUT/$(printf %02d $n)"; mkdir -p "$d"
  echo "$*" > "$d/argv"
  (cd "$d" && PYTHONPATH=$ROOT:${PYTHONPATH:-} $OLDPWD/$PY -m ds_megatron.tune "$@" > stdout 2> stderr; echo $? > rc)
  sed -i -E 's/candidates in [0-9.]+ s:/candidates in X s:/' "$d/stdout"
  for j in "$d"/*.json; do [ -f "$j" ] && sed -i -E 's/"search_seconds": [0-9.e-]+/"search_seconds": X/' "$j"; done
}
run --model gpt3-175b --seq-length 2048 --global-batch-size 1536 --gpus 1024 --gpus-per-node 8 --gpu a100-80gb --json out.json --write-config cfg.json
run --model llama3-8b --global-batch-size 512 --gpus 8 --gpu h100-sxm --top 5 --write-config cfg.json --json out.json
run --model llama3-70b --global-batch-size 1024 --gpus 256 --gpu h100-sxm --json out.json --write-config cfg.json
run --model llama3.2-1b --global-batch-size 256 --gpus 8 --gpu h200 --write-config cfg.json
run --model llama3.2-3b --global-batch-size 256 --gpus 16 --gpu a100-40gb --layers 20 --write-config cfg.json
run --model gpt-tiny --vocab 1024 --seq-length 128 --global-batch-size 16 --gpus 4 --gpus-per-node 4 --json out.json --write-config cfg.json
run --model gpt3-1.3b --global-batch-size 512 --gpus 8 --gpu h100-pcie --top 20
run --model gpt3-13b --global-batch-size 1024 --gpus 64 --gpu h100-sxm --attention eager --json out.json
run --model gpt3-13b --global-batch-size 1024 --gpus 64 --gpu h100-sxm --recompute-modules mlp_act,layernorm
run --model gpt3-13b --global-batch-size 1024 --gpus 64 --gpu h100-sxm --recompute-modules core_attn
run --model gpt3-175b --global-batch-size 1536 --gpus 1024 --tp 8 --pp 8 --sequence-parallel --recompute selective --attention eager --micro-batch-size 1 --write-config cfg.json
run --model gpt3-175b --global-batch-size 1536 --gpus 64 --gpu a100-40gb
run --model gpt3-175b --global-batch-size 1536 --gpus 8
run --layers 24 --hidden 2048 --heads 16 --global-batch-size 256 --gpus 16 --efficiency 0.5 --step-overhead-s 0.2 --intra-node-latency-us 40 --json out.json --write-config cfg.json
run --family llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 --vocab 32000 --seq-length 4096 --global-batch-size 128 --gpus 8 --tie-word-embeddings --write-config cfg.json --json out.json
run --family llama --layers 16 --hidden 2048 --heads 32 --global-batch-size 128 --gpus 8
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --gpu h100-sxm --gpu-memory-gb 40 --inter-node-gbps 12.5 --zero 1 --dp 2
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --zero 0
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --tp 3
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --tp 16
run --model gpt3-2.7b --global-batch-size 512 --gpus 12 --gpus-per-node 8
run --model gpt3-2.7b --global-batch-size 500 --gpus 16 --dp 16
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --pp 64
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --tp 1 --sequence-parallel
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --recompute-modules foo
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --recompute-modules mlp_act --recompute full
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --recompute-modules core_attn --attention sdpa
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --recompute-modules mlp_act,mlp_act
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --efficiency 1.5
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --step-overhead-s -1
run --model gpt3-2.7b --global-batch-size 0 --gpus 16
run --model gpt3-2.7b --global-batch-size 512 --gpus 16 --gpu-memory-gb -4
run --model gpt3-27b --global-batch-size 512 --gpus 16
run --model gpt3-2.7b --family llama --global-batch-size 512 --gpus 16
run --model gpt3-2.7b --kv-heads 4 --global-batch-size 512 --gpus 16
run --layers 24 --hidden 2048 --global-batch-size 512 --gpus 16
run --layers 24 --hidden 2050 --heads 16 --global-batch-size 512 --gpus 16
run --layers 24 --hidden 2048 --heads 16 --vocab 0 --global-batch-size 512 --gpus 16
run --family llama --layers 24 --hidden 2048 --heads 16 --kv-heads 3 --intermediate-size 8192 --global-batch-size 512 --gpus 16
run --family llama --layers 24 --hidden 2048 --heads 16 --global-batch-size 512 --gpus 16
run --family llama --layers 24 --hidden 2048 --heads 16 --intermediate-size -3 --global-batch-size 512 --gpus 16
run --family gpt2 --layers 24 --hidden 2048 --heads 16 --tie-word-embeddings --global-batch-size 512 --gpus 16
run --model llama3-8b --tp 8 --kv-heads 4 --global-batch-size 512 --gpus 16
run --model llama3-8b --tp 16 --global-batch-size 512 --gpus 16 --gpus-per-node 16
run --model llama3-8b --empirical --global-batch-size 512 --gpus 16
run --model llama3-8b --empirical --max-minutes 1 --empirical-top 0 --global-batch-size 512 --gpus 16
run --model llama3-8b --empirical --max-minutes 1 --global-batch-size 512 --gpus 16
run --model llama3-8b --gpu b200 --global-batch-size 512 --gpus 16
run --model llama3-8b --global-batch-size 512 --gpus 16 --nope
run --help
run --model llama3-8b --global-batch-size 512 --gpus 16 --gpu h100-sxm --memory-gbps 3000 --intra-node-gbps 200 --gpu-peak-tflops 700 --json out.json
run --model gpt3-6.7b --global-batch-size 1024 --gpus 32 --gpu h100-sxm --recompute full --json out.json
run --model gpt3-760m --global-batch-size 256 --gpus 8 --recompute none --sequence-parallel --tp 2
run --model llama3-70b --global-batch-size 64 --gpus 64 --gpu h100-sxm --tp 8 --pp 4 --schedule interleaved-1f1b --json out.json --write-config cfg.json
run --model gpt3-1.3b --global-batch-size 64 --gpus 8 --virtual-stages 3
# routed families: ep searched with the layout, pinned, refused
run --model qwen3-30b-a3b --global-batch-size 512 --gpus 16 --gpu h100-sxm --micro-batch-size 1 --attention sdpa --json out.json --write-config cfg.json
run --model qwen3-235b-a22b --global-batch-size 1024 --gpus 128 --gpu h100-sxm --pp 4 --micro-batch-size 1 --attention sdpa --recompute full
run --model mixtral-8x7b --seq-length 4096 --global-batch-size 256 --gpus 16 --gpu h100-sxm --ep 4 --top 3 --json out.json
run --model qwen3-30b-a3b --global-batch-size 512 --gpus 16 --ep 3
run --model llama3-8b --global-batch-size 512 --gpus 16 --ep 2
# Python API outputs
PYTHONPATH=$ROOT $PY - > "$OUT/api.txt" 2>&1 <<'PYEOF'
import json, dataclasses
from ds_megatron.tune import *
from ds_megatron.tune.training import paper_runs, calibration
from ds_megatron.tune.training.report import format_report
for r in paper_runs.TABLE5:
    for mode in paper_runs.MODES:
        m = r.measurement(mode)
        e = evaluate(m.model, m.cluster, m.candidate, m.global_batch_size)
        print(r.name, mode, repr(e.time), repr(e.first), repr(e.last))
print(repr(fit_time_model(paper_runs.fit_measurements())))
print(repr(fit_time_model([paper_runs.paper_run(n).measurement(md) for n in ("22B","175B","530B","1T") for md in paper_runs.MODES], extra_terms=("latency","overhead"))))
for name in ("gpt3-175b","llama3-70b","llama3.2-1b","gpt-tiny","llama-tiny"):
    m = build_model_shape(name, None, None, None, None, None)
    print(name, total_param_count(m), stage_param_counts(m, 8, 4))
PYEOF
PYTHONPATH=$ROOT $PY benchmarks/tuner_accuracy.py --paper-only > "$OUT/paper.txt" 2>&1
echo "golden: $n runs in $OUT"
# The empirical mode with fake launches and a fake clock
PYTHONPATH=$ROOT $PY scripts/tune_golden_empirical.py "$OUT" > "$OUT/empirical.log" 2>&1
