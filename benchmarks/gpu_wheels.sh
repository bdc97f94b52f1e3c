#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that benchmarks/gpu_check.sh installs on a GPU machine that has torch
# but not deepspeed or transformers, and no network (x86-64 Linux).  They go to ${WHEELS:-.whl}/ (ignored by git):
# deepspeed (built here, pure Python), every runtime requirement its metadata names except torch, and transformers
# with its requirements, for each CPython in GPU_PYTHONS (default 3.10 to 3.13; name only the GPU machine's own to
# carry less: each version adds about 25 MB of compiled wheels).  ${WHEELS}/cpXY.txt lists, pinned, what Python X.Y
# installs from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
mkdir -p "$WHEELS"
# deepspeed is a source package: build its (pure-Python) wheel without compiling any op.
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "deepspeed==$DEEPSPEED_VERSION"
DS_WHEEL=$(ls "$WHEELS"/deepspeed-"$DEEPSPEED_VERSION"-*.whl)
mapfile -t DS_NEEDS < <("$PY" benchmarks/wheel_list.py requires "$DS_WHEEL")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for version in ${GPU_PYTHONS:-3.10 3.11 3.12 3.13}; do
  tag=cp${version/./}
  staging="$WHEELS/$tag.download"
  rm -rf "$staging"
  # deepspeed's needs and transformers (the inference measurement, gpu_inference.py, loads its exported model with
  # it), with everything they need in turn, resolved for this Python.
  "$PY" -m pip download --only-binary=:all: --python-version "$version" --implementation cp "${PLATFORMS[@]}" \
    -d "$staging" "${DS_NEEDS[@]}" "transformers==${TRANSFORMERS_VERSION:-5.24.0}"
  "$PY" benchmarks/wheel_list.py pins "$DS_WHEEL" "$staging"/*.whl >"$WHEELS/$tag.txt"
  mv -f "$staging"/*.whl "$WHEELS"/
  rmdir "$staging"
done
ls -l "$WHEELS"
