"""Expert parallelism through DeepSpeed's engine: the in-process parity (``tests/unit/test_moe_training.py``) runs
the pipeline layers and the engine's gradient rule by hand; this runs them in the recipe, with the EP and expert-DP
groups registered in DeepSpeed's tables, its start-up broadcast of the expert parameters, the replaced
``ReduceGrads`` instruction and the grad norm of the clipping optimizer.

Checkpoints of EP runs (``checkpoint/ep_state.py``: the experts saved as an ep 1 run holds them): the two straight runs
of the shared 2-process launch save at steps 2 and 3; a second 2-process launch resumes their step-2 tags at the
saved layout (ep 2: bit for bit), at ep 1, from ep 1 at tp 2 + SP x ep 2 (resharded on load), offline resharded to
pp 2 at ep 1, and evaluates the export of the ep 2 tag imported with ``--init-from-hf`` at ep 2; the test process
exports it and loads it in transformers."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from launch import ROOT, quiet_run_flags, read_records, shared_launch

CONFIG = str(ROOT / "ds_configs" / "moe_tiny.json")
# moe-tiny in fp32, short sequences, 8 sequences per step, gradient clipping on (moe_tiny.json's 1.0)
SMALL = ["--set", "ds_megatron.model.seq_length=64", "--set", 'ds_megatron.recompute.modules=["core_attn"]']
SMALL += ["--set", "train_batch_size=8", "--set", "train_micro_batch_size_per_gpu=2"]
SMALL += ["--set", "gradient_accumulation_steps=null", "--set", "ds_megatron.train.eval_interval=2"]
NO_SP = ["--set", "ds_megatron.parallel.sequence_parallel=false"]
RUNS = [  # name, tp, flags: the same global batch, so the same losses; each saves at steps 2 and 3
    ("dp2", 1, NO_SP),
    ("dp2-ep2", 1, [*NO_SP, "--ep", "2"]),  # expert-DP of one: the EP group spans dp
]
STEP2 = "step00000002"


def _argv(out: pathlib.Path, name: str, tp: int, pp: int, extra: list[str], iters: int = 3) -> dict:
    flags = quiet_run_flags(out, name, tp, pp, dropout=0.0)
    argv = ["--deepspeed_config", CONFIG, "--train-iters", str(iters), *flags, *SMALL, *extra]
    return {"name": name, "status_dir": str(out), "argv": argv, "output": True, "plot": False}


def _plan(out: pathlib.Path) -> list[str]:
    items = [
        _argv(out, name, tp, 1, [*extra, "--save", str(out / f"ck_{name}"), "--save-interval", "2"])
        for name, tp, extra in RUNS
    ]
    (out / "plan.json").write_text(json.dumps(items))
    return [f"recipe_runs.py --plan {out / 'plan.json'} --exit-zero"]


# in the 2-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(__name__, 2, _plan)
OFFLINE: dict[str, int] = {}  # exit status of each command run between the launches


def _resumed(_: pathlib.Path) -> list[str]:
    """After the straight runs: their step-3 tags set aside (``--load`` takes the newest), the ep 2 tag resharded
    offline to pp 2 at ep 1 and exported; then the runs that resume from step 2, 1 step each, and the evaluation of
    the export imported at ep 2."""
    from ds_megatron.checkpoint.__main__ import main as checkpoint_main

    out = LAUNCH(check=False)
    for name, *_ in RUNS:
        if (out / f"ck_{name}" / "step00000003").is_dir():
            shutil.move(out / f"ck_{name}" / "step00000003", out / f"{name}_step3")
    ck = str(out / "ck_dp2-ep2")
    reshard = ["reshard", "--checkpoint", ck, "--tp", "1", "--pp", "2", "--dp", "1", "--ep", "1"]
    OFFLINE["reshard"] = checkpoint_main([*reshard, "--out", str(out / "ck_pp2")])
    OFFLINE["export"] = checkpoint_main(["export", "--checkpoint", ck, "--tag", STEP2, "--out", str(out / "hf_ep2")])
    items = [
        _argv(out, "ep2-resumed", 1, 1, [*NO_SP, "--ep", "2", "--load", ck]),
        _argv(out, "ep2-to-ep1", 1, 1, [*NO_SP, "--load", ck]),
        # SP on (moe_tiny.json); its step-3 save has each tp rank write its TP shard of every expert
        _argv(out, "ep1-to-tp2-ep2", 2, 1, ["--ep", "2", "--load", str(out / "ck_dp2"), "--save", str(out / "ck_tp2")]),
        _argv(out, "pp2-offline", 1, 2, [*NO_SP, "--load", str(out / "ck_pp2")]),
        _argv(out, "hf-ep2", 1, 1, [*NO_SP, "--ep", "2", "--init-from-hf", str(out / "hf_ep2"), "--eval-only"]),
    ]
    (out / "plan_resumed.json").write_text(json.dumps(items))
    return [f"recipe_runs.py --plan {out / 'plan_resumed.json'} --exit-zero"]


RESUMED = shared_launch(__name__, 2, _resumed, phase=1)


def _steps(out: pathlib.Path, name: str) -> dict[int, dict]:
    """A finished run's records merged per step (a step's training line, its validation, the final validation)."""
    result = json.loads((out / f"{name}.status.json").read_text())
    assert result["status"] == 0, (name, result["error"])
    steps: dict[int, dict] = {}
    for record in read_records(out / name):
        steps.setdefault(record["step"], {}).update(record)
    return steps


def _close(got: float, want: float, rel: float, what) -> None:
    assert abs(got - want) <= rel * abs(want), (what, got, want)


@pytest.mark.slow  # real processes with the deepspeed launcher: two recipe runs in the shared 2-process launch
def test_ep2_trains_as_ep1():
    """moe-tiny, 3 steps at dp 2: ep 2 logs ep 1's loss, aux loss and grad norm (measured: bit for bit for two steps,
    the third step's loss 6.9e-8 relative apart; the saves at step 2 change nothing, measured without them).  The
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


