"""The launcher tests of ``tests/unit/test_cli.py``: that file's docstring states their subject."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, tiny_config


@pytest.mark.slow
def test_a_bad_batch_size_under_the_launcher_prints_one_line(tmp_path):
    """Two real ranks started by DeepSpeed's launcher: the error line is printed once."""
    from launch import _free_port

    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", str(_free_port()), "recipes/train_gpt.py"]
    cmd += ["--deepspeed_config", str(tiny_config(tmp_path)), "--tp", "1", "--pp", "1", "--set", "train_batch_size=15"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: train_batch_size:"), errors
