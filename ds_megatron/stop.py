"""A graceful stop: SIGTERM, SIGINT or SIGUSR1 to a worker, or the end of the launcher processes above it, asks the
training to finish the current step, save and exit 0 (before the first step: to exit 0 at the end of the current
start-up phase, saving nothing).  SIGUSR1 is what Slurm sends ahead of a job's time limit (``--signal=USR1@600``);
its default action would kill the process at once, losing every step since the last save.

The flag is made first thing in the worker (``cli.train.main``), before torch and deepspeed are imported and before
the ``--load`` checksum pass, the engine build and the tokenising that take the seconds to minutes of start-up: a
stop sent then is kept (the training agrees on it after each phase), not lost to a process without a handler or to a
launcher chain recorded after it was already broken.

Why the launchers are watched: a signal sent to the ``deepspeed`` command a user typed (their ``kill``, a batch
scheduler's time limit) reaches only DeepSpeed's runner.  On a single node (and on every node of a ``--no_ssh``
launch) that runner installs no handler: it dies at once and passes nothing on, leaving its per-node launcher
(``deepspeed.launcher.launch``) and the workers training with no parent and no checkpoint at the end.  So each worker
remembers, at start, its launcher and the process that started the launcher; when either goes away (the launcher is
re-parented, or this worker is), that is a stop request like a signal.  A signal that does reach the launcher is
forwarded by it to the workers (it kills them 30 s later); a terminal's Ctrl-C reaches every process of the group.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

LAUNCHER_MODULE = "deepspeed.launcher.launch"
POLL_SECONDS = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    """Set by a stop signal or by the launcher watch; :meth:`agreed` makes every rank stop together.  Importing this
    module and making the flag import neither torch nor deepspeed."""

    def __init__(self, watch_launcher: bool = True, handle_signals: bool = True):
        self.requested = False
        self.reason = ""
        for sig in STOP_SIGNALS if handle_signals else ():
            signal.signal(sig, self._handle)
        chain = launcher_chain() if watch_launcher else None
        why = orphaned_at_start(chain[0]) if chain is not None else None
        if why:
            self.request(why)
        elif chain is not None:
            threading.Thread(target=self._watch, args=chain, name="ds_megatron-launcher-watch", daemon=True).start()

    def _handle(self, signum, frame):
        self.request(f"received {signal.Signals(signum).name}")

    def request(self, reason: str) -> None:
        if not self.requested:
            self.reason = reason
        self.requested = True

    def _watch(self, launcher_pid: int, starter_pid: int) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            why = chain_broken(launcher_pid, starter_pid)
            if why:
                self.request(why)
                return

    def agreed(self, device) -> bool:
        """Collective: stop when any rank was asked to.  Then every rank learns the first reason any rank had (one
        object all-gather, only when stopping), so rank 0 logs why the run stopped even when a peer saw it first."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return False
        reasons: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(reasons, self.reason)
        self.reason = self.reason or next((r for r in reasons if r), "")
        return True


def launcher_chain() -> tuple[int, int] | None:
    """(launcher pid, pid of the process that started the launcher) when this process is a worker of DeepSpeed's
    per-node launcher, else None (a plain ``python`` run, another launcher: nothing to watch)."""
    try:
        launcher = psutil.Process(os.getppid())
        if LAUNCHER_MODULE not in " ".join(launcher.cmdline()):
            return None
        return launcher.pid, launcher.ppid()
    except psutil.Error:
        return None


def chain_broken(launcher_pid: int, starter_pid: int) -> str | None:
    """Why the launcher chain recorded at start no longer holds, or None while it does."""
    if os.getppid() != launcher_pid:
        return f"the deepspeed launcher (pid {launcher_pid}) exited"
    try:
        if psutil.Process(launcher_pid).ppid() != starter_pid:
            return f"the deepspeed command (pid {starter_pid}) exited"
    except psutil.Error:
        return f"the deepspeed launcher (pid {launcher_pid}) exited"
    return None


def orphaned_at_start(launcher_pid: int) -> str | None:
    """Why the launcher had already lost the ``deepspeed`` command when this worker first looked, or None.

    An orphan is re-parented to init (pid 1), so its parent then looks like a starter to watch.  Init can also be the
    real starter (a container whose first process runs the launcher), so init alone proves nothing: the launcher is
    taken as orphaned when, besides, the leader of its process group is gone.  The ``deepspeed`` command leads the
    group it shares with its launcher when a terminal's shell or a job runner started it in a group of its own."""
    try:
        if psutil.Process(launcher_pid).ppid() != 1:
            return None
        leader = os.getpgid(launcher_pid)
    except (psutil.Error, ProcessLookupError):
        return f"the deepspeed launcher (pid {launcher_pid}) exited"
    if leader in (launcher_pid, 1) or psutil.pid_exists(leader):
        return None
    return f"the deepspeed command (pid {leader}) exited before this worker started"
