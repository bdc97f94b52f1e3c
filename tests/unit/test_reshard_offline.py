"""Fast tier: ``python -m ds_megatron.checkpoint reshard`` refuses bad input with one line (exit 2) and writes
nothing; checkpoint files are read weights-only, and a file whose unpickling would run code is refused (no marker
written) unless ``--trust-checkpoint``.  The conversion itself is checked against the on-load path in
test_reshard.py and round-tripped through export in test_hf_interop.py (they need launched checkpoints)."""

from __future__ import annotations

import fractions
import json
import pathlib

import pytest
import torch

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.manifest import MANIFEST, TAG_CONFIG, file_record
from ds_megatron.config import ConfigError, load_json, resolve

TINY = pathlib.Path(__file__).resolve().parents[2] / "ds_configs" / "gpt_tiny.json"
TAG = "step00000002"


class _WritesMarker:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint could do with any function."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def _tag(root: pathlib.Path, files: dict[str, object], manifest: bool = True, config: bool = True) -> pathlib.Path:
    """A ds_megatron-looking tag of the tiny model saved at tp 2 x pp 2 x dp 1: its resolved config, the given
    files (torch-saved), and a manifest listing them."""
    tag = root / TAG
    tag.mkdir(parents=True)
    if config:
        cfg = load_json(TINY)
        cfg["ds_megatron"]["parallel"].update(tp=2, pp=2)
        (tag / TAG_CONFIG).write_text(json.dumps(resolve(cfg, 4).ds_config))
    for name, obj in files.items():
        torch.save(obj, tag / name)
    if manifest:
        records = {p.name: file_record(p) for p in sorted(tag.iterdir())}
        (tag / MANIFEST).write_text(json.dumps({"step": 2, "files": records}))
    (root / "latest").write_text(TAG)
    return root


def _refused(tmp_path, capsys, argv: list[str], expected: str) -> str:
    out = tmp_path / "out"
    assert checkpoint_main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*")), "an error left files behind"
    return err[0]


def _reshard(src, tp=1, pp=2, dp=1) -> list[str]:
    return ["reshard", "--checkpoint", str(src), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]


def test_refuses_an_existing_output_directory(tmp_path, capsys):
    src = _tag(tmp_path / "ck", {})
    (tmp_path / "out").mkdir()
    assert checkpoint_main(_reshard(src) + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out: already exists")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "expected"),
    [
        (3, 1, 1, "num_heads not divisible by tp (num_heads=4, tp=3)"),
        (1, 5, 1, "fewer layers than pipeline stages (num_layers=4, pp=5)"),
        (1, 1, 3, "--dp: the global batch does not split into micro batches over dp"),
        (0, 1, 1, "--tp: must be a positive integer"),
    ],
)
def test_refuses_a_layout_the_model_cannot_take(tmp_path, capsys, tp, pp, dp, expected):
    src = _tag(tmp_path / "ck", {})
    _refused(tmp_path, capsys, _reshard(src, tp, pp, dp), expected)


@pytest.mark.parametrize(
    ("ep", "expected"),
    [("0", "--ep: must be a positive integer"), ("2", "error: ds_megatron.parallel.ep: ")],  # a dense model: no experts
)
def test_refuses_an_ep_the_new_layout_cannot_take(tmp_path, capsys, ep, expected):
    """``--ep`` goes into the recorded configuration only (the files do not depend on ep), checked like any layout."""
    src = _tag(tmp_path / "ck", {})
    _refused(tmp_path, capsys, [*_reshard(src, 1, 1, 2), "--ep", ep], expected)


def test_refuses_an_expert_tp_the_new_layout_cannot_take(tmp_path, capsys):
    """``--expert-tp`` likewise goes into the recorded configuration only, checked like any layout (1 or tp)."""
    src = _tag(tmp_path / "ck", {})
    expected = "error: ds_megatron.parallel.expert_tp: "
    _refused(tmp_path, capsys, [*_reshard(src, 1, 1, 2), "--expert-tp", "2"], expected + "each routed expert")


