"""The launcher tests of ``tests/unit/test_cp_training.py``: that file's docstring states their subject."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from launch import ROOT, quiet_run_flags, read_losses, shared_launch

CONFIG = str(ROOT / "ds_configs" / "llama_tiny.json")
ZERO1 = ["--set", "zero_optimization.stage=1", "--set", "zero_allow_untested_optimizer=true"]
ZERO1 += ["--set", "gradient_accumulation_steps=null", "--set", "ds_megatron.parallel.sequence_parallel=false"]
RUNS = [  # name, cp, pp, train iters, flags (the checkpoint directory "ck" of the launch's folder)
    ("straight", 2, 1, 4, []),
    ("first", 2, 1, 2, ["--save", "ck"]),
    ("resumed", 1, 1, 4, ["--load", "ck"]),
    ("resharded", 1, 2, 4, ["--load", "ck"]),
]


def _plan(out: pathlib.Path) -> list[str]:
    """The four recipe runs, in order (a run may resume from the one before it), as one ``workers/several.py`` run;
    each rank copies each run's messages to ``<name>.rank<R>.out``, and the plan exits 0 once every run returned
    (each status is in its file), so that the other modules' runs of the shared launch still start."""
    items = []
    for name, cp, pp, iters, extra in RUNS:
        flags = quiet_run_flags(out, name, 1, pp, dropout=0.0)
        extra = [str(out / x) if x == "ck" else x for x in extra]
        argv = ["--deepspeed_config", CONFIG, "--train-iters", str(iters), "--cp", str(cp), *flags, *ZERO1, *extra]
        items.append({"name": name, "status_dir": str(out), "argv": argv, "output": True, "plot": False})
    (out / "plan.json").write_text(json.dumps(items))
    return [f"recipe_runs.py --plan {out / 'plan.json'} --exit-zero"]


# in the 2-process launch shared with other modules (launch.shared_launch)
LAUNCH = shared_launch(__name__, 2, _plan)


@pytest.mark.slow  # real processes with the deepspeed launcher: four recipe runs in the shared 2-process launch
def test_checkpoint_saved_at_cp2_resumes_at_cp1_continuing_the_losses():
    """Llama (GQA, untied), fp32 + ZeRO-1, on 2 processes: 4 steps straight at cp 2 (dp 1) equal 2 steps at cp 2,
    a save, and 2 more resumed at cp 1 (dp 2).  CP adds no weights, the data position counts sequences, and ZeRO-1
    partitions over DeepSpeed's data axis, dp x cp = 2 in both runs, so the optimizer state loads without
    resharding.  The same checkpoint resumed at cp 1 x pp 2 (dp 1: a data axis of 1, so its two ZeRO-1 partitions
    are resharded on load into one per stage) continues the losses too, and exports to transformers equal to its
    weights (the per-layer files and the fp32 masters of the ZeRO-1 files).  The resume at cp 4 and the bf16 +
    ZeRO-1 cp changes (on load and offline) need 4 processes: they ride tests/launcher/test_reshard.py's launches."""
    from safetensors.torch import load_file

    from ds_megatron.checkpoint.export import export
    from ds_megatron.checkpoint.reshard import OldCheckpoint

    tmp_path = LAUNCH()
    for name, *_ in RUNS:
        result = json.loads((tmp_path / f"{name}.status.json").read_text())
        assert result["status"] == 0, (name, result["error"])
    out = "".join(f.read_text() for name, *_ in RUNS for f in sorted(tmp_path.glob(f"{name}.rank*.out")))
    assert "tp 1 cp 2 pp 1 dp 1" in out and "tp 1 cp 1 pp 1 dp 2" in out and "tp 1 cp 1 pp 2 dp 1" in out
    assert "from tp 1 x cp 2 x pp 1 x dp 1 to tp 1 x cp 1 x pp 2 x dp 1" in out
    straight = read_losses(tmp_path / "straight")
    assert sorted(straight) == [1, 2, 3, 4]
    first = read_losses(tmp_path / "first")
    for run in ("resumed", "resharded"):
        got = {**first, **read_losses(tmp_path / run)}
        assert sorted(got) == sorted(straight), run
        for step, loss in straight.items():
            assert abs(got[step] - loss) <= 1e-5 * abs(loss), (run, step, got[step], loss)

    ck = tmp_path / "ck"
    export(ck, tmp_path / "hf", progress=False)
    hf = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    old = OldCheckpoint(ck, "step00000002")
    assert old.masters is not None and old.data_axis == 2
    # One ZeRO-1 partition per data coordinate (cp rank here); the model files once, by data coordinate 0.
    names = sorted(f.name for f in (ck / "step00000002").glob("*_states.pt"))
    assert [n for n in names if "optim" in n] == [f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in (0, 1)]
    assert [n for n in names if n.startswith("mp_rank")] == ["mp_rank_00_model_states.pt"]
    for name, tensor in hf.items():
        layer = old.layer_file(old.layout.index_of(name), 0)[old.layout.key_in_layer(name)]
        rows = tuple(slice(0, n) for n in tensor.shape)  # the per-layer file's vocabulary may be padded
        assert torch.equal(tensor, layer[rows]) and torch.equal(tensor, old.full_weight(name)), name
    assert sorted(hf) == sorted(old.where)
