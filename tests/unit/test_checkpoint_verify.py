"""Fast tier: every reader of a checkpoint tag checks it against its manifest before it reads a file, and DeepSpeed's
own reads are weights-only.

One flipped byte of a saved file (same size) is refused with one line naming the file on every read path: ``--load``
(each rank of the launch hashes a share, then all agree; a gloo group of two through the recipe's ``train``),
``export`` and offline ``reshard``.  DeepSpeed reads ``--load``'s files through a checkpoint
engine that unpickles weights-only, so a file swapped after the checks runs no code.  A failed export leaves nothing,
and its error line is not glued to the progress bar."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from inprocess import spawn_reports

from ds_megatron.checkpoint.__main__ import main as checkpoint_main
from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config
from ds_megatron.checkpoint.manifest import MANIFEST, TAG_CONFIG, file_record, manifest_records, shares
from ds_megatron.config import ConfigError, load_json, resolve

TINY = pathlib.Path(__file__).resolve().parents[2] / "ds_configs" / "gpt_tiny.json"
TAG = "step00000002"
FLIPPED = "layer_02-model_00-model_states.pt"


class _WritesMarker:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint could do with any function."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def _tag(root: pathlib.Path, layer_payload: object = None) -> pathlib.Path:
    """A tag of the tiny GPT saved at tp 1 x pp 1 x dp 1: its config (in config.json and the mp_rank file), one small
    file per pipeline layer (``layer_payload`` added to the first), an RNG file, a manifest of them all."""
    cfg = load_json(TINY)
    cfg["ds_megatron"]["parallel"].update(tp=1, pp=1)
    run = resolve(cfg, 1)
    tag = root / TAG
    tag.mkdir(parents=True)
    (tag / TAG_CONFIG).write_text(json.dumps(run.ds_config))
    torch.save({"config": run.ds_config, "step": 2}, tag / "mp_rank_00_model_states.pt")
    for n, (idx, _) in enumerate(pipeline_layout(run_model_config(run)).saved_layers()):
        layer = {"w": torch.full((256,), float(idx))}
        if n == 0 and layer_payload is not None:
            layer["payload"] = layer_payload
        torch.save(layer, tag / f"layer_{idx:02d}-model_00-model_states.pt")
    torch.save({"cpu": torch.get_rng_state()}, tag / "rng_rank00000.pt")
    records = {p.name: file_record(p) for p in sorted(tag.iterdir())}
    (tag / MANIFEST).write_text(json.dumps({"step": 2, "files": records}))
    (root / "latest").write_text(TAG)
    return root


def _flip_one_byte(f: pathlib.Path) -> None:
    """Damage ``f`` the way a bad disk or a bad copy does: one byte changed, the size kept."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_shares_split_every_file_once_by_bytes():
    records = {f"f{i}": {"bytes": size} for i, size in enumerate([100, 90, 10, 10, 10, 5, 1])}
    split = shares(records, 3)
    assert sorted(n for part in split for n in part) == sorted(records)  # every file, once
    assert [sum(records[n]["bytes"] for n in part) for part in split] == [100, 90, 36]
    assert shares(records, 1) == [sorted(records)]
    assert shares({"a": {"bytes": 1}}, 3) == [["a"], [], []]  # more ranks than files: some hash nothing


@pytest.mark.parametrize("reader", ["export", "reshard"])
def test_offline_readers_refuse_a_flipped_byte(tmp_path, capsys, reader):
    ck = _tag(tmp_path / "ck")
    _flip_one_byte(ck / TAG / FLIPPED)
    out = tmp_path / "out"
    argv = {
        "export": ["export", "--checkpoint", str(ck), "--out", str(out)],
        "reshard": ["reshard", "--checkpoint", str(ck), "--tp", "1", "--pp", "2", "--dp", "1", "--out", str(out)],
    }[reader]
    assert checkpoint_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: --checkpoint: the checkpoint does not match its manifest"), err
    assert f"{TAG}/{FLIPPED}: sha256 " in err[0] and "--tag" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing written


def _load_rank(tmp: str, victim: str, group, rank: int, world: int) -> dict[str, str]:
    """One rank of ``--load``'s verification: on the intact tag (recording the files this rank hashed), then through
    the recipe's ``train`` after rank 0 flipped a byte of ``victim``.  Returns the outcomes and what it printed."""
    from ds_megatron import trainer
    from ds_megatron.checkpoint import manifest, run_state

    hashed = []
    real = manifest.sha256_file
    manifest.sha256_file = lambda path: hashed.append(pathlib.Path(path).name) or real(path)
    try:
        intact = run_state.verified_load_tag(pathlib.Path(tmp) / "ck")
        intact_hashed = sorted(hashed)
        dist.barrier()
        if rank == 0:
            _flip_one_byte(pathlib.Path(tmp) / "ck" / TAG / victim)
        dist.barrier()
        cfg = load_json(TINY)
        cfg["ds_megatron"]["parallel"].update(tp=2, pp=1)
        cfg["ds_megatron"]["checkpoint"]["load"] = str(pathlib.Path(tmp) / "ck")
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            status = trainer.train(resolve(cfg, world))
    finally:  # the rank runs other tests' checks afterwards (the session's pool): leave the module as found
        manifest.sha256_file = real
    return {"intact": intact, "hashed": intact_hashed, "status": status, "printed": printed.getvalue()}