def test_refuses_incomplete_and_foreign_checkpoints(tmp_path, capsys):
    no_manifest = _tag(tmp_path / "a", {}, manifest=False)
    _refused(tmp_path, capsys, _reshard(no_manifest), f"no complete checkpoint ({TAG} has no manifest.json)")
    missing = _tag(tmp_path / "b", {"mp_rank_00_model_states.pt": {"step": 2}})
    (missing / TAG / "mp_rank_00_model_states.pt").unlink()
    _refused(
        tmp_path, capsys, _reshard(missing), f"no complete checkpoint ({TAG}/mp_rank_00_model_states.pt is missing"
    )
    _refused(tmp_path, capsys, _reshard(missing) + ["--tag", "step9"], "error: --tag: no such tag")
    deepspeed_only = _tag(tmp_path / "c", {"mp_rank_00_model_states.pt": {"module": None}}, False, False)
    _refused(tmp_path, capsys, _reshard(deepspeed_only), "not a ds_megatron checkpoint")
    no_config = _tag(tmp_path / "d", {"mp_rank_00_model_states.pt": {"module": None}}, config=False)
    _refused(tmp_path, capsys, _reshard(no_config), "not a ds_megatron checkpoint")
    _refused(tmp_path, capsys, _reshard(tmp_path / "nowhere"), "error: --checkpoint: no such directory")
    fp16 = _tag(tmp_path / "e", {})
    cfg = json.loads((fp16 / TAG / TAG_CONFIG).read_text())
    cfg["fp16"] = {"enabled": True}
    (fp16 / TAG / TAG_CONFIG).write_text(json.dumps(cfg))
    (fp16 / TAG / MANIFEST).unlink()
    _tag_manifest(fp16 / TAG)
    _refused(tmp_path, capsys, _reshard(fp16), "this one is fp16 with ZeRO stage 0")


def _tag_manifest(tag: pathlib.Path) -> None:
    records = {p.name: file_record(p) for p in sorted(tag.iterdir())}
    (tag / MANIFEST).write_text(json.dumps({"step": 2, "files": records}))


def test_a_file_whose_unpickling_would_run_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = _tag(tmp_path / "ck", {"mp_rank_00_model_states.pt": {"step": 2, "payload": _WritesMarker(marker)}})
    line = _refused(tmp_path, capsys, _reshard(src), "mp_rank_00_model_states.pt asks for GLOBAL ")
    assert "--trust-checkpoint" in line
    assert not marker.exists()
    export = ["export", "--checkpoint", str(src)]
    line = _refused(tmp_path, capsys, export, "needs more than tensors and plain types")
    assert not marker.exists()
    # ds_megatron's own reads (run state, RNG states, resharding on --load) go through the same reader
    evil = src / TAG / "mp_rank_00_model_states.pt"
    assert safe_load.unsafe_reason(evil).startswith("GLOBAL ")
    with pytest.raises(ConfigError, match="error: --load: .* asks for GLOBAL "):
        safe_load.load(evil, setting="--load")
    assert not marker.exists()


def test_trust_reads_what_weights_only_refuses(tmp_path):
    f = tmp_path / "counts.pt"
    torch.save({"counts": fractions.Fraction(1, 3)}, f)
    with pytest.raises(ConfigError, match="GLOBAL fractions.Fraction"):
        safe_load.load(f)
    assert safe_load.load(f, trust=True)["counts"] == fractions.Fraction(1, 3)
    plain = tmp_path / "plain.pt"
    torch.save({"step": 3, "rng": torch.get_rng_state(), "name": "x", "shape": torch.Size([2])}, plain)
    assert safe_load.unsafe_reason(plain) is None and safe_load.load(plain, mmap=True)["step"] == 3


