"""benchmarks/gpu_cp_kernel.py (a step of gpu_check.sh) runs on CPU at a tiny shape with the CPU flash kernel, so
the prepared GPU check is not dead on arrival, and its chunked ring blocks merged by log-sum-exp match one
whole-sequence call in bf16 (out, dq, dk, dv) as closely as that call matches fp32."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_cp_kernel  # noqa: E402


def test_chunked_ring_matches_one_call_on_cpu(tmp_path, monkeypatch):
    args = argparse.Namespace(batch=1, heads=4, kv_heads=2, head_dim=16, reps=1)
    for cp in (2, 4):
        r = gpu_cp_kernel.measure(64, cp, args, gpu_cp_kernel.torch.device("cpu"), {})
        # bf16 rounding only: each block's output is rounded once before the fp32 merge
        assert r["err_chunked_whole"] < 3e-2, (cp, r)
        assert r["err_chunked_ref"] < 2 * max(r["err_whole_ref"], 1e-2), (cp, r)
    out = tmp_path / "cp_kernel.md"
    argv = ["gpu_cp_kernel.py", "--device", "cpu", "--seqs", "32", "--cps", "2", "--heads", "2", "--kv-heads", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--head-dim", "8", "--reps", "1", "--markdown", str(out)])
    gpu_cp_kernel.main()
    assert "| 32 | 2 | " in out.read_text()
