"""Bad input refused before anything happens; crash-safe checkpoints; graceful stop; numerical guards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import ROOT

from ds_megatron.checkpoint.manifest import MANIFEST, file_record

TINY = str(ROOT / "ds_configs" / "gpt_tiny.json")


def cli(args: list[str], world: int = 4) -> subprocess.CompletedProcess:
    env = {"WORLD_SIZE": str(world), "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(
        [sys.executable, "recipes/train_gpt.py", "--deepspeed_config", TINY, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _fake_checkpoint(root: Path, shape_change: dict | None = None, tp: int = 2, fp16: bool = False) -> Path:
    """A complete-looking tag (manifest + config) for --load validation."""
    cfg = json.loads(Path(TINY).read_text())
    if fp16:  # fp16 runs resume only at their layout (bf16 and fp32 ones are resharded)
        cfg["fp16"] = {"enabled": True}
    cfg["ds_megatron"]["model"].update(shape_change or {})
    cfg["ds_megatron"]["parallel"]["tp"] = tp
    tag = root / "step00000002"
    tag.mkdir(parents=True)
    (tag / "config.json").write_text(json.dumps(cfg))
    torch.save({"step": 2}, tag / "a.pt")
    seal(tag)
    (root / "latest").write_text("step00000002")
    return root


def seal(tag: Path) -> None:
    """Write the manifest of the files now in ``tag``, as a save does."""
    records = {p.name: file_record(p) for p in sorted(tag.iterdir()) if p.name != MANIFEST}
    (tag / MANIFEST).write_text(json.dumps({"step": 2, "files": records}))


BAD = [
    ("invalid json", None, "--deepspeed_config", "invalid JSON"),
    (
        "partition by an old block class name",
        ["--set", "ds_megatron.parallel.partition_method=type:GPTBlockPipe"],
        "ds_megatron.parallel.partition_method",
        "matches no transformer block",
    ),
    (
        "unknown key",
        ["--set", "ds_megatron.model.hiden_size=64"],
        "ds_megatron.model.hiden_size",
        "did you mean 'hidden_size'",
    ),
    (
        "hidden % heads",
        ["--set", "ds_megatron.model.hidden_size=130"],
        "ds_megatron.model.hidden_size",
        "not divisible",
    ),
    ("heads % tp", ["--tp", "3"], "ds_megatron.parallel.tp", "num_heads=4, tp=3"),
    (
        "seq % tp under SP",
        ["--set", "ds_megatron.model.seq_length=127"],
        "ds_megatron.parallel.sequence_parallel",
        "seq_length=127",
    ),
    ("layers < stages", ["--pp", "8", "--tp", "1"], "ds_megatron.parallel.pp", "num_layers=4, pp=8"),
    ("world size", ["--tp", "4"], "ds_megatron.parallel", "world size 4"),
    ("batch arithmetic", ["--set", "train_batch_size=20"], "train_batch_size", "20 != 4 x 4 x 1"),
    ("zero 2 with pp", ["--set", 'zero_optimization={"stage": 2}'], "zero_optimization.stage", "stage=2"),
    ("bf16 and fp16", ["--set", 'bf16={"enabled": true}', "--set", 'fp16={"enabled": true}'], "bf16.enabled", "both"),
    ("data missing", ["--data", "/nonexistent/*.txt"], "ds_megatron.data.path", "no file matches"),
    ("dataset empty", "EMPTY", "ds_megatron.data.path", "empty"),
    ("text not UTF-8", "LATIN1", "ds_megatron.data.path", "latin1.txt at byte 3: invalid continuation byte)"),
    ("binary file as text", "BINARY", "ds_megatron.data.path", "blob.jsonl at byte 0: invalid start byte)"),
    ("tokenizer too big", ["--tokenizer", "bpe:5000"], "ds_megatron.data.tokenizer", "bpe:5000 > vocab_size 1024"),
    (
        "sequence above positions",
        ["--set", "ds_megatron.model.max_position_embeddings=64"],
        "ds_megatron.model.seq_length",
        "max_position_embeddings=64",
    ),
    ("load without checkpoint", "NOCKPT", "ds_megatron.checkpoint.load", "no complete checkpoint"),
    ("checkpoint shape", "SHAPE", "ds_megatron.checkpoint.load", "hidden_size=256"),
    ("checkpoint family", "FAMILY", "ds_megatron.checkpoint.load", "family=llama"),
    ("checkpoint layout", "LAYOUT", "ds_megatron.checkpoint.load", "tp 1 x pp 2"),
    ("recompute layers", ["--recompute", "full:3"], "ds_megatron.recompute.num_layers", "at most 2 per stage"),
    ("attention kernel", ["--set", "ds_megatron.model.attention=flash"], "ds_megatron.model.attention", "'flash'"),
    ("learning rate", ["--set", "optimizer.params.lr=0"], "optimizer.params.lr", "got 0"),
    (
        "non-finite learning rate",
        ["--set", "optimizer.params.lr=NaN"],
        "optimizer.params.lr",
        "finite number (got nan)",
    ),
    ("non-finite clipping", ["--set", "gradient_clipping=Infinity"], "gradient_clipping", "finite number (got inf)"),
    ("batch size", ["--set", "train_micro_batch_size_per_gpu=-1"], "train_micro_batch_size_per_gpu", "-1"),
    ("step count", ["--train-iters", "0"], "ds_megatron.train.train_iters", "got 0"),
]


@pytest.mark.parametrize("name,args,setting,detail", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, name, args, setting, detail):
    save = tmp_path / "save"
    if args is None:
        bad = tmp_path / "bad.json"
        bad.write_text('{"train_batch_size": 16,\n  "ds_megatron": {\n')
        proc = subprocess.run(
            [sys.executable, "recipes/train_gpt.py", "--deepspeed_config", str(bad), "--save", str(save)],
            cwd=ROOT,
            env={"WORLD_SIZE": "4", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
    else:
        if args == "EMPTY":
            (tmp_path / "empty.txt").write_text("")
            args = ["--data", str(tmp_path / "empty.txt")]
        elif args == "LATIN1":  # a Latin-1 corpus: tokenising it in the launch stopped with a traceback
            (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
            args = ["--data", str(tmp_path / "latin1.txt")]
        elif args == "BINARY":
            (tmp_path / "blob.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
            args = ["--data", str(tmp_path / "blob.jsonl")]
        elif args == "NOCKPT":
            (tmp_path / "ck").mkdir()
            args = ["--load", str(tmp_path / "ck")]
        elif args == "SHAPE":
            args = [
                "--load",
                str(
                    _fake_checkpoint(
                        tmp_path / "ck", {"size": None, "num_layers": 4, "hidden_size": 256, "num_heads": 4}
                    )
                ),
            ]
        elif args == "FAMILY":  # a Llama of the GPT's width, depth and heads: only the family tells them apart
            args = ["--load", str(_fake_checkpoint(tmp_path / "ck", {"size": "llama-tiny"}))]
        elif args == "LAYOUT":
            args = ["--load", str(_fake_checkpoint(tmp_path / "ck", tp=1, fp16=True)), "--tp", "2", "--pp", "2"]
        proc = cli([*args, "--save", str(save)])
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: {setting}: ") and detail in lines[0] and ";" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not save.exists()


class _WritesMarker:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint could do with any function."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_load_of_a_file_whose_unpickling_would_run_code_is_refused_before_launch(tmp_path):
    """A payload in DeepSpeed's model states, a per-layer file or an RNG file, with a manifest that vouches for it
    (the bytes are as saved: what they hold is the problem): pre-flight refuses each before any process group, the
    payload never runs.  So does a loadable file the manifest does not list, and a damaged pickle is called damaged
    (not code to refuse)."""
    from ds_megatron.config import ConfigError
    from ds_megatron.preflight import check_resume_files

    marker = tmp_path / "marker"
    for name in ("mp_rank_00_model_states.pt", "layer_02-model_00-model_states.pt", "rng_rank00001.pt"):
        ck = _fake_checkpoint(tmp_path / name)
        torch.save({"step": 2, "payload": _WritesMarker(marker)}, ck / "step00000002" / name)
        seal(ck / "step00000002")
        with pytest.raises(ConfigError, match=f"step00000002/{name} asks for GLOBAL "):
            check_resume_files(ck, "step00000002")
    proc = cli(["--load", str(ck), "--save", str(tmp_path / "save")])  # the last one, through the recipe
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("error: ds_megatron.checkpoint.load: a checkpoint file needs more than tensors"), lines
    assert "--trust-checkpoint" in lines[0], lines
    assert not marker.exists() and not (tmp_path / "save").exists()

    added = _fake_checkpoint(tmp_path / "added")
    torch.save({"step": 2}, added / "step00000002" / "extra.pt")
    with pytest.raises(ConfigError, match="does not match its manifest .*step00000002/extra.pt is not in manifest"):
        check_resume_files(added, "step00000002")
    damaged = _fake_checkpoint(tmp_path / "damaged")
    f = damaged / "step00000002" / "a.pt"
    torch.save({"w": torch.ones(2)}, f)
    seal(damaged / "step00000002")
    f.write_bytes(f.read_bytes().replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v3"))  # in the pickle, same size
    with pytest.raises(ConfigError, match="does not match its manifest .*step00000002/a.pt: sha256"):
        check_resume_files(damaged, "step00000002")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_a_worker_asks_for_a_stop(sig):
    """SIGTERM (a kill, a container stop) and SIGUSR1 (Slurm's warning ahead of the time limit, whose default action
    would end the process at once) both ask for a save after the current step."""
    from ds_megatron.stop import StopFlag

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        flag = StopFlag(watch_launcher=False)
        assert not flag.requested
        assert signal.getsignal(sig) == flag._handle  # checked first: without a handler the signal ends pytest
        os.kill(os.getpid(), sig)
        time.sleep(0.1)
        assert flag.requested and flag.reason == f"received {sig.name}"
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_save_that_finds_the_disk_full_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Disk full during a save: torch's writer fails with a C++ stream error and no errno (what torch.save to a full
    device raises is reproduced here by writing to /dev/full), or Python's with ENOSPC.  The trainer stops with one
    line naming the directory, the unwritten tag and the newest complete one (kept: the partial tag has no manifest),
    and exit status EXIT_DISK_FULL; any other save error keeps its traceback."""
    import errno
    import shutil
    import types

    import torch

    from ds_megatron import trainer as trainer_mod
    from ds_megatron.checkpoint import run_state

    try:
        torch.save({"w": torch.zeros(1 << 16)}, "/dev/full")
    except RuntimeError as err:
        torch_error = err
    else:
        pytest.fail("writing to /dev/full succeeded")
    save = tmp_path / "ck"
    (save / "step00000002").mkdir(parents=True)
    (save / "step00000002" / "manifest.json").write_text('{"step": 2, "files": {}}')
    (save / "step00000004").mkdir()  # the save that ran out of space
    stub = types.SimpleNamespace(
        run=types.SimpleNamespace(
            section=types.SimpleNamespace(checkpoint=types.SimpleNamespace(save=str(save), keep_last=0)),
            ds_config={},
        ),
        built=types.SimpleNamespace(engine=None, rng=None, topology=None, parallel=None),
        data=types.SimpleNamespace(tokenizer=None),
        wandb_id=None,
        skipped=0,
    )
    usage = shutil.disk_usage(tmp_path)
    full = types.SimpleNamespace(total=usage.total, used=usage.total, free=4096)
    for err, disk in ((torch_error, full), (OSError(errno.ENOSPC, "No space left on device"), usage)):
        monkeypatch.setattr(trainer_mod, "save_run", lambda *a, err=err, **k: (_ for _ in ()).throw(err))
        monkeypatch.setattr(run_state.shutil, "disk_usage", lambda path, disk=disk: disk)
        with pytest.raises(SystemExit) as stop:
            trainer_mod.Trainer.save(stub, 4)
        assert stop.value.code == trainer_mod.EXIT_DISK_FULL
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "error: ds_megatron.checkpoint.save: no space left on the device while writing step00000004 (left "
            f"incomplete, never resumed from) ({save}: "
        ), lines
        assert f"the last complete checkpoint is {save / 'step00000002'}; free space or set --save" in lines[0]
    monkeypatch.setattr(run_state.shutil, "disk_usage", lambda path: usage)  # space left: not a full disk
    monkeypatch.setattr(trainer_mod, "save_run", lambda *a, **k: (_ for _ in ()).throw(torch_error))
    with pytest.raises(RuntimeError, match="enforce fail"):
        trainer_mod.Trainer.save(stub, 4)