def test_the_zero_optimizer_files_extras_read_weights_only(tmp_path):
    """DeepSpeed's ZeRO optimizer (fp32 or bf16 with ZeRO-1 without fp32 gradient accumulation, fp16 with ZeRO)
    stores its loss scaler and stage in its optimizer files: rebuilt from their plain numbers, nothing called."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    dynamic = DynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    sd = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.optimizer_states, "fp16_scaler": dynamic}
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": sd}, f)
    assert safe_load.unsafe_reason(f) is None
    back = safe_load.load(f, mmap=True)["optimizer_state_dict"]
    assert type(back["loss_scaler"]) is LossScaler and vars(back["loss_scaler"]) == vars(LossScaler(1.0))
    assert back["zero_stage"] is ZeroStageEnum.optimizer_states and vars(back["fp16_scaler"]) == vars(dynamic)


def test_refuses_an_fp16_zero_optimizer_checkpoint(tmp_path, capsys):
    """DeepSpeed's ZeRO optimizer's files are resharded at fp32 and bf16 (a test below), not at fp16."""
    src = _tag(tmp_path / "ck", {"zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {}}})
    cfg = json.loads((src / TAG / TAG_CONFIG).read_text())
    cfg.update({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    (src / TAG / TAG_CONFIG).write_text(json.dumps(cfg))
    (src / TAG / MANIFEST).unlink()
    _tag_manifest(src / TAG)
    line = _refused(tmp_path, capsys, _reshard(src), "this one is fp16 with ZeRO stage 1: DeepSpeed's ZeRO optimizer")
    assert "resume at the saved layout, or export and --init-from-hf" in line


# ---- context parallelism: a cp change is a change in the number of optimizer partitions -------------------------

LLAMA = TINY.parent / "llama_tiny.json"
STEP = torch.tensor(3.0)


def _cp_run(dp: int, cp: int, optimizer: str):
    """llama_tiny on one stage at dp x cp: ``"fp32"`` (ds_megatron's AdamW, ZeRO 0), ``"bf16"`` (DeepSpeed's BF16
    optimizer: bf16, ZeRO 1, fp32 accumulation) or ``"zero1"`` (fp32 with ZeRO 1: DeepSpeed's ZeRO optimizer)."""
    cfg = load_json(LLAMA)
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1, "cp": cp, "sequence_parallel": False}
    cfg["ds_megatron"]["model"]["seq_length"] = 16
    cfg.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4 // dp)
    if optimizer != "fp32":
        cfg.update(zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    if optimizer == "bf16":
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    return resolve(cfg, dp * cp)


class _Trained:
    """What a run's checkpoint holds, as the offline writer reads it (full fp32 weights and Adam moments by name,
    counters, and the BF16 optimizer's file it copies the layout of), with distinct random values everywhere."""

    def __init__(self, run, root: pathlib.Path):
        from ds_megatron.checkpoint.export import expected_shapes
        from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config

        self.run, self.root, self.tag, self.trust = run, root, TAG, False
        config = run_model_config(run)
        self.layout = pipeline_layout(config)
        g = torch.Generator().manual_seed(0)
        self.values = {
            name: {k: torch.randn(shape, generator=g).abs() for k in ("weight", "exp_avg", "exp_avg_sq")}
            for name, shape in expected_shapes(config).items()
        }
        self.keys: dict[int, list[str]] = {}
        for name in self.values:
            self.keys.setdefault(self.layout.index_of(name), []).append(self.layout.key_in_layer(name))
        groups = [{"lr": 1e-3, "weight_decay": w, "params": []} for w in (0.1, 0.0)]
        self._client = {
            "module": None,
            "global_steps": 3,
            "global_samples": 24,
            "skipped_steps": 0,
            "ds_config": run.ds_config,
            "step": 3,
            "config": run.ds_config,
            "skipped": 0,
            "optimizer": {"state": {}, "param_groups": groups},
        }
        (root / TAG).mkdir(parents=True)
        base = {"state": {g: {"step": STEP} for g in range(2)}, "param_groups": groups}
        template = {"optimizer_state_dict": {"base_optimizer_state": base}}
        torch.save(template, root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")

    def layer_file(self, idx: int, tp_rank: int) -> dict[str, None]:
        return dict.fromkeys(self.keys[idx])

    def full_shape(self, name: str) -> torch.Size:
        return self.values[name]["weight"].shape

    def full_weight(self, name: str) -> torch.Tensor:
        return self.values[name]["weight"]

    def full_optimizer_state(self, name: str) -> dict:
        return {"step": STEP, **{k: self.values[name][k] for k in ("exp_avg", "exp_avg_sq")}}

    def client(self, mp_index: int = 0) -> dict:
        return self._client


def _saved(trained: _Trained, run, optimizer: str, out: pathlib.Path) -> pathlib.Path:
    """The checkpoint a run at ``run``'s layout would save, written by the offline writer."""
    from ds_megatron.checkpoint.reshard_offline import _Writer

    out.mkdir()
    _Writer(trained, run, {"fp32": "fp32", "bf16": "bf16", "zero1": "zero"}[optimizer], out, TAG, False).write()
    (out / "latest").write_text(TAG)
    return out


def _check_holds(ckpt: pathlib.Path, trained: _Trained, dp: int, cp: int, optimizer: str) -> None:
    """Every parameter's weight and Adam moments read back exactly; one partition per rank of DeepSpeed's data
    axis, each the next slice of the group's flat buffer (its parameters concatenated in the optimizer's order)."""
    from ds_megatron.checkpoint.masters import optimizer_files
    from ds_megatron.checkpoint.reshard import OldCheckpoint

    old = OldCheckpoint(ckpt, TAG)
    assert (old.cp, old.data_axis) == (cp, dp * cp)
    for name, values in trained.values.items():
        assert torch.equal(old.full_weight(name), values["weight"]), name
        state = old.full_optimizer_state(name)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[k], values[k]), (name, k)
    records = sorted((ckpt / TAG).glob("params_rank*.json"))
    ranks = [json.loads(f.read_text()) for f in records]
    assert [(r["dp_rank"], r["cp_rank"]) for r in ranks] == [(d, c) for d in range(dp) for c in range(cp)]
    files = optimizer_files(ckpt / TAG)
    if optimizer == "fp32":
        assert files == {}
        return
    assert sorted(files) == [0] and len(files[0]) == dp * cp
    parts = [safe_load.load(f)["optimizer_state_dict"] for f in files[0]]
    assert all(p["partition_count"] == [dp * cp] * 2 for p in parts)
    for g, names in enumerate(ranks[0]["groups"]):
        flat = torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts])
        want = torch.cat([trained.values[n]["weight"].reshape(-1) for n in names])
        # the ZeRO optimizer writes each rank's partition without its padding
        padded = flat.numel() + (sum(p["group_paddings"][g] for p in parts) if optimizer == "zero1" else 0)
        assert padded % (2 * dp * cp) == 0 and torch.equal(flat[: want.numel()], want), g


