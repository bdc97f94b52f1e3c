"""scripts/bootstrap.sh on a GPU machine installs the CUDA build of torch that the node's driver runs (chosen by
scripts/torch_index.py from nvidia-smi's "CUDA Version"), refuses a driver older than every build with the command to
run, and fails loudly when the installed torch cannot see the GPU.  Run with a stand-in ``nvidia-smi`` on PATH and a
stand-in virtual environment whose python records pip's commands (no network, no install): about a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import torch_index  # noqa: E402

HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
"""

FAKE_SMI = """#!/usr/bin/env bash
if [ "${1:-}" = "-L" ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi
cat "$FAKE_SMI_OUTPUT"
"""

FAKE_VENV_PYTHON = f"""#!{sys.executable}
import json, os, sys
args, log = sys.argv[1:], os.environ["FAKE_PIP_LOG"]
calls = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
if args[:2] == ["-m", "pip"]:
    with open(log, "a") as f:
        f.write(json.dumps([a for a in args[2:] if a != "--disable-pip-version-check"]) + "\\n")
    sys.exit(0)
code = args[1]
if "cuda.is_available" in code:
    sys.exit(0 if os.environ["FAKE_CUDA"] == "1" else 1)
if "importlib.metadata" in code:
    print("2.10.0+cu128")
    sys.exit(0)
sys.exit(0 if any("--index-url" in c for c in calls) else 1)  # "import torch": installed once pip was asked
"""


@pytest.mark.parametrize(
    "cuda, build",
    [("13.1", "cu130"), ("13.0", "cu130"), ("12.9", "cu128"), ("12.8", "cu128"), ("12.7", "cu126"), ("12.6", "cu126")],
)
def test_the_newest_build_the_driver_runs(cuda, build):
    text = HEADER.format(driver="570.00", cuda=cuda)
    assert torch_index.index_url(text) == f"https://download.pytorch.org/whl/{build}"


@pytest.mark.parametrize("cuda", ["12.4", "11.8"])
def test_a_driver_older_than_every_build_is_refused_with_the_fix(cuda):
    with pytest.raises(SystemExit) as err:
        torch_index.index_url(HEADER.format(driver="550.54.15", cuda=cuda))
    message = str(err.value)
    assert f"CUDA up to {cuda}" in message and "TORCH_INDEX_URL=" in message and "\n" not in message


def test_nvidia_smi_without_a_cuda_version_is_refused():
    with pytest.raises(SystemExit, match="no 'CUDA Version'"):
        torch_index.index_url("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def _bootstrap(tmp_path: Path, cuda: str, cuda_available: bool) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    for path, text in ((bin_dir / "nvidia-smi", FAKE_SMI), (venv / "bin" / "python", FAKE_VENV_PYTHON)):
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "smi.txt").write_text(HEADER.format(driver="570.86.15", cuda=cuda))
    log = tmp_path / "pip.jsonl"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        VENV=str(venv),
        PYTHON=sys.executable,
        FAKE_SMI_OUTPUT=str(tmp_path / "smi.txt"),
        FAKE_PIP_LOG=str(log),
        FAKE_CUDA="1" if cuda_available else "0",
    )
    for name in ("TORCH_SPEC", "TORCH_INDEX_URL"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(ROOT / "scripts/bootstrap.sh")], env=env, capture_output=True, text=True)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_bootstrap_installs_the_build_of_the_drivers_cuda(tmp_path):
    proc, calls = _bootstrap(tmp_path, "12.8", cuda_available=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls[0] == ["install", "--index-url", "https://download.pytorch.org/whl/cu128", "torch>=2.8"], calls
    assert calls[1][:3] == ["install", "-e", ".[test]"] and "torch==2.10.0+cu128" in calls[1], calls


def test_bootstrap_fails_loudly_when_torch_cannot_see_the_gpu(tmp_path):
    proc, calls = _bootstrap(tmp_path, "13.0", cuda_available=False)
    assert proc.returncode == 1 and "torch.cuda.is_available() is False" in proc.stderr, proc.stdout + proc.stderr
    assert calls[0][2] == "https://download.pytorch.org/whl/cu130" and len(calls) == 1, calls  # nothing else installed


def test_bootstrap_refuses_an_old_driver_before_installing(tmp_path):
    proc, calls = _bootstrap(tmp_path, "12.2", cuda_available=True)
    assert proc.returncode != 0 and "CUDA up to 12.2" in proc.stderr, proc.stdout + proc.stderr
    assert calls == []
