"""Run a worker script in N real processes with the deepspeed launcher (CPU: gloo), as one node or as several nodes on
this machine, and return its output."""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed's CPU all-reduce buffers of the job that used ``port``."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


# What a killed run leaves behind and nothing live holds.  DeepSpeed's CPU all-reduce buffers (``init_inference``
# builds them; a run that dies keeps its 66 MB each in /dev/shm until removed) are mapped by every process using them;
# torch's extension build lock (a ``lock`` file its builder holds open for the length of the build) makes every later
# build of that extension wait forever once its builder died.  Either is removed only when no process has it mapped
# or open and it is older than a minute (a builder between closing and removing its lock, a buffer between its
# creation and its mapping), so a session of another checkout running beside this one keeps its own.
STALE = [
    (Path("/dev/shm"), "deepspeed_allreduce_buffer_*"),
    (Path.home() / ".cache" / "torch_extensions", "*/*/lock"),
]


def _held_paths() -> set[str]:
    """Every file some process of this machine has open or mapped (as far as /proc lets this user see)."""
    held = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # exited meanwhile, or not ours to read
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):  # closed meanwhile (the listing's own, in this process)
                    held.add(os.readlink(fd))
        with contextlib.suppress(OSError):
            with open(proc / "maps") as maps:  # address, permissions, offset, device, inode, path
                held.update(parts[5].strip() for parts in (line.split(None, 5) for line in maps) if len(parts) == 6)
    return held


def clear_stale_state(stale: list[tuple[Path, str]] = STALE) -> list[Path]:
    """Remove what a killed run left (``stale``: folder and pattern) and nothing holds; the paths removed."""
    candidates = [p for folder, pattern in stale if folder.is_dir() for p in folder.glob(pattern)]
    old = [p for p in candidates if time.time() - p.stat().st_mtime > 60]
    if not old:
        return []
    held = _held_paths()
    removed = [p for p in old if str(p) not in held]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def deepspeed_launch(
    script: str | Path,
    nprocs: int,
    args: list[str],
    timeout: int = 600,
    env_extra: dict | None = None,
    command: bool = False,
) -> str:
    """Launch ``script`` in ``nprocs`` processes and wait for it; its output, or raise with the output tail on failure.

    By default DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch``) is started directly, with the
    arguments the ``deepspeed --num_gpus N`` command gives it on one node (the command's runner passes the environment
    on unchanged there): the workers see the same launcher, ranks, environment and process chain below the launcher,
    and the runner's own start (a Python process importing torch and deepspeed, about 3 s of the 2 cores) is saved.
    ``command=True`` runs the real ``deepspeed`` command, for tests of what the command itself does."""
    return Launch(script, nprocs, args, timeout, env_extra, command).finish()


class Launch:
    """``deepspeed_launch`` in two halves: the processes start when this is made and run while the test process does
    other work; ``finish`` waits for them and gives what ``deepspeed_launch`` gives.  The output goes to a file, not
    a pipe (nobody drains a pipe while the launch runs in the background, and a full one would block the ranks)."""

    def __init__(self, script, nprocs: int, args: list[str], timeout=600, env_extra=None, command: bool = False):
        self.script, self.nprocs, self.args, self.timeout = script, nprocs, args, timeout
        self.port = _free_port()
        self.cmd = [*launcher_command(nprocs, self.port, command), str(script), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
        env.update(env_extra or {})
        self.log = tempfile.TemporaryFile(mode="w+", prefix="ds_megatron-launch-")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        _RUNNING.add(self.proc)

    def finish(self) -> str:
        """Wait for the launch (at most ``timeout`` seconds from its start: then it is killed and this raises
        ``subprocess.TimeoutExpired``); its output, or raise with the output tail when it failed."""
        try:
            self.proc.wait(timeout=max(0.0, self.start + self.timeout - time.monotonic()))
        except BaseException:  # a timeout, or the session interrupted: the launch does not outlive its wait
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            _RUNNING.discard(self.proc)
            _record_launch(self.script, self.nprocs, seconds=time.monotonic() - self.start, args=self.args)
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        leaked = shm_buffers(self.port)
        for f in leaked:  # never let a failed run fill the machine's memory (see engine.release_shm_buffer_name)
            f.unlink(missing_ok=True)
        if leaked and self.proc.returncode == 0:
            raise AssertionError(f"the run left DeepSpeed shared-memory buffers behind: {[f.name for f in leaked]}")
        if self.proc.returncode != 0:
            raise AssertionError(f"{' '.join(self.cmd)} failed with {self.proc.returncode}:\n{output[-6000:]}")
        return output


_RUNNING: set[subprocess.Popen] = set()  # launches started and not yet waited for


@atexit.register
def _stop_running() -> None:
    """A session that ends (or is interrupted) before waiting for a background launch stops it: DeepSpeed's launcher
    passes SIGTERM on to its ranks."""
    for proc in list(_RUNNING):
        proc.terminate()


def launcher_command(nprocs: int, port: int, command: bool = False) -> list[str]:
    """What starts ``nprocs`` processes of a script on this machine: ``deepspeed --num_gpus N`` with ``command``,
    else DeepSpeed's per-node launcher with the arguments that command's single-node runner gives it."""
    if command:
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port)]
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nprocs))}).encode()).decode()
    launcher = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}"]
    return [*launcher, "--master_addr=127.0.0.1", f"--master_port={port}", "--log_level=info"]


