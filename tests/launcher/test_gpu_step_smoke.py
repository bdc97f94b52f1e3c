"""benchmarks/gpu_step.py (the body of gpu_check.sh) runs end to end on CPU at a tiny shape, so the prepared GPU
check does not rot between the sessions that have a GPU: bf16 + ZeRO-1 through the pipeline engine, every policy."""

from __future__ import annotations

import pytest
from launch import ROOT, shared_launch

# in the 1-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(
    __name__, 1, lambda out: [f"{ROOT / 'benchmarks' / 'gpu_step.py'} --tiny --markdown {out / 'gpu.md'}"]
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
