"""The scripts of the prepared GPU check (gpu_check.sh) run end to end on CPU at a tiny shape, so they do not rot
between the sessions that have a GPU: gpu_step.py trains bf16 + ZeRO-1 through the pipeline engine for every policy
(all in one process, and one configuration alone as gpu_check.sh runs each), and gpu_parallel.py's tp 2 with sequence
parallelism over 2 processes (gloo here, NCCL there) matches its tp 1 run's losses through its own parity table."""

from __future__ import annotations

import json
import sys

import pytest
from launch import ROOT, shared_launch

BENCH = ROOT / "benchmarks"

# in the 1-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(
    __name__,
    1,
    lambda out: [
        f"{BENCH / 'gpu_step.py'} --tiny --markdown {out / 'gpu.md'}",
        f"{BENCH / 'gpu_step.py'} --tiny --config sdpa:full --rows {out / 'rows.jsonl'}",
        f"{BENCH / 'gpu_parallel.py'} --tiny --layout 1,1,1 --rows {out / 'parallel.jsonl'}",
    ],
)
# gpu_parallel.py's layout over 2 processes, in the shared 2-process launch
LAUNCH_2 = shared_launch(
    __name__, 2, lambda out: [f"{BENCH / 'gpu_parallel.py'} --tiny --layout 2,1,1,sp --rows {out / 'parallel.jsonl'}"]
)


@pytest.mark.slow
def test_gpu_step_runs_tiny_on_cpu():
    table = (LAUNCH() / "gpu.md").read_text()
    for kernel, policy in [
        ("eager", "none"),
        ("eager", "selective"),
        ("eager", "full"),
        ("sdpa", "none"),
        ("sdpa", "selective[mlp_act,layernorm]"),
        ("sdpa", "full"),
    ]:
        assert f"| {kernel} | {policy} | " in table, (kernel, policy)
    assert "refused" not in table
    (row,) = [json.loads(line) for line in (LAUNCH() / "rows.jsonl").read_text().splitlines()]
    assert row["config"] == "sdpa:full" and row["result"]["step_ms"] > 0, row


@pytest.mark.slow
def test_gpu_parallel_tp2_sp_matches_tp1_on_cpu():
    sys.path.insert(0, str(BENCH))
    import gpu_parallel

    rows = [
        json.loads(line) for out in (LAUNCH(), LAUNCH_2()) for line in (out / "parallel.jsonl").read_text().splitlines()
    ]
    assert sorted(r["layout"] for r in rows) == ["1,1,1", "2,1,1,sp"], rows
    text, ok = gpu_parallel.table(rows, tolerance=1e-3)  # measured 6.4e-05 (bf16 compute, fp32 loss)
    assert ok, text
