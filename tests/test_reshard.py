"""A checkpoint saved at one layout resumes at another with its optimizer state, resharded on load or offline
(``python -m ds_megatron.checkpoint reshard``): fp32 at tp 2 x pp 2 -> 1 x 4 (offline) -> 4 x 1 (on load), 2 steps
each, the loss curve continuing within 1e-5; bf16 + ZeRO-1 at tp 2 x dp 2 -> pp 2 x dp 2, where the offline
output holds the same files and values as a checkpoint the on-load path saved, and resumes without resharding;
DeepSpeed's ZeRO optimizer (fp32 + ZeRO-1, bf16 + ZeRO-1 without fp32 gradient accumulation) resumes exactly at its
layout and reshards on load to one with less vocabulary padding (offline it is refused, pointing there)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launch import RECIPE, ROOT, TINY_CONFIG, WORKERS, deepspeed_launch, quiet_run_flags, read_losses, read_records

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.reshard import OldCheckpoint

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher


def _run(tmp_path, name: str, tp: int, pp: int, iters: int, extra: list[str]) -> tuple[dict[int, float], str]:
    flags = quiet_run_flags(tmp_path, name, tp, pp)
    out = deepspeed_launch(RECIPE, 4, ["--deepspeed_config", TINY_CONFIG, "--train-iters", str(iters), *flags, *extra])
    return read_losses(tmp_path / name), out


def _reshard_offline(src, out, tp: int, pp: int, dp: int) -> None:
    argv = ["reshard", "--checkpoint", str(src), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", str(out)]
    assert checkpoint_main(argv) == 0


def _full_names(ck: OldCheckpoint) -> list[str]:
    return [
        ck.layout.full_name(ck.layout.local_name(i, k))
        for i, _ in ck.layout.saved_layers()
        for k in ck.layer_file(i, 0)
    ]


def _assert_same_state(a: OldCheckpoint, b: OldCheckpoint) -> int:
    """Full fp32 weights (masters under bf16) and Adam state of every parameter, bit for bit."""
    names = _full_names(a)
    for name in names:
        assert torch.equal(a.full_weight(name), b.full_weight(name)), name
        sa, sb = a.full_optimizer_state(name), b.full_optimizer_state(name)
        assert (sa is None) == (sb is None), name
        for key in sa or {}:
            assert torch.equal(sa[key], sb[key]), (name, key)
    return len(names)


def test_reshard_2x2_to_1x4_to_4x1_continues_the_loss_curve(tmp_path):
    reference, _ = _run(tmp_path, "straight", 2, 2, 6, [])
    first, _ = _run(tmp_path, "a", 2, 2, 2, ["--save", str(tmp_path / "ck_a")])
    _reshard_offline(tmp_path / "ck_a", tmp_path / "ck_a14", 1, 4, 1)
    assert (
        _assert_same_state(
            OldCheckpoint(tmp_path / "ck_a", "step00000002"), OldCheckpoint(tmp_path / "ck_a14", "step00000002")
        )
        == 52
    )
    second, out = _run(tmp_path, "b", 1, 4, 4, ["--load", str(tmp_path / "ck_a14"), "--save", str(tmp_path / "ck_b")])
    assert "resharding" not in out and "was resharded offline from tp 2 x pp 2 x dp 1" in out
    third, out = _run(tmp_path, "c", 4, 1, 6, ["--load", str(tmp_path / "ck_b")])
    assert "resharding" in out
    got = {**first, **second, **third}
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got, reference)


BF16 = ["--set", "bf16.enabled=true", "--set", "zero_optimization.stage=1", "--set", "gradient_accumulation_steps=2"]
BF16 += ["--set", "data_types.grad_accum_dtype=fp32", "--set", "zero_allow_untested_optimizer=true"]


def _same(a, b, where: str) -> None:
    """Equal values, tensors bit for bit with the same dtype and shape; dict order aside (DeepSpeed's per-parameter
    state is keyed by position and filled in the order parameters first step)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _assert_same_files(native, offline) -> None:
    """The offline tag holds every file of the tag the on-load path saved, with the same content, except: no RNG
    files (dropout streams start afresh at a new layout either way), the resolved config (the two runs' own) and
    DeepSpeed's record of its config (whose pipeline keys follow the run's SP settings; DeepSpeed never reads it)."""
    names = sorted(p.name for p in native.iterdir() if not p.name.startswith("rng_rank"))
    assert names == sorted(p.name for p in offline.iterdir())
    for name in names:
        if name in ("manifest.json", "config.json"):
            continue
        if name.endswith(".json"):
            _same(json.loads((native / name).read_text()), json.loads((offline / name).read_text()), name)
            continue
        a, b = safe_load.load(native / name), safe_load.load(offline / name)
        a.pop("ds_config", None), b.pop("ds_config", None)
        if name.startswith("mp_rank"):
            a.pop("config"), b.pop("config")
            assert b.pop("resharded_from") == {"tp": 2, "pp": 1, "dp": 2}
        _same(a, b, name)
    saved = json.loads((offline / "config.json").read_text())
    assert saved["ds_megatron"]["parallel"]["tp"] == 1 and saved["ds_megatron"]["parallel"]["pp"] == 2
    assert (saved["train_batch_size"], saved["gradient_accumulation_steps"]) == (16, 2)


