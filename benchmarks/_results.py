"""Writing a benchmark's result as markdown: a title, the date, the machine and the command, then the table."""

from __future__ import annotations

import datetime
import os
import platform
import time

import torch


def machine_line() -> str:
    """Date, CPU architecture, core count and torch version: what a reader needs to compare two results."""
    return (
        f"{datetime.date.today().isoformat()}, {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"
    )


def write_markdown(path: str, title: str, command: str, body: str) -> None:
    with open(path, "w") as f:
        f.write(f"# {title}\n\n{machine_line()}, `{command}`\n\n{body}\n")


def _machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq and steal, the last being time the hypervisor gave to other guests)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of its children that have been waited for (joined)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherWork:
    """How busy the rest of the machine was while the ``with`` block ran: the machine's busy CPU seconds minus this
    process's and its joined children's, per wall second (``cores``: 0 on a quiet machine, 1 when another job kept
    one core busy throughout).  Unlike the load average, the benchmark's own processes (and the runs just before it)
    do not count; the children must be joined inside the block."""

    def __enter__(self) -> OtherWork:
        self._t0, self._busy0, self._own0 = time.perf_counter(), _machine_busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        other = (_machine_busy_seconds() - self._busy0) - (_own_seconds() - self._own0)
        self.cores = max(other, 0.0) / wall if wall > 0 else 0.0
        self.wall = wall
