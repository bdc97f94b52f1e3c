#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install ds_megatron with its test tools.
#
# torch is chosen before anything else can pull it in:
#   - already importable in the venv: kept;
#   - an NVIDIA GPU is visible (nvidia-smi): the newest CUDA build the driver runs (scripts/torch_index.py reads the
#     driver's CUDA version off nvidia-smi and picks PyTorch's cu130 / cu128 / cu126 index, or stops with the fix
#     when the driver is older than all of them), then torch.cuda.is_available() must be True;
#   - otherwise a CPU build: a local wheel if pip's find-links has one (no download), else PyTorch's CPU index.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.5.1") or TORCH_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.ds_megatron-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/bootstrap.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=1
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    "${PIP[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
  elif [ "$GPU" = 1 ]; then
    INDEX=$("$PYTHON" scripts/torch_index.py)
    echo "bootstrap: NVIDIA GPU found, installing torch from $INDEX (the newest CUDA build its driver runs)"
    "${PIP[@]}" install --index-url "$INDEX" "$("$PYTHON" scripts/torch_index.py --spec)"
  elif "${PIP[@]}" install --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
    echo "bootstrap: no GPU, installed the local CPU wheel of torch 2.13.0"
  else
    echo "bootstrap: no GPU, installing the CPU build of torch"
    "${PIP[@]}" install torch --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  fi
fi
TORCH_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
if [ "$GPU" = 1 ] && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bootstrap: nvidia-smi sees a GPU but torch $TORCH_VERSION in $VENV cannot use it (torch.cuda.is_available() is" \
    "False): its CUDA build needs a newer driver than this one. Remove $VENV and rerun bash scripts/bootstrap.sh (it" \
    "picks the build from the driver), or set TORCH_SPEC and TORCH_INDEX_URL" >&2
  exit 1
fi
# Pin the torch that is now installed so that resolving the rest can never swap it for another build.
"${PIP[@]}" install -e ".[test]" "torch==$TORCH_VERSION"
touch "$STAMP"