def test_load_verification_is_shared_over_ranks_and_agreed(tmp_path):
    """Two ranks: each hashes its share (together every file, none twice); a byte flipped in a file of rank 1's
    share makes both ranks stop with exit status 2 before the engine is built, and rank 0 alone prints rank 1's
    finding, in one line."""
    ck = _tag(tmp_path / "ck")
    split = shares(manifest_records(ck / TAG), 2)
    victim = next(n for n in split[1] if n.startswith("layer_"))
    ranks = spawn_reports(functools.partial(_load_rank, str(tmp_path), victim), 2)
    assert [r["hashed"] for r in ranks] == split
    assert [r["intact"] for r in ranks] == [TAG, TAG]
    assert [r["status"] for r in ranks] == [2, 2] and ranks[1]["printed"] == ""
    lines = ranks[0]["printed"].splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ds_megatron.checkpoint.load: the checkpoint does not match its manifest"), lines
    assert f"{TAG}/{victim}: sha256 " in lines[0] and f"move {ck}/{TAG} out" in lines[0], lines


def test_deepspeed_reads_load_files_weights_only(tmp_path):
    """The checkpoint engine ``build_engine`` gives DeepSpeed (``run_state.read_weights_only``) refuses, through
    DeepSpeed's own per-layer reader, a file whose unpickling would run code, and saves like the engine it wraps.
    DeepSpeed's torch engine alone runs the payload: the window the wrapper closes."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    from ds_megatron.checkpoint.run_state import read_weights_only

    marker = tmp_path / "marker"
    evil = tmp_path / "layer_02-model_00-model_states.pt"
    torch.save({"w": torch.ones(2), "payload": _WritesMarker(marker)}, evil)

    class Engine:  # what read_weights_only needs of a DeepSpeed engine
        checkpoint_engine = TorchCheckpointEngine()

    engine = Engine()
    read_weights_only(engine)
    with pytest.raises(ConfigError, match=r"error: ds_megatron\.checkpoint\.load: .* asks for GLOBAL "):
        loader = SDLoaderFactory.get_sd_loader([str(evil)], checkpoint_engine=engine.checkpoint_engine, version=2.0)
        loader.load(1, 0, module_key=None, is_pipe_parallel=True)
    assert not marker.exists()
    engine.checkpoint_engine.save({"w": torch.arange(3)}, str(tmp_path / "plain.pt"))
    assert torch.equal(engine.checkpoint_engine.load(str(tmp_path / "plain.pt"))["w"], torch.arange(3))
    assert engine.checkpoint_engine.is_data_parallel_writer(0) and not engine.checkpoint_engine.is_decoupled()
    TorchCheckpointEngine().load(str(evil))
    assert marker.exists()


def test_a_failed_export_leaves_nothing_and_prints_its_error_on_a_line_of_its_own(tmp_path, capsys, monkeypatch):
    """A refused payload in a layer file (its manifest matches: the file is as saved) stops the export after the
    progress bar started; so does a full disk.  Neither leaves the output, its temporary directory or the parent
    directories the export created."""
    marker = tmp_path / "marker"
    ck = _tag(tmp_path / "ck", layer_payload=_WritesMarker(marker))
    out = tmp_path / "new" / "out"
    assert checkpoint_main(["export", "--checkpoint", str(ck), "--out", str(out), "--no-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert "exporting" in err  # the bar was on the screen
    lines = [line for line in err.split("\n") if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: --checkpoint: a checkpoint file needs more than"), err
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    from ds_megatron.checkpoint import export

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
        yield

    ck_ok = _tag(tmp_path / "ck_ok")
    monkeypatch.setattr(export, "iter_full_parameters", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_main(["export", "--checkpoint", str(ck_ok), "--out", str(out), "--no-tokenizer"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck_ok"]


def test_a_file_swapped_after_the_checks_is_refused_by_deepspeeds_own_load(tmp_path, monkeypatch):
    """Pre-flight and the sha256 pass read the files before the engine exists; DeepSpeed reads them again later.
    A per-layer file replaced in between is refused by DeepSpeed's load itself (the engine ``build_engine`` made
    reads weights-only), and its payload never runs.  A one-process engine of the tiny GPT (``build_engine``, as the
    recipe builds it), here in the test process: save, swap a per-layer file for one with a payload, resume."""
    from engine_here import one_process_engine

    from ds_megatron.checkpoint.run_state import load_run, save_run

    cfg = load_json(TINY)
    cfg["ds_megatron"]["parallel"].update(tp=1, pp=1)
    run = resolve(cfg, 1)
    with one_process_engine(run, monkeypatch) as built:
        ck = tmp_path / "ck"
        tag = save_run(built.engine, ck, 1, {"step": 1, "config": run.ds_config}, built.rng)
        marker = tmp_path / "marker"
        torch.save({"payload": _WritesMarker(marker)}, ck / tag / FLIPPED)
        with pytest.raises(ConfigError) as err:
            load_run(built.engine, ck, built.rng, tag=tag)  # the tag verified before the swap
    assert not marker.exists()
    assert str(err.value).startswith("error: ds_megatron.checkpoint.load: a checkpoint file needs more"), err.value
    assert f"{FLIPPED} asks for GLOBAL " in str(err.value), err.value