def _record_launch(script: str | Path, nprocs: int, nodes: int = 1, seconds: float = 0.0, args=()) -> None:
    """With DS_MEGATRON_TEST_LAUNCH_LOG set, append one line per launch (test, script, processes, wall seconds from
    its start until a test waited for it: more than the launch took when it ran in the background; for a shared
    launch the workers it ran and each one's own seconds): the suite's time is mostly launches, and this counts them
    per test."""
    log = os.environ.get("DS_MEGATRON_TEST_LAUNCH_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        runs = [Path(a.split()[0]).name for a, flag in zip(args[1:], args) if flag == "--run"]
        record = {"test": test, "script": Path(script).name, "nprocs": nprocs, "nodes": nodes}
        record.update(seconds=round(seconds, 1), **({"runs": runs} if runs else {}))
        done = [Path(a) for a, flag in zip(args[1:], args) if flag == "--done"]
        if done:  # each finished run's own seconds (workers/several.py's completion markers)
            markers = [done[0] / f"{i}.done" for i in range(len(runs))]
            record["run_seconds"] = [json.loads(m.read_text())["seconds"] if m.exists() else None for m in markers]
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")


def deepspeed_launch_nodes(
    script: str | Path,
    nodes: int,
    procs_per_node: int,
    args: list[str],
    node_args=lambda node: [],
    timeout: int = 600,
) -> list[str]:
    """Launch ``script`` as ``nodes`` nodes of ``procs_per_node`` processes on this machine, the way a cluster without
    ssh between its nodes is launched: a hostfile names the nodes, and every node runs ``deepspeed --hostfile H
    --no_ssh --node_rank i --master_addr <node 0> --master_port P``.  ``node_args(i)`` adds node i's own flags.
    Returns each node's output; raises with every node's output tail when one fails."""
    launcher = Path(sys.executable).parent / "deepspeed"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hostfile"
        hostfile.write_text("".join(f"node{i} slots={procs_per_node}\n" for i in range(nodes)))
        common = [str(launcher), "--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
        common += ["--master_port", str(port)]
        logs = [Path(tmp) / f"node{i}.log" for i in range(nodes)]  # files, not pipes: no node blocks on a full pipe
        procs = []
        for i in range(nodes):
            with open(logs[i], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [*common, "--node_rank", str(i), str(script), *args, *node_args(i)],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # a node's launcher and its processes end together on a timeout
                    )
                )
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        outputs = [log.read_text() for log in logs]
        _record_launch(script, procs_per_node, nodes, seconds=time.monotonic() - start)
    leaked = shm_buffers(port)
    for f in leaked:
        f.unlink(missing_ok=True)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        tails = "\n".join(f"--- node {i} ({procs[i].returncode}):\n{out[-4000:]}" for i, out in enumerate(outputs))
        raise AssertionError(f"node(s) {failed} of {script} failed:\n{tails}")
    if leaked:
        raise AssertionError(f"the run left DeepSpeed shared-memory buffers behind: {[f.name for f in leaked]}")
    return outputs


TINY_CONFIG = str(ROOT / "ds_configs" / "gpt_tiny.json")
RECIPE = ROOT / "recipes" / "train_gpt.py"


_TOKEN_CACHE: list[Path] = []


def shared_token_cache() -> Path:
    """One data cache for every test run of this pytest process.  The cache names its files by their inputs (corpus
    fingerprint, tokenizer spec, sequence length) and builds them under a file lock, so runs of the same data share
    the BPE training and the packing, which a cache per test paid again in each test's first launch."""
    if not _TOKEN_CACHE:
        _TOKEN_CACHE.append(Path(tempfile.mkdtemp(prefix="ds_megatron-test-token-cache-")))
        atexit.register(shutil.rmtree, _TOKEN_CACHE[0], True)
    return _TOKEN_CACHE[0]


def quiet_run_flags(tmp_path: Path, name: str, tp: int, pp: int, dropout: float | None = None) -> list[str]:
    """Flags for short test runs of the recipe: own run dir, the data cache shared by the process's tests
    (``shared_token_cache``), a log line per step, no sample, no wandb, one validation batch."""
    flags = [
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--log-interval",
        "1",
        "--set",
        f"ds_megatron.logging.run_dir={tmp_path / name}",
        "--set",
        f"ds_megatron.data.cache_dir={shared_token_cache()}",
        "--set",
        "ds_megatron.train.generate_tokens=0",
        "--set",
        "ds_megatron.logging.wandb_project=null",
        "--set",
        "ds_megatron.train.eval_iters=1",
    ]
    if dropout is not None:
        flags += ["--set", f"ds_megatron.model.dropout={dropout}"]
    return flags


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss from a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}