def test_a_launcher_orphaned_before_the_worker_looked_is_a_stop(monkeypatch):
    """The ``deepspeed`` command killed before a worker made its flag: the launcher's parent is already init, which
    would otherwise be watched as if it were the command.  Init as the real starter (a container's first process,
    the group's leader alive) is not a stop."""
    from types import SimpleNamespace

    from ds_megatron import stop

    parent = {"ppid": 1}
    monkeypatch.setattr(stop.psutil, "Process", lambda pid: SimpleNamespace(ppid=lambda: parent["ppid"]))
    monkeypatch.setattr(stop.os, "getpgid", lambda pid: 4242)
    monkeypatch.setattr(stop.psutil, "pid_exists", lambda pid: False)
    assert stop.orphaned_at_start(100) == "the deepspeed command (pid 4242) exited before this worker started"
    monkeypatch.setattr(stop.psutil, "pid_exists", lambda pid: pid == 4242)
    assert stop.orphaned_at_start(100) is None
    monkeypatch.setattr(stop.psutil, "pid_exists", lambda pid: False)
    parent["ppid"] = 77  # the command is still there
    assert stop.orphaned_at_start(100) is None


def test_the_cuda_device_is_set_before_any_collective_or_seed(monkeypatch):
    """On a node with several GPUs every rank's NCCL collectives (the ``--load`` tag's object all-gather first) run
    on the current device, cuda:0 until set: ``cuda:LOCAL_RANK`` must be set before the process group exists, on
    both ways into it (the trainer, and build_engine before its topology groups and RNG seeding)."""
    from ds_megatron import engine, trainer
    from ds_megatron.config import ConfigError, load_json, resolve

    calls: list = []
    group = {"up": False}

    class Reached(Exception):
        pass

    def init_process_group(**kwargs):
        calls.append("process group")
        group["up"] = True

    def collective(name):
        def record(*args, **kwargs):
            calls.append(name)
            raise Reached

        return record

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(engine, "device_type", lambda: "cuda")
    monkeypatch.setattr(engine.torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(engine.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: group["up"])
    monkeypatch.setattr(engine.deepspeed, "init_distributed", init_process_group)
    agree = lambda stop, phase: calls.append("all_reduce") is not None  # noqa: E731
    monkeypatch.setattr(trainer, "stopped_in_start_up", agree, raising=False)
    monkeypatch.setattr(trainer, "verified_load_tag", collective("all_gather_object"))
    run = resolve(load_json(TINY), 4)
    with pytest.raises(Reached):
        trainer.train(run)
    assert calls == [("set_device", 3), "process group", "all_reduce", "all_gather_object"]

    calls.clear()
    group["up"] = False
    monkeypatch.setattr(engine.ParallelTopology, "build", collective("new_group"))
    monkeypatch.setattr(engine.torch, "manual_seed", collective("manual_seed"))
    with pytest.raises(Reached):
        engine.build_engine(run)
    assert calls == [("set_device", 3), "process group", "new_group"]

    calls.clear()
    group["up"] = False
    monkeypatch.setattr(engine.torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1: one GPU per task
    with pytest.raises(ConfigError, match=r"^error: LOCAL_RANK: .*LOCAL_RANK=3, 1 visible GPU.*--gpus-per-node=N"):
        engine.build_engine(run)
    assert calls == []


def _agreed_reasons(group, rank: int, world: int) -> dict[str, str]:
    """Rank 1 alone was asked to stop: every rank agrees to stop and learns rank 1's reason."""
    from ds_megatron.stop import StopFlag

    flag = StopFlag(watch_launcher=False, handle_signals=False)
    if rank == 1:
        flag.request("the deepspeed command (pid 7) exited")
    stopped = flag.agreed(torch.device("cpu"))
    quiet = StopFlag(watch_launcher=False, handle_signals=False).agreed(torch.device("cpu"))
    return {"stop": f"{stopped} {flag.reason!r} {quiet}"}


def test_a_stop_seen_by_one_rank_is_agreed_with_its_reason_on_every_rank():
    """Rank 0 logs why the run stops even when another rank saw the launcher go first (whichever polls first)."""
    from inprocess import spawn_reports

    reports = spawn_reports(_agreed_reasons, 2)
    assert [r["stop"] for r in reports] == ["True 'the deepspeed command (pid 7) exited' False"] * 2
