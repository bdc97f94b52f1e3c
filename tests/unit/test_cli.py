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