# Worker runs of several test modules at the same process count share one launch (``workers/several.py``): a
# launch's fixed cost (the launcher, every rank importing torch and deepspeed, the process group, DeepSpeed's first
# engine build) is most of what a short worker run costs.  A module registers its runs with ``shared_launch`` at
# import; the first test that needs them starts every registered run of that process count and phase of the modules
# that have a selected test (``tests/launcher/conftest.py`` fills SELECTED_MODULES), each module's runs writing into
# their own folder.  Each run is still its own ``__main__`` with its own engine (see workers/several.py).  A run that
# must start in a fresh launch after another (a resume) registers in a later phase, and its ``runs`` function asks
# for the earlier phase's result itself (the work between the two, such as moving a checkpoint, goes there too).
# The launches of one phase start together, when the first of them is needed, and run in the background until a
# test needs their results: a launch of 1 or 2 processes leaves a core idle much of the time (one rank's single-core
# start, a pipeline stage waiting for the other), and the tests in between (other launches, in-process checks)
# use it.  Each launch's planning (a module's ``runs``) happens in the test process's main thread before its start.
SELECTED_MODULES: set[str] | None = None  # None: every registered module
# DS_MEGATRON_TEST_OVERLAP=0 runs the launcher tier one launch (and one reliability scenario) at a time, as before
# the overlap: the same checks, for comparing the two on a given machine.
OVERLAP = os.environ.get("DS_MEGATRON_TEST_OVERLAP", "1") != "0"


class _SharedLaunch:
    def __init__(self, nprocs: int, phase: int):
        self.nprocs, self.phase, self.entries = nprocs, phase, []
        self.done: Path | None = None  # the runs' completion markers, once started
        self.running: Launch | None = None  # the launch, until it is waited for
        self.failure: str | None = None  # the launch's output tail when it failed

    def start(self) -> None:
        """Plan the selected modules' runs and start the launch (nothing to start: done at once)."""
        root = Path(tempfile.mkdtemp(prefix=f"ds_megatron-shared-{self.nprocs}-{self.phase}-"))
        atexit.register(shutil.rmtree, root, True)
        self.done = root / "done"
        self.done.mkdir()
        args, index = ["--done", str(self.done)], 0
        entries = [e for e in self.entries if SELECTED_MODULES is None or e["module"] in SELECTED_MODULES]
        for k, entry in enumerate(entries):
            entry["out"] = root / f"{k}-{entry['module']}"
            entry["out"].mkdir()
            try:
                runs = entry["runs"](entry["out"])
            except AssertionError as err:  # what this module's runs depend on failed: the other modules still run
                entry["error"] = str(err)[-6000:]
                continue
            for run in runs:
                entry["indices"].append(index)
                args += ["--run", run]
                index += 1
        if index == 0:
            return
        timeout = sum(e["timeout"] for e in entries)
        self.running = Launch(WORKERS / "several.py", self.nprocs, args, timeout=timeout)

    def wait(self) -> None:
        if self.running is None:
            return
        launch, self.running = self.running, None
        try:
            launch.finish()
        except (AssertionError, subprocess.TimeoutExpired) as err:
            self.failure = str(err)[-6000:]


_SHARED: dict[tuple[int, int], _SharedLaunch] = {}


def _start_phase(phase: int) -> None:
    """Start every launch of ``phase`` not started yet that has a selected module's runs."""
    for shared in list(_SHARED.values()):
        selected = any(SELECTED_MODULES is None or e["module"] in SELECTED_MODULES for e in shared.entries)
        if shared.phase == phase and shared.done is None and selected:
            shared.start()


def shared_launch(module: str, nprocs: int, runs, phase: int = 0, timeout: int = 600):
    """Register ``runs(out)`` (``workers/several.py`` ``--run`` strings writing under the folder ``out``) of test
    module ``module`` for the shared launch of ``nprocs`` processes in ``phase`` (``timeout``: seconds these runs may
    take).  Returns a function giving ``out`` once the launch ran; it raises with the launch's output tail when one
    of this module's runs did not finish (``check=False``: it gives ``out`` all the same, for runs that report their
    own outcome)."""
    shared = _SHARED.setdefault((nprocs, phase), _SharedLaunch(nprocs, phase))
    entry = {"module": module, "runs": runs, "out": None, "indices": [], "timeout": timeout, "error": None}
    shared.entries.append(entry)

    def result(check: bool = True) -> Path:
        if shared.done is None and OVERLAP:
            _start_phase(phase)
        elif shared.done is None:
            shared.start()
        shared.wait()
        if not check and entry["out"] is not None:
            return entry["out"]
        if entry["error"] is not None:
            raise AssertionError(f"{module}: the runs of phase {phase} could not be planned:\n{entry['error']}")
        missing = [i for i in entry["indices"] if not (shared.done / f"{i}.done").exists()]
        if missing or entry["out"] is None:
            raise AssertionError(f"{module}: run(s) {missing} of the shared launch did not finish:\n{shared.failure}")
        return entry["out"]

    return result
