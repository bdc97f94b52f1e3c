#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that benchmarks/gpu_check.sh installs on a GPU machine that has torch
# but not deepspeed or transformers, and no network (CPython 3.12, x86-64).  They go to .whl/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
# deepspeed is a source package: build its (pure-Python) wheel without compiling any op.
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w .whl "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hjson pydantic pydantic-core annotated-types typing-inspection
# transformers and its dependencies, resolved for the GPU machine: the inference measurement (gpu_inference.py)
# loads its exported model with them.
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "transformers==${TRANSFORMERS_VERSION:-5.24.0}"
ls -l .whl
