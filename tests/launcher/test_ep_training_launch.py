"""Expert parallelism through DeepSpeed's engine: the in-process parity (``tests/unit/test_moe_training.py``) runs
the pipeline layers and the engine's gradient rule by hand; this runs them in the recipe, with the EP and expert-DP
groups registered in DeepSpeed's tables, its start-up broadcast of the expert parameters, the replaced
``ReduceGrads`` instruction and the grad norm of the clipping optimizer."""

from __future__ import annotations

import json
import pathlib

import pytest
from launch import ROOT, quiet_run_flags, read_records, shared_launch

CONFIG = str(ROOT / "ds_configs" / "moe_tiny.json")
# moe-tiny in fp32, short sequences, 8 sequences per step, gradient clipping on (moe_tiny.json's 1.0)
SMALL = ["--set", "ds_megatron.model.seq_length=64", "--set", 'ds_megatron.recompute.modules=["core_attn"]']
SMALL += ["--set", "train_batch_size=8", "--set", "train_micro_batch_size_per_gpu=2"]
SMALL += ["--set", "gradient_accumulation_steps=null", "--set", "ds_megatron.train.eval_interval=0"]
RUNS = [  # name, tp, flags: the same global batch, so the same losses
    ("dp2", 1, ["--set", "ds_megatron.parallel.sequence_parallel=false"]),
    ("dp2-ep2", 1, ["--set", "ds_megatron.parallel.sequence_parallel=false", "--ep", "2"]),  # expert-DP of one
]


def _plan(out: pathlib.Path) -> list[str]:
    items = []
    for name, tp, extra in RUNS:
        flags = quiet_run_flags(out, name, tp, 1, dropout=0.0)
        argv = ["--deepspeed_config", CONFIG, "--train-iters", "3", *flags, *SMALL, *extra]
        items.append({"name": name, "status_dir": str(out), "argv": argv, "output": True, "plot": False})
    (out / "plan.json").write_text(json.dumps(items))
    return [f"recipe_runs.py --plan {out / 'plan.json'} --exit-zero"]


# in the 2-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(__name__, 2, _plan)


@pytest.mark.slow  # real processes with the deepspeed launcher: two recipe runs in the shared 2-process launch
def test_ep2_trains_as_ep1():
    """moe-tiny, 3 steps at dp 2: ep 2 logs ep 1's loss, aux loss and grad norm (measured by hand: bit for bit).  The
    experts' gradients take the engine's rule here (divided by dp x cp = 2, nothing to sum over an expert-DP group of
    one), the other parameters DeepSpeed's all-reduce; the in-process tier covers ep folded over tp + SP."""
    tmp_path = LAUNCH()
    for name, *_ in RUNS:
        result = json.loads((tmp_path / f"{name}.status.json").read_text())
        assert result["status"] == 0, (name, result["error"])
    out = "".join(f.read_text() for f in sorted(tmp_path.glob("dp2-ep2.rank*.out")))
    assert "experts split over ep 2" in out
    runs = {name: [r for r in read_records(tmp_path / name) if "loss" in r] for name, *_ in RUNS}
    assert [r["step"] for r in runs["dp2"]] == [1, 2, 3] == [r["step"] for r in runs["dp2-ep2"]]
    for want, got in zip(runs["dp2"], runs["dp2-ep2"], strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (key, want["step"], got[key], want[key])
