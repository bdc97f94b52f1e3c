"""Run several worker scripts of this folder one after the other in one launch:
``several.py --run "parity.py --out D --layouts 2,2,1" --run "collectives.py --out E"``.

One launch instead of one per worker: the launcher, the imports and the process group are paid once.  Each worker
runs as its own ``__main__`` with its own argv and builds its own engine (every build seeds all generators from its
config, so a worker computes what it computes alone).  A worker that raises ends the launch (the other ranks may wait
in one of its collectives); the ones before it have written their results.
"""

from __future__ import annotations

import argparse
import runpy
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="a worker script of this folder and its arguments")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    for run in args.run:
        script, *argv = shlex.split(run)
        sys.argv = [str(HERE / script), *argv, f"--local_rank={args.local_rank}"]
        try:
            runpy.run_path(str(HERE / script), run_name="__main__")
        except SystemExit as done:
            if done.code not in (None, 0):
                print(f"{run}: exit status {done.code}", file=sys.stderr, flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
