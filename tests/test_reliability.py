"""Bad input refused before anything happens; crash-safe checkpoints; graceful stop; numerical guards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import ROOT, WORKERS, _free_port, deepspeed_launch, launcher_command, quiet_run_flags, read_losses

from ds_megatron.checkpoint.manifest import MANIFEST, file_record
from ds_megatron.config.schedule import warmup_cosine_from

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


def _launch_recipe(args: list[str], faults: list[str] | None = None, command: bool = True) -> subprocess.Popen:
    """The recipe on 2 processes in the background, through the `deepspeed` command (``command=False``: DeepSpeed's
    per-node launcher directly, for tests not about the command); with ``faults``, through
    tests/workers/faulty_train.py."""
    script = [str(WORKERS / "faulty_train.py"), *faults] if faults else ["recipes/train_gpt.py"]
    cmd = [*launcher_command(2, _free_port(), command), *script, "--deepspeed_config", TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _common(tmp_path: Path, name: str) -> list[str]:
    return quiet_run_flags(tmp_path, name, tp=2, pp=1, dropout=0.1)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.5)


@pytest.mark.slow
def test_crash_in_the_middle_of_a_save_then_exact_resume(tmp_path):
    """6 steps straight equal 3 steps, a crash, --load, 3 more steps (the straight run without saving).

    The second run saves at step 3 and at its end (step 6); every process is killed in the middle of the step-6
    save (files written, no manifest).  The restart skips that incomplete tag, resumes from step 3 and its losses
    for steps 4-6 equal the straight run's bit for bit (fp32, dropout 0.1, SP at tp 2)."""
    ck = tmp_path / "ck"
    proc = _launch_recipe(
        ["--train-iters", "6", "--save", str(ck), "--save-interval", "3", *_common(tmp_path, "crash")],
        ["--pause-before-manifest", "6:120"],
        command=False,
    )
    _wait_for(
        lambda: (
            (ck / "step00000006").is_dir()
            and (ck / "step00000003" / "manifest.json").exists()
            and len(list((ck / "step00000006").glob("rng_rank*.pt"))) == 2
        ),
        proc,
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ck / "latest").read_text() == "step00000003"
    assert not (ck / "step00000006" / "manifest.json").exists()
    # the restart, then the straight run (no save, no fault wrapper), in one launch (workers/recipe_runs.py)
    args = ["--deepspeed_config", TINY, "--train-iters", "6"]
    plan = [
        {"name": "resumed", "argv": [*args, "--load", str(ck), *_common(tmp_path, "resumed")], "output": True},
        {"name": "straight", "argv": [*args, *_common(tmp_path, "straight")]},
    ]
    (tmp_path / "plan.json").write_text(json.dumps([{**item, "status_dir": str(tmp_path)} for item in plan]))
    deepspeed_launch(WORKERS / "recipe_runs.py", 2, ["--plan", str(tmp_path / "plan.json")])
    for name in ("resumed", "straight"):
        assert json.loads((tmp_path / f"{name}.status.json").read_text())["status"] == 0, name
    out = "".join(f.read_text() for f in sorted(tmp_path.glob("resumed.rank*.out")))
    assert "skipping incomplete checkpoint(s) ['step00000006']" in out
    resumed, reference = read_losses(tmp_path / "resumed"), read_losses(tmp_path / "straight")
    assert sorted(resumed) == [4, 5, 6] and sorted(read_losses(tmp_path / "crash")) == [1, 2, 3, 4, 5, 6]
    assert all(read_losses(tmp_path / "crash")[s] == reference[s] for s in (1, 2, 3))
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)


