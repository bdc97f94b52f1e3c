"""The in-process tier's harness: run named checks on every rank of a gloo group of ``world`` processes and report
per check.  A group of one runs in the test process (the topology hands over ``None``); larger groups run on one pool
of ranks per world size, started at its first use and kept for the test session (starting a rank and
importing torch cost more than most checks).

A check returns (what, actual, expected[, tolerance]) tuples; they are compared only after all of the check's
collectives ran, so a mismatch on one rank never leaves the others waiting in a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed import ProcessGroup

Pair = tuple[str, Tensor | None, Tensor] | tuple[str, Tensor | None, Tensor, float]
Pairs = list[Pair]  # (what, sharded result, reference[, atol = rtol]), compared after all collectives
TOLERANCE = 1e-5
# bf16 results against their reference (the same model in bf16, or another layout of it): bf16 keeps 8 bits of
# mantissa, so one rounding of a sum of O(1) terms is ~4e-3
BF16_TOLERANCE = 2e-2
_failed = False  # set on a pool rank when one of its checks failed: its job's pool is then replaced


def run_checks(checks: dict[str, Callable[[Any], Pairs]], ctx: Any) -> dict[str, str]:
    """Run every check on this rank; "ok" or the failures per check."""
    global _failed
    report = {}
    for name, check in checks.items():
        torch.manual_seed(0)  # identical draws on every rank: all ranks build the same reference and inputs
        try:
            errors = []
            for what, actual, expected, *tol in check(ctx):
                t = tol[0] if tol else TOLERANCE
                try:
                    torch.testing.assert_close(actual, expected.detach(), atol=t, rtol=t)
                except (AssertionError, TypeError) as e:  # TypeError: a gradient that never arrived (None)
                    errors.append(f"{what}: {e}")
            report[name] = "\n".join(errors) or "ok"
        except Exception:
            report[name] = traceback.format_exc()
    _failed = _failed or any(v != "ok" for v in report.values())
    return report


# A rank that has not started, or not answered a job, by then (stuck outside any collective) fails its test.
START_TIMEOUT_S = JOB_TIMEOUT_S = 600


def _pool_worker(rank: int, world: int, init_file: str, conn: Connection) -> None:
    """One rank of a pool: join the gloo group once, then run every job sent until told to stop (``None``)."""
    global _failed
    torch.set_num_threads(1)  # several ranks share few cores; intra-op threads would only oversubscribe them
    # torch.testing.assert_close imports DTensor on its first call where torch.distributed exists, and with it
    # torch.fx and sympy: 2-3 s of CPU in every rank.  No check compares DTensors, so that import is skipped; the
    # comparison itself is unchanged.
    torch.testing._comparison._HAS_DTENSOR = False
    # A short timeout turns a rank stuck in a collective into an exception (reported) instead of a hung test session.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    conn.send(("ready", None))
    try:
        while True:
            _failed = False
            try:
                if (job := conn.recv()) is None:  # unpickling imports the job's test module: that may raise too
                    break
                group = dist.new_group(list(range(world)))  # an explicit group, the way the topology hands one over
                report = job(group, rank, world)
                conn.send(("failed" if _failed else "report", report))
            except BaseException:  # noqa: BLE001 - whatever a job raises is the test's message
                conn.send(("raised", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # A rank holds nothing that needs the interpreter's finalization, which costs a second or more per rank with
    # torch loaded (several ranks on few cores end the session seconds later): flush what it printed and end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_context() -> Any:
    """How ranks start: forked from one server process that imported, once for the session, what every rank imports
    anyway (torch: 1.5-2 s of CPU per process; symbolic_shapes, which the first backward given a gradient imports,
    with sympy; deepspeed and the model's layers: 1 s and more), instead of every rank importing it (a session starts
    eight ranks or more on two cores).  The server does nothing but fork, so no rank inherits a process group or
    the test process's state, as with spawn; it is started with the first pool, with the environment the test
    process has then."""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "deepspeed"]
    ctx.set_forkserver_preload([*preload, "ds_megatron.pipeline_parallel.module", __name__])
    return ctx


def start_fork_server() -> None:
    """Start the ranks' fork server now, in the background: its imports then run while the caller does other work
    (the test session's collection leaves one core idle) instead of when the first pool waits for it."""
    _start_context()
    multiprocessing.forkserver.ensure_running()


class _Pool:
    """``world`` ranks in one gloo group, kept for the test session: the ranks start and import the test modules
    once, instead of once per check."""

    def __init__(self, world: int):
        global _forked
        ctx = _start_context()
        _forked = True
        self.world = world
        self.dir = tempfile.mkdtemp(prefix=f"inprocess-world{world}-")
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_pool_worker, args=(rank, world, f"{self.dir}/init", theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        started = self._answers({}, START_TIMEOUT_S)
        if any(kind != "ready" for kind, _ in started):
            self.close(kill=True)
            raise RuntimeError(f"the pool of {world} ranks did not start: {started}")

    def run(self, run_rank: Callable[[ProcessGroup, int, int], dict[str, str]]) -> list[tuple[str, Any]]:
        """Every rank's (kind, answer): ("report" or "failed" (a check failed), report), ("raised", traceback) or
        ("lost", why)."""
        answers: dict[int, tuple[str, Any]] = {}
        for r, conn in enumerate(self.conns):
            try:
                conn.send(run_rank)
            except OSError:  # BrokenPipeError: the rank is gone
                answers[r] = ("lost", f"the process ended (exit code {self.procs[r].exitcode})")
        return self._answers(answers, JOB_TIMEOUT_S)

    def _answers(self, answers: dict[int, tuple[str, Any]], timeout: float) -> list[tuple[str, Any]]:
        """Each rank's next message (those in ``answers`` are known), or why none came within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while len(answers) < self.world:
            waiting = {r: (self.conns[r], self.procs[r].sentinel) for r in range(self.world) if r not in answers}
            left = deadline - time.monotonic()
            ready = wait([h for pair in waiting.values() for h in pair], timeout=max(left, 0))
            if not ready:
                for r in waiting:
                    answers[r] = ("lost", f"no answer within {timeout} s")
            for r, (conn, sentinel) in waiting.items():
                if conn in ready or (sentinel in ready and conn.poll()):
                    try:
                        answers[r] = conn.recv()
                    except EOFError:
                        answers[r] = ("lost", f"the process ended (exit code {self.procs[r].exitcode})")
                elif sentinel in ready:
                    answers[r] = ("lost", f"the process ended (exit code {self.procs[r].exitcode})")
        return [answers[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: asked to leave the group, or killed (``kill``: some rank may be stuck in a job)."""
        for conn in self.conns:  # every rank is told first, so that they leave together
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}
_forked = False  # whether this session forked ranks at all
KEPT = ("report", "failed")  # answers that carry a report


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
    # The fork server is this process's child and the ranks were its children: waiting for it here counts their CPU
    # time in this process's children's (where a timing of the session reads it), as with spawned ranks.  A server
    # that forked nothing is left to end by itself (it ends when this process does, once its imports are done).
    if _forked:
        with contextlib.suppress(AttributeError, OSError):
            multiprocessing.forkserver._forkserver._stop()


def spawn_reports(
    run_rank: Callable[[ProcessGroup | None, int, int], dict[str, str]], world: int
) -> list[dict[str, str]]:
    """Every rank's report of ``run_rank(group, rank, world)`` (a module-level function or a ``functools.partial`` of
    one, so that it pickles).  A group of one runs here; larger groups run on the session's pool of ``world`` spawned
    ranks.  A rank that raises, dies or does not answer fails the caller with every rank's message, and the pool is
    replaced; so is it after any failed check, so that no rank left behind in a collective meets the next job."""
    if world == 1:  # a group of one is None and needs no processes: run here
        return [run_rank(None, 0, 1)]
    pool = _POOLS.get(world) or _POOLS.setdefault(world, _Pool(world))
    answers = pool.run(run_rank)
    broken = [f"rank {r} {kind}:\n{answer}" for r, (kind, answer) in enumerate(answers) if kind not in KEPT]
    if broken or any(kind != "report" for kind, _ in answers):
        _POOLS.pop(world).close(kill=bool(broken))
    if broken:
        raise RuntimeError(f"{getattr(run_rank, '__name__', run_rank)} at world {world}:\n" + "\n".join(broken))
    return [answer for _, answer in answers]


def failures(reports: list[dict[str, str]], name: str, label: str) -> str:
    """The failure message of check ``name`` over all ranks' reports ("" when every rank passed)."""
    bad = {r: rep.get(name, "did not run") for r, rep in enumerate(reports) if rep.get(name) != "ok"}
    return "\n".join(f"{label} rank {r}: {msg}" for r, msg in bad.items())
