"""The in-process tier's harness: spawn a gloo group of ``world`` processes (a group of one runs in the test
process, as the topology hands over ``None``), run named checks on every rank and report per check.

A check returns (what, actual, expected[, tolerance]) tuples; they are compared only after all of the check's
collectives ran, so a mismatch on one rank never leaves the others waiting in a collective.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed import ProcessGroup

Pair = tuple[str, Tensor | None, Tensor] | tuple[str, Tensor | None, Tensor, float]
Pairs = list[Pair]  # (what, sharded result, reference[, atol = rtol]), compared after all collectives
TOLERANCE = 1e-5


def run_checks(checks: dict[str, Callable[[Any], Pairs]], ctx: Any) -> dict[str, str]:
    """Run every check on this rank; "ok" or the failures per check."""
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
    return report


def _worker(rank: int, world: int, tmp: str, run_rank: Callable[[ProcessGroup, int, int], dict[str, str]]) -> None:
    torch.set_num_threads(1)  # several ranks share few cores; intra-op threads would only oversubscribe them
    # A short timeout turns a rank stuck in a collective into a failure instead of a hung test session.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        group = dist.new_group(list(range(world)))  # an explicit group, the way the topology hands one over
        report = run_rank(group, rank, world)
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(report))


def spawn_reports(
    run_rank: Callable[[ProcessGroup | None, int, int], dict[str, str]], world: int, tmp: Path
) -> list[dict[str, str]]:
    """Every rank's report of ``run_rank(group, rank, world)`` (a module-level function, so spawn can pickle it)."""
    if world == 1:  # a group of one is None and needs no processes: run here
        return [run_rank(None, 0, 1)]
    mp.spawn(_worker, args=(world, str(tmp), run_rank), nprocs=world)
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def failures(reports: list[dict[str, str]], name: str, label: str) -> str:
    """The failure message of check ``name`` over all ranks' reports ("" when every rank passed)."""
    bad = {r: rep.get(name, "did not run") for r, rep in enumerate(reports) if rep.get(name) != "ok"}
    return "\n".join(f"{label} rank {r}: {msg}" for r, msg in bad.items())
