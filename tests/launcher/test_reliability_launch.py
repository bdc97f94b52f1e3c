"""The launcher tests of ``tests/unit/test_reliability.py``: that file's docstring states their subject.

Each test here is one scenario of real processes (a launch, a signal at the right moment, what is left after it),
and most of a scenario's wall time is its processes starting on one core (the ``deepspeed`` command, then its
launcher, then the ranks importing torch) or waiting (for a step to be logged, for the launcher watch's next poll).
So the selected scenarios of this file run side by side, a few at a time, in the module's ``scenarios`` fixture,
each with its own folder, processes and ports; each test then reports its own scenario's outcome (its assertion
message and traceback when it failed).  Nothing is shared between two scenarios but the data cache, which is built
under a file lock."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from launch import OVERLAP, ROOT, WORKERS, _free_port, deepspeed_launch, launcher_command, quiet_run_flags, read_losses
from test_reliability import TINY

from ds_megatron.config.schedule import warmup_cosine_from


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


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = log.read_text() if log is not None else proc.stdout.read()
            raise AssertionError(f"the run ended early ({proc.returncode}):\n{out[-4000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.5)


def crash_in_the_middle_of_a_save_then_exact_resume(tmp_path: Path) -> None:
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
    items = [{**item, "status_dir": str(tmp_path), "plot": False} for item in plan]  # the losses, not the figure
    (tmp_path / "plan.json").write_text(json.dumps(items))
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


def sigterm_to_the_deepspeed_command_saves_and_leaves_nothing_running(tmp_path: Path) -> None:
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


def sigint_to_one_nodes_deepspeed_command_stops_every_node(tmp_path: Path) -> None:
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
    # Each node's output goes to a file, not a pipe: a pipe nobody drains while the test waits fills up (64 KiB),
    # the node's next print blocks, and its peer then waits in a collective for ever.
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [*common, "--node_rank", str(i), "recipes/train_gpt.py", *args],
                    cwd=ROOT,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        _wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and len(read_losses(run_dir)) >= 3, procs[0], log=logs[0]
        )
        trees = [_tree(p.pid) for p in procs]
        os.kill(procs[1].pid, signal.SIGINT)
        # Node 1's launcher and worker outlive its command (they are orphaned, then stop): wait for all of them.
        import psutil

        gone, alive = psutil.wait_procs(trees[0] + trees[1], timeout=120)
        if alive:
            tails = "\n----\n".join(log.read_text()[-2500:] for log in logs)
            raise AssertionError(f"{len(alive)} process(es) still running 120 s after SIGINT:\n{tails}")
        procs[0].wait()
    finally:  # whatever a failure left of the launches
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    outs = [log.read_text() for log in logs]
    assert procs[0].returncode == 0, outs[0][-3000:]  # node 0's command was not signalled: it ends normally
    _assert_stopped_and_saved(outs[0], ck, run_dir, trees[0] + trees[1])
    assert "exits with return code" not in outs[1]


def non_finite_steps_are_skipped_then_stop_the_run(tmp_path: Path) -> None:
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


START_UP_STOPS = {  # phase paused in (workers/faulty_train.py --pause-in) -> the phase the run stops after
    "group": "starting the process group",
    "checksum": "verifying the --load checkpoint",
    "tokenise": "preparing the data",
}


def sigterm_to_the_deepspeed_command_during_start_up_ends_the_run(tmp_path: Path, phase: str) -> None:
    """SIGTERM to the `deepspeed` command while the workers are still starting (imports done, before the process
    group; in the ``--load`` checksum pass, before the engine; while the token cache is built): the workers finish
    that phase, agree, and exit 0 before training.  No process is left, no checkpoint is written, the checkpoint
    loaded from and the token cache are whole.  (Before, the flag and the launcher watch began only once training
    did, and took the already orphaned launcher's new parent for the command: the run trained to its end.)"""
    from test_reliability import _fake_checkpoint

    ck, run_dir, markers = tmp_path / "ck", tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    args = ["--train-iters", "3", "--save", str(ck), *_common(tmp_path, "run")]
    if phase == "checksum":
        load = _fake_checkpoint(tmp_path / "load")
        before = {p.name: p.read_bytes() for p in (load / "step00000002").iterdir()}
        args += ["--load", str(load)]
    if phase == "tokenise":  # a cache of its own, so that this launch tokenises
        args += ["--set", f"ds_megatron.data.cache_dir={tmp_path / 'cache'}"]
    proc = _launch_recipe(args, ["--pause-in", f"{phase}:{markers}"])
    try:
        _wait_for(lambda: any(markers.iterdir()), proc)
        tree = _tree(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        import psutil

        gone, alive = psutil.wait_procs(tree, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"exiting after {START_UP_STOPS[phase]}, before training; nothing saved" in out, out[-3000:]
    # rank 0 names the command, whichever rank saw it go first (the stop's reason is shared when it is agreed)
    assert "(the deepspeed command" in out and "exits with return code" not in out
    # nothing but the lock the run held for its --save directory (the kernel's flock: released at its exit)
    assert not ck.exists() or [p.name for p in ck.iterdir()] == ["train.lock"], sorted(ck.iterdir())
    assert not (run_dir / "metrics.jsonl").exists() or not read_losses(run_dir)
    if phase == "checksum":
        assert {p.name: p.read_bytes() for p in (load / "step00000002").iterdir()} == before
    if phase == "tokenise":  # built to the end, then found by the record written last
        (record,) = (tmp_path / "cache").glob("launch-*.json")
        assert Path(json.loads(record.read_text())["cache_file"]).is_file()


def workers_started_as_srun_starts_them_train_and_stop_at_sigusr1(tmp_path: Path) -> None:
    """Two workers started by hand with only the variables srun gives a task (no RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR or MASTER_PORT): they find their ranks and the rendezvous (the node list's first host, a port from
    the job id), train, and at SIGUSR1 to every task (what ``--signal=USR1@...`` makes Slurm send to a job step's
    tasks ahead of the time limit) save after the current step and exit 0."""
    import random
    import socket

    from ds_megatron.launch_env import SLURM_PORT_BASE

    for job in random.sample(range(10_000), 100):  # a job id whose port nobody uses now
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", SLURM_PORT_BASE + job))
            break
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")}
    base = {k: v for k, v in base.items() if not k.startswith(("MASTER_", "SLURM_", "OMPI_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    base.update(SLURM_JOB_ID=str(4_000_000 + job), SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2")
    args = ["--deepspeed_config", TINY, "--train-iters", "500", "--save", str(ck), *_common(tmp_path, "run")]
    logs, procs = [tmp_path / f"task{i}.log" for i in range(2)], []
    for i, log in enumerate(logs):
        task = {"SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0"}
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-u", "recipes/train_gpt.py", *args],
                    cwd=ROOT,
                    env={**base, **task},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        trained = lambda: (run_dir / "metrics.jsonl").exists() and len(read_losses(run_dir)) >= 2  # noqa: E731
        _wait_for(trained, procs[0], log=logs[0])
        for p in procs:
            os.kill(p.pid, signal.SIGUSR1)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    out = logs[0].read_text()
    assert codes == [0, 0], (codes, out[-3000:], logs[1].read_text()[-3000:])
    assert out.count("stop requested: saving at step") == 1 and "(received SIGUSR1)" in out, out[-3000:]
    tag = (ck / "latest").read_text()
    assert (ck / tag / "manifest.json").exists() and max(read_losses(run_dir)) == int(tag.removeprefix("step"))
    assert len(list((ck / tag).glob("rng_rank*.pt"))) == 2  # both ranks wrote their part of one checkpoint


# The scenario of each test, by the test's name (a parametrized test's scenario takes its parameters).
SCENARIOS: dict[str, Callable[..., None]] = {
    f"test_{scenario.__name__}": scenario
    for scenario in (
        crash_in_the_middle_of_a_save_then_exact_resume,
        sigint_to_one_nodes_deepspeed_command_stops_every_node,
        sigterm_to_the_deepspeed_command_saves_and_leaves_nothing_running,
        sigterm_to_the_deepspeed_command_during_start_up_ends_the_run,
        non_finite_steps_are_skipped_then_stop_the_run,
        workers_started_as_srun_starts_them_train_and_stop_at_sigusr1,
    )
}
# Scenarios running at once: enough to keep two cores busy through the single-core starts and the waits; each
# scenario's waits are bounded in its own clock (_wait_for, the faults' pauses), so a loaded machine slows them all
# alike.  In the order of SCENARIOS: the longest (two launches in a row, two nodes) start first.
AT_ONCE = 3 if OVERLAP else 1


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    """{test name: the future of its scenario}, for the tests of this module that the session selected, started in
    the order of SCENARIOS, AT_ONCE at a time, each in its own folder.

    SIGINT is set to Python's handler while they start (a suite started in the background of a non-interactive
    shell, ``make test &`` or a CI step, runs with SIGINT ignored; every child would inherit that and Python keeps a
    signal ignored at start-up ignored, so the ``deepspeed`` command would never see the SIGINT a test sends, while a
    user's Ctrl-C reaches a foreground command, whose SIGINT is not ignored): a handled signal is back to its default
    in every child process."""
    mine = [item for item in request.session.items if item.module is request.module]
    order = list(SCENARIOS)
    mine.sort(key=lambda item: order.index(item.originalname))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="scenario")
    futures: dict[str, Future] = {}
    for item in mine:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        folder = tmp_path_factory.mktemp(item.originalname.removeprefix("test_")[:30])
        futures[item.name] = pool.submit(SCENARIOS[item.originalname], folder, **params)
    try:
        yield futures
    finally:
        pool.shutdown(wait=True)
        signal.signal(signal.SIGINT, previous)


def _outcome(scenarios: dict[str, Future], request) -> None:
    """The test's scenario, once it ended: its exception (the assertion message and the traceback in the scenario)
    is the test's failure."""
    scenarios[request.node.name].result()


@pytest.mark.slow
def test_crash_in_the_middle_of_a_save_then_exact_resume(scenarios, request):
    _outcome(scenarios, request)


@pytest.mark.slow
def test_sigint_to_one_nodes_deepspeed_command_stops_every_node(scenarios, request):
    _outcome(scenarios, request)


@pytest.mark.slow
def test_sigterm_to_the_deepspeed_command_saves_and_leaves_nothing_running(scenarios, request):
    _outcome(scenarios, request)


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(START_UP_STOPS))
def test_sigterm_to_the_deepspeed_command_during_start_up_ends_the_run(scenarios, request, phase):
    _outcome(scenarios, request)


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop_the_run(scenarios, request):
    _outcome(scenarios, request)


@pytest.mark.slow
def test_workers_started_as_srun_starts_them_train_and_stop_at_sigusr1(scenarios, request):
    _outcome(scenarios, request)
