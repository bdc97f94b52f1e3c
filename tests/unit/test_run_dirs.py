"""Fast tier: one run per directory (docs/runs.md).

A run's directory (metrics.jsonl, loss.png, tokenizer, resolved config) is its own: ``logging.run_dir``, else its
``--save`` (a resume with the same ``--save`` continues its records), else a new ``runs/<config>/<time>-<pid>``; the
shipped configs pin none.  ``metrics.jsonl`` holds one run's records.  Two trainings never write one ``--save`` (or
explicit run directory) at once: the second is refused in one line naming the first's process, before any process
group or file; a lock left by a dead run is taken over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT

from ds_megatron import trainer
from ds_megatron.checkpoint.run_lock import LOCK, hold_run_lock
from ds_megatron.cli import train as cli
from ds_megatron.config import ConfigError, load_json, resolve
from ds_megatron.metrics import MetricsLogger

CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))
TINY = ROOT / "ds_configs" / "gpt_tiny.json"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_no_shipped_config_pins_a_run_directory(path):
    """A pinned run_dir is shared by every run of the config (metrics, loss curve and tokenizer of all of them)."""
    assert (load_json(path).get("ds_megatron", {}).get("logging") or {}).get("run_dir") is None


def _run(**section):
    cfg = load_json(TINY)
    cfg["ds_megatron"]["parallel"].update(tp=1, pp=1)
    for dotted, value in section.items():
        part, key = dotted.split("__")
        cfg["ds_megatron"].setdefault(part, {})[key] = value
    return resolve(cfg, 1)


def test_each_run_without_a_directory_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer.dist, "broadcast_object_list", lambda box, src: None)  # rank 0 of a world of one
    monkeypatch.setattr("builtins.print", lambda *a, **k: None)
    run = _run()
    first = trainer.start_run_dir(run, "gpt_tiny", 0)
    second = trainer.start_run_dir(run, "gpt_tiny", 0)
    assert first != second and first.parent == second.parent == Path("runs/gpt_tiny")
    assert (first / "config.json").is_file() and (second / "config.json").is_file()
    # --save names it (a resume with the same --save continues there); logging.run_dir names it before that
    assert trainer.run_dir_for(_run(checkpoint__save="ck"), "gpt_tiny") == Path("ck")
    assert trainer.run_dir_for(_run(checkpoint__save="ck", logging__run_dir="r"), "gpt_tiny") == Path("r")


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_hold_one_runs_records(tmp_path, capsys):
    """A run from step 0 in a directory that holds another run's records moves them aside; a run resumed at step 4
    keeps its steps up to 4 and drops those trained after the checkpoint (trained again now)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    logger = MetricsLogger(run_dir, 6, 0, True, None)
    logger.log({"step": 1, "loss": 5.0})
    logger.close()
    assert _steps(run_dir) == [1]
    assert json.loads((run_dir / "metrics.previous-1.jsonl").read_text().splitlines()[0])["loss"] == 9.0
    assert "moved to metrics.previous-1.jsonl" in capsys.readouterr().out

    records = [{"step": s, "loss": 1.0} for s in range(1, 7)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "lo')
    logger = MetricsLogger(run_dir, 8, 4, True, None)
    logger.log({"step": 5, "loss": 2.0})
    logger.close()
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    assert "dropped 3 record(s) after step 4" in capsys.readouterr().out


# ---- one training per --save directory -----------------------------------------------------------------------
HOLDER = """
import sys, time
from ds_megatron.checkpoint.run_lock import hold_run_lock
from ds_megatron.config import load_json, resolve
cfg = load_json(sys.argv[1])
cfg["ds_megatron"]["parallel"].update(tp=1, pp=1)
cfg["ds_megatron"]["checkpoint"]["save"] = sys.argv[2]
with hold_run_lock(resolve(cfg, 1), holder=True):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(save: Path) -> subprocess.Popen:
    """Another training's rank 0 holding ``save`` (a process of its own, as a second launch is)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(TINY), str(save)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_training_on_one_save_directory_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ck"
    first = _holder(save)
    try:
        started = []
        monkeypatch.setattr(trainer, "train", lambda *a, **k: started.append(1) or 0)  # what would start the group
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        argv = ["--deepspeed_config", str(TINY), "--tp", "1", "--pp", "1", "--save", str(save)]
        assert cli.main(argv) == 2 and not started
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith("error: ds_megatron.checkpoint.save: another training is writing this directory")
        assert f"pid {first.pid} on " in err[0] and "pass another directory (--save)" in err[0]
        assert sorted(p.name for p in save.iterdir()) == [LOCK]  # nothing else touched
        monkeypatch.setenv("RANK", "1")  # the launch's other ranks take no lock (DeepSpeed's launcher stops them)
        assert cli.main(argv) == 0 and started
    finally:
        first.kill()
        first.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    save = tmp_path / "ck"
    dead = _holder(save)
    dead.send_signal(signal.SIGKILL)  # no clean-up of any kind: the kernel drops its lock with the process
    dead.wait()
    assert f"pid {dead.pid} " in (save / LOCK).read_text()
    with hold_run_lock(_run(checkpoint__save=str(save)), holder=True):
        assert f"pid {os.getpid()} " in (save / LOCK).read_text()
        with pytest.raises(ConfigError, match=f"held by pid {os.getpid()} "):  # and it is held now
            hold_run_lock(_run(checkpoint__save=str(save)), holder=True)
    with hold_run_lock(_run(checkpoint__save=str(save)), holder=True):  # released at the end of the run
        pass


def test_an_explicit_run_directory_is_locked_too(tmp_path):
    run = _run(checkpoint__save=str(tmp_path / "ck"), logging__run_dir=str(tmp_path / "shared"))
    other = _run(checkpoint__save=str(tmp_path / "ck2"), logging__run_dir=str(tmp_path / "shared"))
    with hold_run_lock(run, holder=True):
        with pytest.raises(ConfigError, match=r"logging.run_dir: another training .*--set ds_megatron.logging"):
            hold_run_lock(other, holder=True)
        with hold_run_lock(_run(checkpoint__save=str(tmp_path / "ck2")), holder=True):
            pass  # the refused run let go of the lock it had taken on its own --save
