"""A checkpoint saved at one layout resumes at another with its optimizer state, resharded on load or offline
(``python -m ds_megatron.checkpoint reshard``): fp32 at tp 2 x pp 2 -> 1 x 4 (offline) -> 4 x 1 (on load), 2 steps
each, the loss curve continuing within 1e-5; bf16 + ZeRO-1 at tp 2 x dp 2 -> pp 2 x dp 2, where the offline
output holds the same files and values as a checkpoint the on-load path saved, and resumes without resharding;
DeepSpeed's ZeRO optimizer (fp32 + ZeRO-1, bf16 + ZeRO-1 without fp32 gradient accumulation) resumes exactly at its
layout and reshards on load and offline to one with less vocabulary padding; bf16 +
ZeRO-1 saved at cp 2 resumes at cp 4 on load and, resharded offline across cp, at tp 2 x cp 1.

All the recipe runs of this file take two launches (``workers/recipe_runs.py``, the ``runs`` fixture), shared with
other modules' runs of 4 processes: the runs that start from nothing, then, after the offline resharding, the ones
that resume (in order, so a run may resume from the one before it).  Each run builds its own topology, engine and
data, and its messages are read from its own output copy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launch import ROOT, TINY_CONFIG, quiet_run_flags, read_losses, read_records, shared_launch

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.reshard import OldCheckpoint

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher


class Runs:
    """The recipe runs of this file, planned by name and started together by ``launch``."""

    def __init__(self, root):
        self.root, self.plan, self.errors, self.offline = root, [], [], {}

    def add(self, name: str, tp: int, pp: int, iters: int, extra: list[str], config: str = TINY_CONFIG, **kw) -> None:
        flags = quiet_run_flags(self.root, name, tp, pp, **kw)
        argv = ["--deepspeed_config", config, "--train-iters", str(iters), *flags, *extra]
        self.plan.append({"name": name, "status_dir": str(self.root), "argv": argv, "output": True, "plot": False})

    def take(self) -> list[str]:
        """The ``workers/several.py`` run of the runs planned so far; it exits 0 once every run returned (each is
        reported from its status file by ``result``), so that the other modules' runs of the launch still start."""
        path = self.root / f"plan{len(list(self.root.glob('plan*.json')))}.json"
        path.write_text(json.dumps(self.plan))
        self.plan = []
        return [f"recipe_runs.py --plan {path} --exit-zero"]

    def result(self, name: str) -> str:
        """The run's output (every rank's, joined) once it finished with status 0."""
        status = self.root / f"{name}.status.json"
        assert status.exists(), (f"{name}: its launch ended before it ran", self.errors)
        result = json.loads(status.read_text())
        assert result["status"] == 0, (name, result["error"])
        return "".join(p.read_text() for p in sorted(self.root.glob(f"{name}.rank*.out")))

    def losses(self, name: str) -> dict[int, float]:
        self.result(name)
        return read_losses(self.root / name)


