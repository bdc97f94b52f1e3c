"""The recipe's command line: a bad setup exits 2 with one error line before anything distributed is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import sys; from ds_megatron.cli.train import main; rc = main(sys.argv[1:]); "
    "print('imported deepspeed' if 'deepspeed' in sys.modules or 'torch' in sys.modules else 'clean'); sys.exit(rc)"
)


def run_cli(args: list[str], world_size: int = 4, rank: int = 0) -> subprocess.CompletedProcess:
    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def tiny_config(tmp_path: Path, **model) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / "gpt_tiny.json").read_text())
    cfg["ds_megatron"]["model"].update(model)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "args,world,expected",
    [
        (["--tp", "3"], 4, "error: ds_megatron.parallel.tp: num_heads not divisible by tp (num_heads=4, tp=3)"),
        ([], 6, "error: ds_megatron.parallel: tp x pp does not divide the world size"),
        (["--set", "train_batch_size=15"], 4, "error: train_batch_size: not equal to micro batch x accumulation x dp"),
        (["--set", "ds_megatron.parallel.pipeline=2"], 4, "error: ds_megatron.parallel.pipeline: unknown key"),
        (["--set", 'optimizer={"type": "SGD", "params": {"lr": 0.1}}'], 4, "error: optimizer.type: ds_megatron builds"),
        (["--set", "pipeline.activation_checkpoint_interval=1"], 4, "error: pipeline.activation_checkpoint_interval:"),
        (["--set", "train.seed=7"], 4, "error: --set train.seed: neither a DeepSpeed key nor under ds_megatron"),
        (["--set", "scheduler.params.warmup_type=log"], 4, "error: scheduler.params.warmup_type: ds_megatron's"),
    ],
)
def test_bad_setup_exits_2_with_one_line(tmp_path, args, world, expected):
    proc = run_cli(["--deepspeed_config", str(tiny_config(tmp_path)), *args], world)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert proc.stdout.strip() == "clean"  # neither torch nor deepspeed was imported


def test_set_of_a_misplaced_path_names_the_right_one(tmp_path):
    proc = run_cli(["--deepspeed_config", str(tiny_config(tmp_path)), "--set", "train.seed=7"])
    assert "did you mean ds_megatron.train.seed?" in proc.stderr, proc.stderr


def test_unknown_top_level_key_in_the_file_is_a_warning(tmp_path):
    cfg = json.loads((ROOT / "ds_configs" / "gpt_tiny.json").read_text())
    cfg["zero_optimisation"] = {"stage": 1}
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(cfg))
    from ds_megatron.config.deepspeed_keys import unknown_top_level_warnings

    assert unknown_top_level_warnings(cfg) == [
        "warning: zero_optimisation: not a DeepSpeed or ds_megatron key, DeepSpeed ignores it; "
        "did you mean 'zero_optimization'?"
    ]
    assert all(
        unknown_top_level_warnings(json.loads(p.read_text())) == [] for p in (ROOT / "ds_configs").glob("*.json")
    )


def test_only_rank_0_prints_the_error(tmp_path):
    """Under the launcher every rank validates and exits 2; the error line appears once, not once per rank."""
    proc = run_cli(["--deepspeed_config", str(tiny_config(tmp_path)), "--tp", "3"], 4, rank=1)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr


def test_invalid_json_names_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 16,\n  "ds_megatron": {,}\n}\n')
    proc = run_cli(["--deepspeed_config", str(bad)])
    assert proc.returncode == 2
    assert "invalid JSON" in proc.stderr and "line 3 column" in proc.stderr, proc.stderr


def test_help_documents_the_flags():
    proc = subprocess.run([sys.executable, "recipes/train_gpt.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--deepspeed_config", "--tp", "--pp", "--sequence-parallel", "--train-iters", "--set"):
        assert flag in proc.stdout


def test_slurm_host_lists_expand_in_order():
    from ds_megatron.launch_env import expand_hostlist

    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_hostlist("gpu-a[1-2]-ib,login7,r[8-9]n[1,3]") == [
        "gpu-a1-ib",
        "gpu-a2-ib",
        "login7",
        "r8n1",
        "r8n3",
        "r9n1",
        "r9n3",
    ]
    assert expand_hostlist("node[098-101]") == ["node098", "node099", "node100", "node101"]


SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}


def test_srun_and_mpirun_variables_become_torchs():
    """srun and mpirun set their own rank variables; a task of theirs gets torch's, the rendezvous at the first
    node, a port per Slurm job; what is already set wins; a batch script's shell (the job's SLURM_NTASKS, no step)
    stays one process."""
    from ds_megatron.launch_env import DEFAULT_MASTER_PORT, SLURM_PORT_BASE, adopt_launcher_env

    env = {**SRUN_TASK, "SLURM_JOB_NODELIST": "gpu[03-04,09]", "SLURM_JOB_ID": "4812345"}
    assert adopt_launcher_env(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")
    assert env["MASTER_ADDR"] == "gpu03" and env["MASTER_PORT"] == str(SLURM_PORT_BASE + 2345)
    step = {**SRUN_TASK, "SLURM_JOB_NODELIST": "gpu[01-09]", "SLURM_STEP_NODELIST": "gpu[05-06]"}
    env = {**step, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "6000"}
    adopt_launcher_env(env)
    assert (env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("5", "10.0.0.9", "6000")
    env = dict(step)
    adopt_launcher_env(env)
    assert env["MASTER_ADDR"] == "gpu05"  # rank 0 of a step runs on the step's first node
    launched = {**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}  # DeepSpeed's launcher in a job
    assert adopt_launcher_env(launched) is None and launched["WORLD_SIZE"] == "2"
    shell = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu01"}
    assert adopt_launcher_env(shell) is None and "WORLD_SIZE" not in shell

    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    env = {**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "MASTER_ADDR": "node1"}
    assert adopt_launcher_env(env) == "openmpi"
    assert [env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")] == ["3", "16", "3", "8"]
    assert env["MASTER_PORT"] == str(DEFAULT_MASTER_PORT)
    env = {**ompi, "SLURM_JOB_NODELIST": "cn[7-8]"}  # mpirun inside a Slurm allocation
    adopt_launcher_env(env)
    assert env["MASTER_ADDR"] == "cn7"


def test_mpirun_without_a_rendezvous_address_is_one_line(monkeypatch):
    import importlib.util

    from ds_megatron.config import ConfigError
    from ds_megatron.launch_env import adopt_launcher_env

    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mpi4py" else real(name))
    with pytest.raises(ConfigError, match=r"^error: MASTER_ADDR: mpirun .*-x MASTER_ADDR=<first host>"):
        adopt_launcher_env(dict(ompi))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # DeepSpeed finds it through mpi4py
    env = dict(ompi)
    assert adopt_launcher_env(env) == "openmpi" and "MASTER_ADDR" not in env and env["RANK"] == "0"


def test_cuda_connections_are_ordered_in_the_process(tmp_path):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 is set by the worker itself (DeepSpeed's multi-node runners do not pass the
    recipes' export on); with tp > 1 another value is refused in one line."""
    from ds_megatron.config import ConfigError
    from ds_megatron.launch_env import order_cuda_connections

    env: dict[str, str] = {}
    order_cuda_connections(2, env)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    order_cuda_connections(1, env)  # nothing overlaps at tp 1: the user's value stays
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS=8, tp=2"):
        order_cuda_connections(2, env)
    # The worker sets it before anything imports torch (so before CUDA can start): what train() finds.
    probe = (
        "import os, sys, types; fake = types.ModuleType('ds_megatron.trainer'); sys.modules[fake.__name__] = fake; "
        "fake.train = lambda run, config_name, stop=None: print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), "
        "'torch' in sys.modules) or 0; from ds_megatron.cli.train import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {"WORLD_SIZE": "4", "RANK": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", probe, "--deepspeed_config", str(tiny_config(tmp_path))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "1 False", (proc.stdout, proc.stderr[-2000:])
