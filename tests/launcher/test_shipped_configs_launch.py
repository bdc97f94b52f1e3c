"""The launcher tests of ``tests/unit/test_shipped_configs.py``: that file's docstring states their subject."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from launch import read_records, shared_launch
from miniature import miniature
from test_shipped_configs import GROUPS

from ds_megatron.config import resolve
from ds_megatron.config.schedule import warmup_cosine_from
from ds_megatron.model import FAMILIES, model_config
from ds_megatron.model.family import NORM
from ds_megatron.pipeline_parallel.module import PipelineLayout


def miniature_procs(cfg: dict) -> int:
    par = cfg["ds_megatron"]["parallel"]
    # dp from micro 2 x accumulation 2 (train_batch_size counts sequences: CP ranks share them)
    return par["tp"] * par["pp"] * par.get("cp", 1) * cfg["train_batch_size"] // (2 * 2)


RUNS = [paths[0] for paths in GROUPS.values()]


IDS = ["+".join(p.stem for p in paths) for paths in GROUPS.values()]


def _plan(out: Path, name: str, plan: list[dict]) -> list[str]:
    """The ``workers/several.py`` run of a ``workers/recipe_runs.py`` plan; it exits 0 when every run returned, so
    that the other modules' runs of the shared launch still start (each miniature's status is in its file)."""
    (out / f"{name}.json").write_text(json.dumps(plan))
    return [f"recipe_runs.py --plan {out / f'{name}.json'} --exit-zero"]


def _straight(out: Path) -> list[str]:
    """Every miniature, run as a user runs the recipe: 3 straight steps saving at steps 2 and 3 (one data cache for
    all, built by the first as a user's first run builds it)."""
    plan = []
    for path in RUNS:
        cfg, nprocs = miniature(path)
        assert nprocs == 4, (path.name, nprocs)  # all of them in the shared launch of 4 processes
        work = out / path.stem
        work.mkdir()
        (work / "mini.json").write_text(json.dumps(cfg))
        argv = [*_common(out, work), "--save", str(work / "ck"), "--set", f"ds_megatron.logging.run_dir={work / 'a'}"]
        plan.append({"name": path.stem, "status_dir": str(work), "argv": argv, "plot": False})
    return _plan(out, "straight", plan)


def _common(out: Path, work: Path) -> list[str]:
    return ["--deepspeed_config", str(work / "mini.json"), "--set", f"ds_megatron.data.cache_dir={out / 'cache'}"]


def _resumed(out: Path) -> list[str]:
    """In a later launch, so nothing carries over in memory: each miniature resumes from step 2 for one step."""
    first = STRAIGHT(check=False)  # the miniatures whose straight run failed fail their resume too, as they should
    plan = []
    for path in RUNS:
        work = first / path.stem
        _keep_final(work)
        resume = ["--load", str(work / "ck"), "--save", str(work / "ck_b")]
        argv = [*_common(first, work), *resume, "--set", f"ds_megatron.logging.run_dir={work / 'b'}"]
        plan.append({"name": path.stem + "-resume", "status_dir": str(work), "argv": argv, "plot": False})
    return _plan(out, "resumed", plan)


# two launches of 4 processes shared with other modules (launch.shared_launch): the straight runs, then the resumes
STRAIGHT = shared_launch(__name__, 4, _straight)
RESUMED = shared_launch(__name__, 4, _resumed, phase=1)


@pytest.fixture(scope="module")
def all_runs():
    """{config path: (its miniature, its folder)}; each miniature's runs are reported from its status files."""
    for launched in (STRAIGHT, RESUMED):
        try:
            launched()
        except AssertionError as err:  # reported per miniature below, from its status file
            print(err)
    return {path: (miniature(path)[0], STRAIGHT(check=False) / path.stem) for path in RUNS}


def _keep_final(work) -> None:
    """Keep the end-of-run checkpoint for export; without it the newest complete tag is step 2."""
    if (work / "ck" / "step00000003").exists():
        (work / "final").mkdir()
        shutil.move(work / "ck" / "step00000003", work / "final" / "step00000003")


@pytest.fixture(params=RUNS, ids=IDS)
def mini_run(request, all_runs):
    cfg, work = all_runs[request.param]
    for name in (request.param.stem, request.param.stem + "-resume"):
        status = work / f"{name}.status.json"
        assert status.exists(), f"{name}: its launch ended before it ran"
        result = json.loads(status.read_text())
        assert result["status"] == 0, f"{name} failed:\n{result['error']}"
    return cfg, work


@pytest.mark.slow
def test_resume_equals_the_straight_run(mini_run):
    _, work = mini_run
    straight, resumed = read_records(work / "a"), read_records(work / "b")
    assert [r["step"] for r in straight if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in resumed if "loss" in r] == [3]
    a3 = next(r for r in straight if r["step"] == 3 and "loss" in r)
    b3 = next(r for r in resumed if "loss" in r)
    for key in ("loss", "grad_norm", "lr"):
        assert a3[key] == b3[key], (key, a3[key], b3[key])
    val = [[r["val_loss"] for r in recs if "val_loss" in r] for recs in (straight, resumed)]
    assert val[0] == val[1] and len(val[0]) == 1


@pytest.mark.slow
def test_logged_learning_rate_is_the_schedule(mini_run):
    cfg, work = mini_run
    schedule = warmup_cosine_from(cfg)
    peak = cfg["optimizer"]["params"]["lr"]
    logged = {r["step"]: r["lr"] for r in read_records(work / "a") if "lr" in r}
    assert logged[1] > 0.0
    for step, lr in logged.items():
        assert math.isclose(lr, peak * schedule.ratio(step), rel_tol=1e-12), (step, lr)


@pytest.mark.slow
def test_export_from_the_masters_loads_in_transformers(mini_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ds_megatron.checkpoint.__main__ import main as checkpoint_main

    cfg, work = mini_run
    nprocs = miniature_procs(cfg)
    out = tmp_path / "hf"
    args = ["export", "--checkpoint", str(work / "final"), "--tag", "step00000003", "--out", str(out)]
    assert checkpoint_main([*args, "--tokenizer", str(work / "a" / "tokenizer")]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    exported = load_file(out / "model.safetensors")
    # the first block's first norm (replicated over TP: rank 0's copy is the whole tensor), found by the family's
    # plan and layout tables
    config = model_config(resolve(cfg, nprocs).model)
    layout = PipelineLayout.of(config)
    norm = next(r.path for r in FAMILIES[config.family].block_rows if r.style == NORM)
    name = f"{layout.blocks}.0.{norm}.weight"
    layer = work / "final" / "step00000003" / f"layer_{layout.index_of(name):02d}-model_00-model_states.pt"
    master, copy16 = exported[name], torch.load(layer, weights_only=True)[layout.key_in_layer(name)]
    assert master.dtype == torch.float32
    if cfg.get("bf16", {}).get("enabled"):
        assert copy16.dtype == torch.bfloat16
        assert torch.equal(master.to(torch.bfloat16), copy16)  # the bf16 copy is the master rounded
        assert not torch.equal(master, copy16.float())  # ... and the export is not that rounding
    else:
        assert torch.equal(master, copy16)