def _reshard_offline(runs: Runs, src, out, tp: int, pp: int, dp: int, cp: int | None = None, tag=None) -> None:
    """Offline resharding of ``src`` (its tag ``tag``, else the newest) into ``out``; its exit status is kept in
    ``runs.offline[out name]``."""
    argv = ["reshard", "--checkpoint", str(src), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", str(out)]
    argv += [] if cp is None else ["--cp", str(cp)]
    argv += [] if tag is None else ["--tag", tag]
    runs.offline[out.name] = checkpoint_main(argv)


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


def plan_2x2_to_1x4_to_4x1(runs: Runs, leg: int) -> None:
    # The straight run is the saving one too: its step-2 checkpoint is what the other layouts resume from (a save
    # that changed the run would make the straight losses after step 2 differ from the resumed ones).
    if leg == 0:
        runs.add("straight", 2, 2, 6, ["--save", str(runs.root / "ck_a"), "--save-interval", "2"])
    elif leg == 1:
        if (runs.root / "straight.status.json").exists():
            _reshard_offline(runs, runs.root / "ck_a", runs.root / "ck_a14", 1, 4, 1, tag="step00000002")
    else:
        runs.add("b", 1, 4, 4, ["--load", str(runs.root / "ck_a14"), "--save", str(runs.root / "ck_b")])
        runs.add("c", 4, 1, 6, ["--load", str(runs.root / "ck_b")])


def test_reshard_2x2_to_1x4_to_4x1_continues_the_loss_curve(runs):
    root = runs.root
    reference = runs.losses("straight")
    assert sorted(reference) == list(range(1, 7))
    assert runs.offline["ck_a14"] == 0
    assert (
        _assert_same_state(OldCheckpoint(root / "ck_a", "step00000002"), OldCheckpoint(root / "ck_a14", "step00000002"))
        == 52
    )
    out = runs.result("b")
    assert "resharding" not in out and "was resharded offline from tp 2 x pp 2 x dp 1" in out
    second = runs.losses("b")
    out = runs.result("c")
    assert "resharding" in out
    third = runs.losses("c")
    got = {**second, **third}
    assert sorted(got) == list(range(3, 7))
    for step in range(3, 7):
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
        if (native / name).is_dir():  # the run's tokenizer, carried by each tag: the same files
            files = sorted(p.name for p in (native / name).iterdir())
            assert files == sorted(p.name for p in (offline / name).iterdir()), name
            assert all((native / name / f).read_bytes() == (offline / name / f).read_bytes() for f in files), name
            continue
        if name.endswith(".json"):
            _same(json.loads((native / name).read_text()), json.loads((offline / name).read_text()), name)
            continue
        a, b = safe_load.load(native / name), safe_load.load(offline / name)
        a.pop("ds_config", None), b.pop("ds_config", None)
        if name.startswith("mp_rank"):
            a.pop("config"), b.pop("config")
            assert b.pop("resharded_from") == {"tp": 2, "pp": 1, "dp": 2, "cp": 1}
        _same(a, b, name)
    saved = json.loads((offline / "config.json").read_text())
    assert saved["ds_megatron"]["parallel"]["tp"] == 1 and saved["ds_megatron"]["parallel"]["pp"] == 2
    assert (saved["train_batch_size"], saved["gradient_accumulation_steps"]) == (16, 2)


def plan_bf16_zero1(runs: Runs, leg: int) -> None:
    root = runs.root

    def add(name, tp, pp, iters, extra):
        runs.add(f"bf16_{name}", tp, pp, iters, [*BF16, *extra], dropout=0.0)

    if leg == 0:
        add("a", 2, 1, 3, ["--save", str(root / "bf16_ck"), "--save-interval", "2"])
    elif leg == 1:
        if (root / "bf16_a.status.json").exists():
            shutil.move(root / "bf16_ck" / "step00000003", root / "bf16_a_step3")
            _reshard_offline(runs, root / "bf16_ck", root / "bf16_offline", 1, 2, 2)
    else:
        add("b", 1, 2, 2, ["--load", str(root / "bf16_ck"), "--save", str(root / "bf16_ck_b")])
        add("c", 1, 2, 3, ["--load", str(root / "bf16_offline")])


def test_bf16_zero1_checkpoint_resumes_at_another_layout(runs):
    """bf16 + ZeRO-1 (DeepSpeed's BF16 optimizer, flat dp-partitioned fp32 state) saved at tp 2 x pp 1 x dp 2 and
    resumed at tp 1 x pp 2 x dp 2: on load, the fp32 masters and both Adam moments land exactly (a checkpoint written
    right after resharding holds the same full tensors, bit for bit) and the bf16 model copy is the master rounded;
    offline, the same checkpoint comes out file for file; resumed from the offline one (no resharding on load), the
    next step's loss and learning rate continue the straight run's (dropout 0; the loss within bf16 rounding of
    another reduction order)."""
    root = runs.root
    runs.result("bf16_a")
    straight = read_records(root / "bf16_a")
    assert runs.offline["bf16_offline"] == 0
    out = runs.result("bf16_b")
    assert "resharding" in out and "from tp 2 x pp 1 x dp 2 to tp 1 x pp 2 x dp 2" in out
    _assert_same_files(root / "bf16_ck_b" / "step00000002", root / "bf16_offline" / "step00000002")
    out = runs.result("bf16_c")
    assert "resharding" not in out
    resumed = read_records(root / "bf16_c")

    old, new = OldCheckpoint(root / "bf16_ck", "step00000002"), OldCheckpoint(root / "bf16_ck_b", "step00000002")
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


def plan_zero1_optimizers(runs: Runs, leg: int) -> None:
    ck = {k: str(runs.root / f"ck_{k}") for k in ZERO1_RUNS}
    if leg == 0:
        for k, (config, flags) in ZERO1_RUNS.items():
            runs.add(k, 2, 1, 3, [*flags, "--save", ck[k], "--save-interval", "2"], config=config, dropout=0.0)
    elif leg == 1:
        for k in ZERO1_RUNS:
            if (runs.root / f"ck_{k}" / "step00000003").exists():
                shutil.move(runs.root / f"ck_{k}" / "step00000003", runs.root / f"{k}_step3")
    else:
        for k, (config, flags) in ZERO1_RUNS.items():
            runs.add(f"{k}_same", 2, 1, 3, [*flags, "--load", ck[k]], config=config, dropout=0.0)
            runs.add(f"{k}_1x2", 1, 2, 3, [*flags, "--load", ck[k]], config=config, dropout=0.0)


def test_zero1_optimizer_checkpoints_resume_exactly_and_reshard(runs):
    """fp32 + ZeRO-1 (Llama, untied) and bf16 + ZeRO-1 with bf16 gradient accumulation (GPT-2, tied): DeepSpeed's
    ZeRO optimizer, whose files hold its loss scaler.  Saved at tp 2 x dp 2: 2 steps + resume + 1 equal 3 straight
    bit for bit (loss, gradient norm, learning rate); resumed at tp 1 x pp 2 x dp 2 (resharded on load, the
    vocabulary padding going from 1,200 rows to 1,100) the step continues the straight run's; resharded offline to
    that layout it holds every fp32 master and Adam moment bit for bit (the ZeRO optimizer's own files)."""
    root = runs.root
    for k in ZERO1_RUNS:
        runs.result(k)
        a = {r["step"]: r for r in read_records(root / k) if "loss" in r}
        assert sorted(a) == [1, 2, 3]
        for name in (f"{k}_same", f"{k}_1x2"):
            out = runs.result(name)
            resharded = "from tp 2 x pp 1 x dp 2 to tp 1 x pp 2 x dp 2"
            assert out.count(resharded) == (0 if name.endswith("_same") else 1), name
            b = [r for r in read_records(root / name) if "loss" in r]
            assert [r["step"] for r in b] == [3], name
            if name.endswith("_same"):
                for key in ("loss", "grad_norm", "lr"):
                    assert b[0][key] == a[3][key], (name, key, a[3][key], b[0][key])
            else:
                assert b[0]["lr"] == a[3]["lr"]
                assert abs(b[0]["loss"] - a[3]["loss"]) <= 1e-4 * abs(a[3]["loss"]), (name, a[3]["loss"], b[0]["loss"])
        argv = ["reshard", "--checkpoint", str(root / f"ck_{k}"), "--tp", "1", "--pp", "2", "--dp", "2"]
        assert checkpoint_main([*argv, "--out", str(root / f"off_{k}")]) == 0
        old, new = OldCheckpoint(root / f"ck_{k}", "step00000002"), OldCheckpoint(root / f"off_{k}", "step00000002")
        assert new.masters is not None and _assert_same_state(old, new) > 0, k


# bf16 + ZeRO-1 with fp32 gradient accumulation (DeepSpeed's BF16 optimizer: what a long-context run uses) on the
# Llama config (GQA, untied), sequence parallelism off so that tp 1 layouts run; the accumulation steps follow dp.
CP_BF16 = [
    "--set",
    "bf16.enabled=true",
    "--set",
    "zero_optimization.stage=1",
    "--set",
    "gradient_accumulation_steps=null",
]
CP_BF16 += ["--set", "data_types.grad_accum_dtype=fp32", "--set", "zero_allow_untested_optimizer=true"]
CP_BF16 += ["--set", "ds_megatron.parallel.sequence_parallel=false"]


def plan_cp_bf16(runs: Runs, leg: int) -> None:
    root = runs.root

    def add(name, tp, cp, iters, extra):
        argv = [*CP_BF16, "--cp", str(cp), *extra]
        runs.add(f"cp_{name}", tp, 1, iters, argv, config=LLAMA_TINY, dropout=0.0)

    if leg == 0:
        add("a", 1, 2, 3, ["--save", str(root / "cp_ck"), "--save-interval", "2"])
    elif leg == 1:
        if (root / "cp_a.status.json").exists():
            shutil.move(root / "cp_ck" / "step00000003", root / "cp_a_step3")
            _reshard_offline(runs, root / "cp_ck", root / "cp_offline", 2, 1, 2, cp=1)
    else:
        add("cp4", 1, 4, 3, ["--load", str(root / "cp_ck")])
        add("offline", 2, 1, 3, ["--load", str(root / "cp_offline")])


def test_bf16_zero1_checkpoint_saved_at_cp2_resumes_at_cp4_and_cp1(runs):
    """bf16 + ZeRO-1 (BF16 optimizer) saved at cp 2 x dp 2 after 2 steps resumes at cp 4 x dp 1 on load: CP adds
    no weights and DeepSpeed's data axis (dp x cp) stays 4, so the optimizer partitions load as they are (no
    resharding); the offline reshard across cp (--cp 1, to tp 2 x dp 2: a data axis of 2) holds every fp32 master
    and Adam moment of the saved one, bit for bit, and resumes without resharding on load.  Each resumed step 3
    continues the straight cp 2 run's: the same learning rate, the loss within bf16 rounding of another split of
    the sequence and another reduction order (measured: 4e-6 at cp 4, 1.5e-6 offline)."""
    root = runs.root
    runs.result("cp_a")
    straight = {r["step"]: r for r in read_records(root / "cp_a") if "loss" in r}
    assert sorted(straight) == [1, 2, 3]
    assert runs.offline["cp_offline"] == 0
    saved = OldCheckpoint(root / "cp_ck", "step00000002")
    assert saved.masters is not None and saved.data_axis == 4
    assert (
        _assert_same_state(saved, OldCheckpoint(root / "cp_offline", "step00000002")) == 4 * 9 + 3
    )  # 9 tensors per block; embedding, final norm, lm_head
    layouts = {"cp4": "tp 1 cp 4 pp 1 dp 1", "offline": "tp 2 cp 1 pp 1 dp 2"}
    for name, layout in layouts.items():
        out = runs.result(f"cp_{name}")
        assert layout in out and "resharding" not in out, name
        (b,) = [r for r in read_records(root / f"cp_{name}") if "loss" in r]
        assert b["step"] == 3 and b["lr"] == straight[3]["lr"], name
        assert abs(b["loss"] - straight[3]["loss"]) <= 1e-4 * abs(straight[3]["loss"]), (name, b, straight[3])


PLANS = (plan_2x2_to_1x4_to_4x1, plan_bf16_zero1, plan_zero1_optimizers, plan_cp_bf16)


_RUNS: list[Runs] = []


def _starting(out) -> list[str]:
    """Leg 0: the runs that start from nothing."""
    _RUNS.append(Runs(out))
    for plan in PLANS:
        plan(_RUNS[0], 0)
    return _RUNS[0].take()


def _resuming(out) -> list[str]:
    """Leg 1 (offline resharding, checkpoints set aside) in this process, after leg 0's launch; then leg 2, the
    runs that resume, in order, so a run may resume from the one before it."""
    STARTING(check=False)  # a run that did not finish fails its tests, and those that resume from it
    for leg in (1, 2):
        for plan in PLANS:
            plan(_RUNS[0], leg)
    return _RUNS[0].take()


# two launches of 4 processes shared with other modules (launch.shared_launch)
STARTING = shared_launch(__name__, 4, _starting)
RESUMING = shared_launch(__name__, 4, _resuming, phase=1)


@pytest.fixture(scope="module")
def runs() -> Runs:
    """Every run of this file."""
    for launched in (STARTING, RESUMING):
        try:
            launched()
        except AssertionError as err:  # reported by the tests whose runs did not finish (``result``)
            if _RUNS:
                _RUNS[0].errors.append(str(err)[-6000:])
            else:
                raise
    return _RUNS[0]
