"""The launcher tests of ``tests/unit/test_tune_empirical.py``: that file's docstring states their subject."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from launch import shared_token_cache
from test_tune_empirical import TINY_ARGS

from ds_megatron.tune.__main__ import main
from ds_megatron.tune.training.probe import (
    probe,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir():
    return shared_token_cache()  # the tokenizer and corpus are built once per pytest process, as for the recipe tests


def _tune(args: list[str], tmp_path: Path, cache_dir: Path, capsys, monkeypatch) -> tuple[str, dict, float]:
    """Run the tuner in this process (its probes are real deepspeed launches): (output, the JSON's empirical section,
    wall time)."""
    out = tmp_path / "tune.json"
    argv = [*TINY_ARGS, "--empirical", "--device", "cpu", *args, "--empirical-dir", str(tmp_path / "runs")]
    argv += ["--empirical-set", f"ds_megatron.data.cache_dir={cache_dir}", "--json", str(out)]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the ranks the launcher starts import this checkout
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    start = time.monotonic()
    code = main(argv)
    wall = time.monotonic() - start
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 0, text[-6000:]
    return text, json.loads(out.read_text())["empirical"], wall


BROKEN_SET = "ds_megatron.tune_probe_broken=1"  # a key the recipe refuses (exit 2), so the failure path runs for real


@pytest.mark.slow
def test_empirical_mode_measures_recalibrates_and_ranks_past_a_failing_candidate(
    tmp_path, cache_dir, capsys, monkeypatch
):
    """Top 3 (tp 1, 2, 4 at b 4); #2 is launched with a key the recipe refuses: recorded, and #3 still runs.

    About 25 s per run on 2 idle cores; the budget leaves room for a loaded machine (it is a bound, not a target)."""

    def probe_breaking_the_second(result, e, index, options, timeout_s):
        if index == 2:
            options = dataclasses.replace(options, extra_sets=(*options.extra_sets, BROKEN_SET))
        return probe(result, e, index, options, timeout_s)

    monkeypatch.setattr("ds_megatron.tune.training.empirical.probe", probe_breaking_the_second)
    max_minutes = 4.0
    text, emp, wall = _tune(
        ["--micro-batch-size", "4", "--max-minutes", str(max_minutes), "--empirical-top", "3"]
        + ["--empirical-steps", "3", "--empirical-warmup", "1"],
        tmp_path,
        cache_dir,
        capsys,
        monkeypatch,
    )
    assert wall < 60 * max_minutes + 10, text[-3000:]  # the tool keeps its own budget (+ interpreter start-up)
    assert "rank   tp" in text and "final ranking" in text and "final winner" in text, text[-3000:]
    runs = emp["runs"]
    assert [r["analytic_rank"] for r in runs] == [1, 2, 3] and emp["processes"] == 4 and emp["device"] == "cpu"
    assert [r["tp"] for r in runs] == [1, 2, 4]

    failed = runs[1]
    assert failed["status"] == "failed" and failed["returncode"] not in (0, None)
    assert failed["reason"].startswith(f"exit {failed['returncode']}: error: ")
    assert BROKEN_SET.split("=")[0] in failed["reason"] and "unknown key" in failed["reason"]
    assert "#2 failed: exit" in text
    keys = ("tp", "pp", "dp", "sequence_parallel", "micro_batch_size", "recompute", "recompute_layers")
    final = [tuple(f[k] for k in keys) for f in emp["final_ranking"]]
    assert final and tuple(failed[k] for k in keys) not in final  # a failed candidate never wins

    ok = [r for r in runs if r["status"] == "ok"]
    assert [r["index"] for r in ok] == [1, 3], json.dumps(runs, indent=1)[-3000:]
    for r in ok:
        assert len(r["measured_steps_s"]) == 3 and r["measured_step_s"] > 0 and r["peak_mem_gb"] > 0
        assert r["calibrated_step_s"] > 0 and r["predicted_step_s"] > 0
        config = json.loads((Path(r["run_dir"]) / "ds_config.json").read_text())
        assert "bf16" not in config and config["ds_megatron"]["train"]["train_iters"] == 4
    assert emp["calibration"]["efficiency"] > 0 and emp["spearman_predicted_vs_measured"] is not None
    assert emp["winner"] is not None and emp["final_ranking"][0] == emp["winner"]
    assert "max RSS" in emp["peak_mem_note"] and "max RSS" in text


@pytest.mark.slow
def test_empirical_mode_kills_a_run_that_outlives_the_budget(tmp_path, cache_dir, capsys, monkeypatch):
    """A 24 s budget: the first run is killed at its timeout (launcher and ranks), the others are not started."""
    max_minutes = 0.4
    text, emp, wall = _tune(
        ["--max-minutes", str(max_minutes), "--empirical-top", "2", "--empirical-steps", "500"],
        tmp_path,
        cache_dir,
        capsys,
        monkeypatch,
    )
    assert wall < 60 * max_minutes + 10, text[-3000:]
    first, second = emp["runs"]
    assert first["status"] == "timeout" and first["reason"].startswith("timeout after")
    assert second["status"] == "not run" and emp["not_run"] == [2]
    assert "not run (the 0.4 min budget would be exceeded): #2" in text and "final ranking" in text
    assert emp["calibration"] is None and "no candidate was measured" in emp["calibration_note"]
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp_path) in cmdline.read_text():
                leftovers.append(cmdline.parent.name)
        except OSError:
            pass  # exited meanwhile
    assert not leftovers, f"processes of the killed run survive: {leftovers}"