def test_bf16_zero1_checkpoint_resumes_at_another_layout(tmp_path):
    """bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer, flat dp-partitioned fp32 state) saved at tp 2 x pp 1 x dp 2 and
    resumed at tp 1 x pp 2 x dp 2: on load, the fp32 masters and both Adam moments land exactly (a checkpoint written
    right after resharding holds the same full tensors, bit for bit) and the bf16 model copy is the master rounded;
    offline, the same checkpoint comes out file for file; resumed from the offline one (no resharding on load), the
    next step's loss and learning rate continue the straight run's (dropout 0; the loss within bf16 rounding of
    another reduction order)."""

    def run(name, tp, pp, iters, extra):
        flags = quiet_run_flags(tmp_path, name, tp, pp, dropout=0.0)
        out = deepspeed_launch(
            RECIPE, 4, ["--deepspeed_config", TINY_CONFIG, "--train-iters", str(iters), *BF16, *flags, *extra]
        )
        return out, read_records(tmp_path / name)

    _, straight = run("a", 2, 1, 3, ["--save", str(tmp_path / "ck"), "--save-interval", "2"])
    shutil.move(tmp_path / "ck" / "step00000003", tmp_path / "a_step3")
    out, _ = run("b", 1, 2, 2, ["--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck_b")])
    assert "resharding" in out and "from tp 2 x pp 1 x dp 2 to tp 1 x pp 2 x dp 2" in out
    _reshard_offline(tmp_path / "ck", tmp_path / "offline", 1, 2, 2)
    _assert_same_files(tmp_path / "ck_b" / "step00000002", tmp_path / "offline" / "step00000002")
    out, resumed = run("c", 1, 2, 3, ["--load", str(tmp_path / "offline")])
    assert "resharding" not in out

    old, new = OldCheckpoint(tmp_path / "ck", "step00000002"), OldCheckpoint(tmp_path / "ck_b", "step00000002")
    assert old.masters is not None and new.masters is not None
    assert _assert_same_state(old, new) == 4 * 12 + 4  # 12 tensors per block; wte, wpe, ln_f weight and bias
    for name in _full_names(new):
        copy16 = new._merge(name, new._layer_shards(name))
        assert torch.equal(copy16, new.full_weight(name).bfloat16().float()), name

    a3 = next(r for r in straight if r.get("step") == 3 and "loss" in r)
    c3 = next(r for r in resumed if r.get("step") == 3 and "loss" in r)
    assert c3["lr"] == a3["lr"]
    assert abs(c3["loss"] - a3["loss"]) <= 1e-4 * abs(a3["loss"]), (a3["loss"], c3["loss"])  # measured 3.4e-6