@pytest.mark.slow  # a second 2-process launch: the resumes of the straight runs' step-2 checkpoints
def test_ep_checkpoints_resume_exactly_and_across_ep():
    """The ep 2 checkpoint (each layer's experts gathered over the EP group, which spans dp) resumed at ep 2 logs the
    straight run's step-3 loss, aux loss, grad norm, learning rate and validation loss bit for bit (weights and Adam
    moments cut by name from the ep 1 layout); at ep 1 (DeepSpeed's own load of the same files), and resharded
    offline to pp 2 at ep 1, within 1e-5; the ep 1 checkpoint resumed at tp 2 + SP with ep 2 folded over tp
    (resharded on load) continues the ep 1 run within 1e-5, and its step-3 save (each tp rank writing its TP shard of
    every expert, gathered over the EP group of tp ranks) holds the ep 1 run's step-3 weights and Adam moments within
    rounding."""
    from ds_megatron.checkpoint.reshard import OldCheckpoint

    RESUMED()
    out = LAUNCH()
    assert OFFLINE == {"reshard": 0, "export": 0}, OFFLINE
    straight = {name: _steps(out, name) for name, *_ in RUNS}
    cases = [("ep2-resumed", "dp2-ep2", 0.0), ("ep2-to-ep1", "dp2-ep2", 1e-5), ("pp2-offline", "dp2-ep2", 1e-5)]
    cases += [("ep1-to-tp2-ep2", "dp2", 1e-5)]
    for name, reference, rel in cases:
        got = _steps(out, name)
        assert sorted(got) == [3], (name, sorted(got))
        want = straight[reference][3]
        for key in ("loss", "aux_loss", "grad_norm", "val_loss"):
            _close(got[3][key], want[key], rel, (name, key))
        assert got[3]["lr"] == want["lr"], name
    # Saved at tp 2 x ep 2 (the EP group is the tp ranks, each holding 4 whole experts; each writes its gate|up rows of
    # all 8), the step-3 state is the ep 1 run's own step-3 checkpoint's within rounding.
    saved, want = OldCheckpoint(out / "ck_tp2", "step00000003"), OldCheckpoint(out, "dp2_step3")
    experts = [n for n in want.where if ".experts." in n]
    assert experts and sorted(saved.where) == sorted(want.where)
    for name in want.where:
        torch.testing.assert_close(saved.full_weight(name), want.full_weight(name), rtol=1e-4, atol=1e-7)
        state, ref = saved.full_optimizer_state(name), want.full_optimizer_state(name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                state[key], ref[key], rtol=1e-3, atol=1e-8, msg=lambda m, w=f"{name} {key}": f"{w}: {m}"
            )
    log = "".join(p.read_text() for p in sorted(out.glob("ep1-to-tp2-ep2.rank*.out")))
    assert (
        "resharding" in log
        and "experts split over ep 2" in log
        and "saved at ep 1: its experts are cut for ep 2" in log
    )
    log = "".join(p.read_text() for p in sorted(out.glob("ep2-to-ep1.rank*.out")))
    assert "resharding" not in log and "saved at ep 2: its experts are cut for ep 1" in log
    log = "".join(p.read_text() for p in sorted(out.glob("ep2-resumed.rank*.out")))
    assert "resharding" not in log and "saved at ep" not in log and "missing" not in log  # RNG states: its own


@pytest.mark.slow
def test_ep_checkpoint_exports_to_transformers_and_imports_at_ep2():
    """The ep 2 tag exported holds every expert once, one linear per expert as published; transformers'
    ``from_pretrained`` gives the logits of our model holding the checkpoint's weights (read by name), and
    ``--init-from-hf`` of it at ep 2 evaluates to the straight run's step-2 validation loss."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ds_megatron.checkpoint.reshard import OldCheckpoint
    from ds_megatron.model import build_model

    RESUMED()
    out = LAUNCH()
    assert OFFLINE.get("export") == 0, OFFLINE
    old = OldCheckpoint(out / "ck_dp2-ep2", STEP2)
    ours = build_model(old.model_config).eval()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(old.full_weight(name))
    stored = [k for k in load_file(out / "hf_ep2" / "model.safetensors") if ".experts." in k]
    routed = {k.split(".experts.")[0] for k in stored}
    assert routed and len(stored) == 3 * old.model_config.num_experts * len(routed)  # gate, up, down per expert
    hf = AutoModelForCausalLM.from_pretrained(out / "hf_ep2").eval()
    ids = torch.randint(0, old.model_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-5)
    (evaluated,) = _steps(out, "hf-ep2").values()
    _close(evaluated["val_loss"], _steps(out, "dp2-ep2")[2]["val_loss"], 1e-6, "val_loss of --init-from-hf at ep 2")
