"""Run several worker scripts of this folder one after the other in one launch:
``several.py --run "parity.py --out D --layouts 2,2,1" --run "collectives.py --out E"`` (a script is named relative to
this folder, or by its absolute path).  With ``--done DIR``, rank 0 writes ``DIR/<i>.done`` when the i-th run (from 0)
has returned on every rank, so a caller can tell which runs finished when the launch failed; the marker holds the
run and its wall seconds on rank 0 (``tests/launch.py`` logs them with the launch).

One launch instead of one per worker: the launcher, the imports and the process group are paid once.  Each worker
runs as its own ``__main__`` with its own argv and builds its own engine (every build seeds all generators from its
config, so a worker computes what it computes alone).  A worker that raises ends the launch (the other ranks may wait
in one of its collectives); the ones before it have written their results.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="a worker script of this folder and its arguments")
    ap.add_argument("--done", help="a folder for the runs' completion markers")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    _reuse_groups()
    for i, run in enumerate(args.run):
        start = time.monotonic()
        script, *argv = shlex.split(run)
        path = HERE / script  # an absolute ``script`` stays itself
        sys.argv = [str(path), *argv, f"--local_rank={args.local_rank}"]
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as done:
            if done.code not in (None, 0):
                print(f"{run}: exit status {done.code}", file=sys.stderr, flush=True)
                return 1
        if args.done:
            _all_returned()
            if os.environ.get("RANK", "0") == "0":
                marker = {"run": run, "seconds": round(time.monotonic() - start, 1)}
                (Path(args.done) / f"{i}.done").write_text(json.dumps(marker))
    return 0


def _reuse_groups() -> None:
    """Process groups reused from one engine to the next.  Every engine a run builds asks DeepSpeed's topology and
    ds_megatron for its groups again (tp, dp, the pipeline's pairs, cp, ep), and a gloo group keeps its threads (a
    tcp loop and two run loops) for the life of the process: the launches' few hundred engines made about 500 groups
    per process, 1,500 threads, with a few hundred tcp loops runnable at once on 2 cores.  So inside one
    ``build_engine`` the n-th request for a rank list gets the n-th group made for that list by any build (made on
    first need): two groups of one engine stay two objects even with the same ranks (a run that tells its expert-DP
    group from its DP group by identity still can), and the next engine takes them over.  Every rank calls
    ``new_group`` for the same lists in the same order (torch requires it), so every rank reuses alike; the runs are
    sequential, so no two engines use a group at once.  A call with options beyond the ranks, timeout and backend
    makes its own group."""
    import torch.distributed as dist

    import ds_megatron.engine

    made: dict[tuple, list] = {}
    seen: dict[tuple, int] = {}
    new_group, build_engine = dist.new_group, ds_megatron.engine.build_engine

    def reused(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        if pg_options is not None or args or kwargs:
            return new_group(ranks, timeout, backend, pg_options, *args, **kwargs)
        key = (None if ranks is None else tuple(sorted(ranks)), timeout, backend)
        n = seen[key] = seen.get(key, -1) + 1
        groups = made.setdefault(key, [])
        if n == len(groups):
            groups.append(new_group(ranks=ranks, timeout=timeout, backend=backend))
        return groups[n]

    def build(*args, **kwargs):
        seen.clear()
        return build_engine(*args, **kwargs)

    dist.new_group = reused
    ds_megatron.engine.build_engine = build


def _all_returned() -> None:
    """Wait until every rank has returned from the run (a rank that failed never arrives, and the launch ends)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