def _tree(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _assert_stopped_and_saved(out: str, ck: Path, run_dir: Path, tree: list) -> None:
    """Every worker saved after its current step and exited 0, and no process of the launch is left."""
    import psutil

    assert out.count("stop requested: saving at step") == 1, out[-3000:]
    assert "exits with return code" not in out, out[-3000:]  # the launcher saw every worker exit 0
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    tag = (ck / "latest").read_text()
    step = int(tag.removeprefix("step"))
    assert (ck / tag / "manifest.json").exists() and 3 <= step < 500
    assert max(read_losses(run_dir)) == step


@pytest.mark.slow
def test_sigterm_to_the_deepspeed_command_saves_and_leaves_nothing_running(tmp_path):
    """SIGTERM to the `deepspeed` command alone (what a user's kill sends): DeepSpeed's single-node runner dies without
    passing it on, and the workers notice their launcher lost its parent, finish the step, save and exit 0."""
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    proc = _launch_recipe(["--train-iters", "500", "--save", str(ck), *_common(tmp_path, "run")])
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_losses(run_dir)) >= 3, proc)
    try:
        tree = _tree(proc.pid)
        assert sum(p.cmdline()[1:3] == ["-u", "recipes/train_gpt.py"] for p in tree) == 2  # the workers
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)  # the pipe closes when the launcher and both workers have exited
        _assert_stopped_and_saved(out, ck, run_dir, tree)
    finally:  # whatever a failure left of the launch
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "(the deepspeed command" in out


@pytest.mark.slow
def test_sigint_to_one_nodes_deepspeed_command_stops_every_node(tmp_path):
    """Two nodes of one process each, launched the way the README's clusters without ssh are (`--no_ssh`, one
    `deepspeed` command per node): SIGINT to node 1's command stops both nodes after the same step, with one
    checkpoint and nothing left running."""
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    launcher = Path(sys.executable).parent / "deepspeed"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    common = [str(launcher), "--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
    common += ["--master_port", str(_free_port())]
    args = ["--deepspeed_config", TINY, "--train-iters", "500", "--save", str(ck), *_common(tmp_path, "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            [*common, "--node_rank", str(i), "recipes/train_gpt.py", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_losses(run_dir)) >= 3, procs[0])
        trees = [_tree(p.pid) for p in procs]
        os.kill(procs[1].pid, signal.SIGINT)
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:  # whatever a failure left of the launches
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode == 0, outs[0][-3000:]  # node 0's command was not signalled: it ends normally
    _assert_stopped_and_saved(outs[0], ck, run_dir, trees[0] + trees[1])
    assert "exits with return code" not in outs[1]


def test_a_signal_to_a_worker_asks_for_a_stop():
    from ds_megatron.stop import StopFlag

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        flag = StopFlag(watch_launcher=False)
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert flag.requested and flag.reason == "received SIGTERM"
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path):
    """NaN losses at steps 2, 4, 5, 6 with max_bad_steps 3: step 2 is skipped, counted and training goes on; steps
    4-6 in a row stop the run with a checkpoint and a clear message."""
    ck = tmp_path / "ck"
    proc = _launch_recipe(
        [
            "--train-iters",
            "20",
            "--save",
            str(ck),
            "--set",
            "ds_megatron.train.max_bad_steps=3",
            *_common(tmp_path, "run"),
        ],
        ["--nan-steps", "2,4,5,6"],
        command=False,
    )
    out, _ = proc.communicate(timeout=240)
    losses = read_losses(tmp_path / "run")
    assert sorted(losses) == [1, 3], losses  # steps 2, 4, 5, 6 logged no loss
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records if "loss" in r] == [0, 1]
    # the skipped step did not advance the schedule: step 3 uses the rate of the second applied update
    cfg = json.loads(Path(TINY).read_text())
    peak = cfg["optimizer"]["params"]["lr"]
    assert [r["lr"] for r in records if "loss" in r] == [peak * warmup_cosine_from(cfg).ratio(k) for k in (1, 2)]
    assert "non-finite loss nan or grad norm nan: update skipped (1 in a row, 1 in total)" in out
    assert "error: training: 3 steps in a row with a non-finite loss" in out
    assert proc.returncode != 0
    assert (ck / "latest").read_text() == "step00000006" and (ck / "step00000006" / "manifest.json").exists()
