"""ruff lint and format checks over the project (style is part of the tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    local = Path(sys.executable).parent / "ruff"
    return str(local) if local.exists() else (shutil.which("ruff") or "ruff")


def test_ruff_check():
    proc = subprocess.run([_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = subprocess.run([_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