@pytest.mark.parametrize("optimizer", ["fp32", "bf16", "zero1"])
@pytest.mark.parametrize(("saved", "resharded"), [((1, 2), (1, 1)), ((2, 2), (1, 4)), ((1, 4), (2, 1))])
def test_a_cp_change_is_a_change_in_the_number_of_partitions(tmp_path, optimizer, saved, resharded):
    """Saved at (dp, cp), read back exactly; resharded offline to another (dp, cp) (``--cp`` to the command), read
    back exactly again; the bf16 one exported to transformers equals the trained weights."""
    trained = _Trained(_cp_run(*saved, optimizer), tmp_path / "trained")
    ckpt = _saved(trained, trained.run, optimizer, tmp_path / "ck")
    _check_holds(ckpt, trained, *saved, optimizer)
    dp, cp = resharded
    argv = _reshard(ckpt, tp=1, pp=1, dp=dp) + ["--cp", str(cp), "--out", str(tmp_path / "re")]
    assert checkpoint_main(argv) == 0
    _check_holds(tmp_path / "re", trained, dp, cp, optimizer)
    if optimizer == "bf16" and saved == (1, 2):
        from safetensors.torch import load_file

        from ds_megatron.checkpoint.export import export

        export(ckpt, tmp_path / "hf", progress=False, weights_only=True)  # saved without a tokenizer
        hf = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
        assert sorted(hf) == sorted(trained.values)
        for name, values in trained.values.items():
            assert torch.equal(hf[name], values["weight"]), name


