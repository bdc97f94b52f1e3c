"""benchmarks/gpu_check.sh without a GPU: run with a stand-in Python that records each step's command (no torch, no
deepspeed started), it trains each configuration in a process of its own with a port of its own, keeps part 1 within
8 minutes, goes on past a step that fails or runs out of time (and exits 1 naming it), and runs part 2 (tp 2 over
the deepspeed launcher against tp 1) only with two or more GPUs.  Also gpu_parallel.py's comparison and layouts, in
process.  About 5 seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_parallel  # noqa: E402
import gpu_step  # noqa: E402

FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys, time
args = sys.argv[1:]
if args[0] == "-c":
    code = args[1]
    if "device_count" in code:
        print(os.environ["FAKE_NGPU"])
    elif "get_device_name" in code:
        print("gpu_check: NVIDIA H200 torch 2.10.0+cu130")
    sys.exit(0)  # "import deepspeed, transformers": installed
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"args": args, "port": os.environ.get("MASTER_PORT"), "rank": os.environ.get("RANK")}}) + "\\n")
if os.environ.get("FAKE_SLOW") and any(a.endswith(os.environ["FAKE_SLOW"]) for a in args):
    time.sleep(30)
if os.environ.get("FAKE_FAIL") and any(a.endswith(os.environ["FAKE_FAIL"]) for a in args):
    sys.exit(3)
"""


def _budget(name: str) -> float:
    return float(re.search(rf"^{name}=\$\{{{name}:-([0-9.]+)\}}", SCRIPT.read_text(), re.M).group(1))


def _check(tmp_path: Path, ngpu: int, **env_extra) -> tuple[subprocess.CompletedProcess, list[dict]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), FAKE_LOG=str(log), FAKE_NGPU=str(ngpu))
    env.update(env_extra)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    return proc, [json.loads(line) for line in log.read_text().splitlines()]


def _script(call: dict) -> str:
    return next((Path(a).name for a in call["args"] if a.endswith(".py")), "")


def test_part_one_fits_eight_minutes():
    configs = len(gpu_step.CONFIGS)
    total = sum(_budget(n) for n in ("BUDGET_INSTALL", "BUDGET_TABLE", "BUDGET_INFERENCE", "BUDGET_CP"))
    total += configs * _budget("BUDGET_TRAIN_CONFIG")
    assert total < 8 * 60, total
    # the tuner's own budget leaves the inference step time to build and save the model
    assert _budget("INFERENCE_MINUTES") * 60 + 30 <= _budget("BUDGET_INFERENCE")


def test_one_gpu_trains_each_configuration_in_its_own_process(tmp_path):
    proc, calls = _check(tmp_path, 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = [c for c in calls if _script(c) == "gpu_step.py" and "--config" in c["args"]]
    names = [c["args"][c["args"].index("--config") + 1] for c in train]
    assert names == [gpu_step.config_name(k, p) for k, p, _ in gpu_step.CONFIGS]
    assert len({c["port"] for c in train}) == len(train) and {c["rank"] for c in train} == {"0"}
    scripts = [_script(c) for c in calls]
    assert scripts[len(train) :] == ["gpu_step.py", "gpu_inference.py", "gpu_cp_kernel.py", "gpu_kernels.py"], scripts
    assert "gpu_parallel.py" not in scripts and "part 2 (tp 2 over NCCL) needs 2 or more" in proc.stdout


def test_a_failed_or_slow_step_is_reported_and_the_rest_still_run(tmp_path):
    proc, calls = _check(tmp_path, 1, FAKE_SLOW="eager:full", FAKE_FAIL="gpu_cp_kernel.py", BUDGET_TRAIN_CONFIG="2")
    assert proc.returncode == 1
    assert "train eager:full ran out of its 2 s" in proc.stdout and "cp kernels failed (3)" in proc.stdout, proc.stdout
    assert [_script(c) for c in calls].count("gpu_step.py") == len(gpu_step.CONFIGS) + 1  # and the table


@pytest.mark.parametrize("ngpu, layouts", [(2, ["2,1,1,sp"]), (8, ["2,1,1,sp", "2,2,1,sp", "2,1,2,sp"])])
def test_two_or_more_gpus_add_the_parallel_part(tmp_path, ngpu, layouts):
    proc, calls = _check(tmp_path, ngpu)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parallel = [c["args"] for c in calls if _script(c) == "gpu_parallel.py"]
    assert parallel[0][-4:] == ["--layout", "1,1,1", "--rows", parallel[0][-1]]  # the reference, one process
    launches = parallel[1:-1]
    assert [a[a.index("--layout") + 1] for a in launches] == layouts
    for args, layout in zip(launches, layouts):
        tp, pp, cp = map(int, layout.split(",")[:3])
        assert args[:3] == ["-m", "deepspeed.launcher.runner", "--num_gpus"] and args[3] == str(tp * pp * cp), args
    expect = parallel[-1][parallel[-1].index("--expect") + 1 : parallel[-1].index("--markdown")]
    assert expect == ["1,1,1", *layouts], parallel[-1]


def _args(**kw):
    ns = type("Args", (), {})()
    ns.layers, ns.hidden, ns.heads, ns.seq, ns.vocab, ns.micro_batch = 4, 2048, 16, 2048, 50257, 2
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("layout", ["1,1,1", "2,1,1,sp", "2,2,1,sp", "2,1,2,sp"])
def test_the_parallel_layouts_resolve_at_the_gpu_shape(layout):
    from ds_megatron.config import resolve

    parsed = gpu_parallel.parse_layout(layout)
    run = resolve(gpu_parallel.ds_config(_args(), parsed), parsed["tp"] * parsed["pp"] * parsed["cp"])
    assert (run.tp, run.pp, run.cp, run.dp) == (parsed["tp"], parsed["pp"], parsed["cp"], 1)
    assert run.section.parallel.sequence_parallel == layout.endswith("sp")


def test_the_parity_table_flags_a_loss_off_by_more_than_the_tolerance_and_a_missing_reference():
    ref = {"layout": "1,1,1", "gpus": 1, "losses": [10.9, 10.5], "step_ms": 100.0, "peak_gib": 20.0}
    near = {"layout": "2,1,1,sp", "gpus": 2, "losses": [10.91, 10.49], "step_ms": 60.0, "peak_gib": 11.0}
    far = {"layout": "2,2,1,sp", "gpus": 4, "losses": [10.9, 10.8], "step_ms": 50.0, "peak_gib": 6.0}
    text, ok = gpu_parallel.table([ref, near], tolerance=0.05)
    assert ok and "| 2,1,1,sp | 2 | 1.00e-02 | ok | 60.0 | 0.60x | 11.00 |" in text, text
    text, ok = gpu_parallel.table([ref, near, far], tolerance=0.05)
    assert not ok and "| 2,2,1,sp | 4 | 3.00e-01 | FAIL |" in text, text
    assert gpu_parallel.table([near], tolerance=0.05)[1] is False
    with pytest.raises(SystemExit, match="not tp,pp,cp"):
        gpu_parallel.parse_layout("2,1,sp")