# DeepSpeed's ZeRO-1 optimizer (not the BF16 one): fp32 with ZeRO stage 1, and bf16 with ZeRO stage 1 but without
# fp32 gradient accumulation.  It stores its loss scaler (an object of plain numbers) in the optimizer files.
ZERO1 = ["--set", "zero_optimization.stage=1", "--set", "gradient_accumulation_steps=2"]
ZERO1 += ["--set", "zero_allow_untested_optimizer=true", "--set", "ds_megatron.parallel.vocab_multiple=100"]
LLAMA_TINY = str(ROOT / "ds_configs" / "llama_tiny.json")  # untied lm_head, GQA
ZERO1_RUNS = {  # name: (config, flags)
    "fp32_zero1": (LLAMA_TINY, ZERO1),
    "bf16_zero1_bf16_accum": (TINY_CONFIG, [*ZERO1, "--set", "bf16.enabled=true"]),
}


def test_zero1_optimizer_checkpoints_resume_exactly_and_reshard(tmp_path, capsys):
    """fp32 + ZeRO-1 (Llama, untied) and bf16 + ZeRO-1 with bf16 gradient accumulation (GPT-2, tied): DeepSpeed's
    ZeRO optimizer, whose files hold its loss scaler.  Saved at tp 2 x dp 2: 2 steps + resume + 1 equal 3 straight
    bit for bit (loss, gradient norm, learning rate); resumed at tp 1 x pp 2 x dp 2 (resharded on load, the
    vocabulary padding going from 1,200 rows to 1,100) the step continues the straight run's; offline resharding
    refuses it with one line naming the way that works.  Two launches for all six runs (``workers/recipe_runs.py``)."""

    def plan(runs: list[tuple[str, str, int, int, list[str]]]) -> str:
        items = []
        for name, config, tp, pp, extra in runs:
            flags = quiet_run_flags(tmp_path, name, tp, pp, dropout=0.0)
            argv = ["--deepspeed_config", config, "--train-iters", "3", *flags, *extra]
            items.append({"name": name, "status_dir": str(tmp_path), "argv": argv})
        path = tmp_path / f"plan{len(list(tmp_path.glob('plan*.json')))}.json"
        path.write_text(json.dumps(items))
        return str(path)

    def ok(name: str) -> None:
        result = json.loads((tmp_path / f"{name}.status.json").read_text())
        assert result["status"] == 0, (name, result["error"])

    ck = {k: str(tmp_path / f"ck_{k}") for k in ZERO1_RUNS}
    straight = [(k, c, 2, 1, [*f, "--save", ck[k], "--save-interval", "2"]) for k, (c, f) in ZERO1_RUNS.items()]
    deepspeed_launch(WORKERS / "recipe_runs.py", 4, ["--plan", plan(straight)])
    for k in ZERO1_RUNS:
        ok(k)
        shutil.move(tmp_path / f"ck_{k}" / "step00000003", tmp_path / f"{k}_step3")
    resumed = [(f"{k}_same", c, 2, 1, [*f, "--load", ck[k]]) for k, (c, f) in ZERO1_RUNS.items()]
    resumed += [(f"{k}_1x2", c, 1, 2, [*f, "--load", ck[k]]) for k, (c, f) in ZERO1_RUNS.items()]
    out = deepspeed_launch(WORKERS / "recipe_runs.py", 4, ["--plan", plan(resumed)])
    assert out.count("from tp 2 x pp 1 x dp 2 to tp 1 x pp 2 x dp 2") == 2
    for k in ZERO1_RUNS:
        a = {r["step"]: r for r in read_records(tmp_path / k) if "loss" in r}
        assert sorted(a) == [1, 2, 3]
        for name in (f"{k}_same", f"{k}_1x2"):
            ok(name)
            b = [r for r in read_records(tmp_path / name) if "loss" in r]
            assert [r["step"] for r in b] == [3], name
            if name.endswith("_same"):
                for key in ("loss", "grad_norm", "lr"):
                    assert b[0][key] == a[3][key], (name, key, a[3][key], b[0][key])
            else:
                assert b[0]["lr"] == a[3]["lr"]
                assert abs(b[0]["loss"] - a[3]["loss"]) <= 1e-4 * abs(a[3]["loss"]), (name, a[3]["loss"], b[0]["loss"])
        argv = ["reshard", "--checkpoint", ck[k], "--tp", "1", "--pp", "2", "--dp", "2"]
        assert checkpoint_main([*argv, "--out", str(tmp_path / f"off_{k}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "DeepSpeed's ZeRO optimizer" in err[0] and "--load at the new layout" in err[0], err
        assert not (tmp_path / f"off_{k}").exists()
