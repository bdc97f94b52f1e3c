"""Which PyTorch CUDA build this machine's NVIDIA driver runs, for scripts/bootstrap.sh (standard library only: it runs
before the virtual environment holds anything).

    python scripts/torch_index.py [NVIDIA_SMI_OUTPUT_FILE]   # prints the index URL, or exits 1 with the fix
    python scripts/torch_index.py --spec                      # prints the torch requirement (ds_megatron/versions.py)

A CUDA build of torch needs a driver whose CUDA version (``nvidia-smi``'s header, "CUDA Version: 12.4") is at least
the build's; PyPI's default torch is the newest CUDA build, so an older driver gets a torch that cannot see the GPU
(``torch.cuda.is_available()`` False).  The builds below are those PyTorch publishes for every release from the
torch floor on: 2.8 (cu126, cu128, cu129), 2.9 and 2.10 (cu126, cu128, cu130); cu129 is left out because only 2.8
has it.  The newest build the driver runs is chosen; a driver older than every build is refused.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

INDEX = "https://download.pytorch.org/whl/{build}"
CUDA_BUILDS = ((13, 0), (12, 8), (12, 6))  # newest first


def _versions():
    """ds_megatron/versions.py, loaded by path (importing the package would check this Python's packages)."""
    path = Path(__file__).resolve().parent.parent / "ds_megatron" / "versions.py"
    spec = importlib.util.spec_from_file_location("ds_megatron_versions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def driver_cuda(nvidia_smi: str) -> tuple[int, int] | None:
    """The driver's CUDA version from ``nvidia-smi``'s header, or None when it prints none."""
    match = re.search(r"CUDA Version\s*:\s*(\d+)\.(\d+)", nvidia_smi)
    return (int(match.group(1)), int(match.group(2))) if match else None


def choose_build(cuda: tuple[int, int]) -> str | None:
    """The newest CUDA build (``cu128``) the driver's CUDA version runs, or None."""
    return next((f"cu{major}{minor}" for major, minor in CUDA_BUILDS if (major, minor) <= cuda), None)


def index_url(nvidia_smi: str) -> str:
    """The index to install torch from, or SystemExit with a one-line reason and the commands to run instead."""
    cuda = driver_cuda(nvidia_smi)
    spec = _versions().REQUIREMENTS["torch"]
    oldest = ".".join(map(str, CUDA_BUILDS[-1]))
    if cuda is None:
        raise SystemExit(
            "bootstrap: nvidia-smi shows no 'CUDA Version' (is the driver loaded?); install torch yourself, e.g. "
            f"TORCH_SPEC='{spec}' TORCH_INDEX_URL={INDEX.format(build='cu126')} bash scripts/bootstrap.sh"
        )
    build = choose_build(cuda)
    if build is None:
        raise SystemExit(
            f"bootstrap: the NVIDIA driver supports CUDA up to {cuda[0]}.{cuda[1]}, and {spec} is built for CUDA "
            f"{oldest} or newer: upgrade the driver (CUDA {oldest} needs 560 or newer), or run "
            f"TORCH_SPEC='{spec}' TORCH_INDEX_URL={INDEX.format(build='cu126')} bash scripts/bootstrap.sh to try "
            "CUDA's minor-version compatibility"
        )
    return INDEX.format(build=build)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--spec"]:
        print(_versions().REQUIREMENTS["torch"])
        return
    if argv:
        text = Path(argv[0]).read_text()
    else:
        text = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    print(index_url(text))


if __name__ == "__main__":
    main(sys.argv[1:])