def test_reshard_keeps_the_saved_cp_unless_told(tmp_path, capsys):
    trained = _Trained(_cp_run(1, 2, "bf16"), tmp_path / "trained")
    ckpt = _saved(trained, trained.run, "bf16", tmp_path / "ck")
    assert checkpoint_main(_reshard(ckpt, tp=1, pp=1, dp=2) + ["--out", str(tmp_path / "re")]) == 0
    assert "--cp 2 --pp 1 on 4 processes" in capsys.readouterr().out
    _check_holds(tmp_path / "re", trained, 2, 2, "bf16")
    _refused(tmp_path, capsys, _reshard(ckpt, tp=1, pp=1, dp=1) + ["--cp", "0"], "error: --cp: must be a positive")
    _refused(tmp_path, capsys, _reshard(ckpt, tp=1, pp=1, dp=1) + ["--cp", "3"], "error: ds_megatron.parallel.cp")


def test_reshard_writes_the_optimizer_state_where_the_pipeline_layout_puts_it(tmp_path, capsys):
    """fp32 llama_tiny at pp 2 saved at the balanced split, resharded offline to the blocks per stage of
    ``--pipeline-layout`` (each rank's optimizer state then holds other layers: its records are the layout table's),
    read back exactly; without the flag the saved layout stays at the saved pp and goes at another pp."""
    from ds_megatron.checkpoint.layout import stage_param_layers
    from ds_megatron.checkpoint.reshard import OldCheckpoint

    cfg = load_json(LLAMA)
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 2, "sequence_parallel": False}
    cfg["ds_megatron"]["model"]["seq_length"] = 16
    cfg.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    trained = _Trained(resolve(cfg, 2), tmp_path / "trained")
    ckpt = _saved(trained, trained.run, "fp32", tmp_path / "ck")
    layers = trained.run.model.num_layers
    layout = [0, layers]  # the embedding alone on stage 0
    argv = _reshard(ckpt, tp=1, pp=2, dp=1) + ["--pipeline-layout", ",".join(map(str, layout))]
    assert checkpoint_main(argv + ["--out", str(tmp_path / "re")]) == 0
    assert f"--pp 2 --pipeline-layout 0,{layers} on 2 processes" in capsys.readouterr().out
    moved = OldCheckpoint(tmp_path / "re", TAG)
    _holds_exactly(moved, trained)
    assert moved.run.section.parallel.pipeline_layout == tuple(layout)
    table = stage_param_layers(moved.model_config, moved.run, 2)
    assert table[0] == [0]  # embed_tokens alone
    for rank in range(2):
        record = json.loads((tmp_path / "re" / TAG / f"params_rank{rank:05d}.json").read_text())
        held = {moved.layout.index_of(n) for group in record["groups"] for n in group}
        assert held == set(table[record["pp_rank"]]), (rank, held, table)
    # kept at the same pp, balanced at another
    assert checkpoint_main(_reshard(tmp_path / "re", tp=1, pp=2, dp=1) + ["--out", str(tmp_path / "same")]) == 0
    assert OldCheckpoint(tmp_path / "same", TAG).run.section.parallel.pipeline_layout == tuple(layout)
    assert checkpoint_main(_reshard(tmp_path / "re", tp=1, pp=1, dp=1) + ["--out", str(tmp_path / "one")]) == 0
    assert OldCheckpoint(tmp_path / "one", TAG).run.section.parallel.pipeline_layout is None
    _holds_exactly(OldCheckpoint(tmp_path / "one", TAG), trained)
    capsys.readouterr()  # the progress bars so far
    _refused(tmp_path, capsys, _reshard(ckpt, tp=1, pp=2, dp=1) + ["--pipeline-layout", "1,1"], "sums to 2")


def _holds_exactly(old, trained: _Trained) -> None:
    """Every parameter's weight and Adam moments read back exactly (by name, from whichever rank holds it)."""
    for name, values in trained.values.items():
        assert torch.equal(old.full_weight(name), values["weight"]), name
        state = old.full_optimizer_state(name)
        assert all(torch.equal(state[k], values[k]) for k in ("exp_avg", "exp_avg_sq")), name
