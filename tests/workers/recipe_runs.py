"""Run the training recipe several times in one launch: ``recipe_runs.py --plan PLAN.json``, where the plan is a
JSON list of {"name": ..., "status_dir": ..., "argv": [...]} and each argv is what ``recipes/train_gpt.py`` would get.
With ``"output": true`` in an item, each rank also copies what that run prints (``sys.stdout`` and ``sys.stderr``)
to ``<status_dir>/<name>.rank<R>.out``: a test can then read one run's messages apart from the others'.  With
``"plot": false`` the run draws no ``loss.png`` at its end (``Trainer.plot`` does nothing for it): the figure (and
importing matplotlib for it) is rank 0's work alone, which the other ranks wait for in the run's last barrier, and
the tests of such runs read the metrics, not the picture (the demo run of tests/launcher/test_recipe.py and
tests/unit/test_plot.py test the figure).

One launch per process count instead of one per run: the launcher, the imports and the process group are paid once.
Each run builds its own topology, engine and data and ends before the next starts.  Each run's exit status is
recorded (``<name>.status.json`` by rank 0, with the run's wall seconds); a non-zero status (every rank returns the
same) lets the next run start, but an exception ends the launch (rank 0 records it first): the other ranks may be
waiting in a collective of the failed run, and the launcher stops them all.  With ``--exit-zero`` the launch exits
0 once every run returned, whatever their statuses (they are in the status files): for a launch shared with other
workers that must still run (``workers/several.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from ds_megatron.cli.train import main as train_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--exit-zero", action="store_true", help="exit 0 when every run returned (see the docstring)")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    failed = 0
    for item in plan:
        out = Path(item["status_dir"]) / f"{item['name']}.status.json"
        copy = out.with_name(f"{item['name']}.rank{os.environ.get('RANK', '0')}.out") if item.get("output") else None
        start = time.monotonic()
        try:
            with _copied_output(copy), _plotting(item.get("plot", True)):
                status = train_main(item["argv"])
        except Exception:
            if os.environ.get("RANK", "0") == "0":
                out.write_text(json.dumps({"status": 1, "error": traceback.format_exc()}))
            raise
        failed += status != 0
        if os.environ.get("RANK", "0") == "0":
            seconds = round(time.monotonic() - start, 1)
            error = f"exit status {status}" if status else None
            out.write_text(json.dumps({"status": status, "error": error, "seconds": seconds}))
    return 0 if failed == 0 or args.exit_zero else 1


class _Tee:
    """A text stream that writes to ``stream`` and to ``copy``."""

    def __init__(self, stream, copy):
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.copy.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _plotting(plot: bool):
    """The run as the recipe runs it, or (``plot`` false) with ``Trainer.plot`` doing nothing while it runs."""
    if plot:
        yield
        return
    from ds_megatron.trainer import Trainer

    draw = Trainer.plot
    Trainer.plot = lambda self: None
    try:
        yield
    finally:
        Trainer.plot = draw


@contextlib.contextmanager
def _copied_output(path: Path | None):
    if path is None:
        yield
        return
    with open(path, "w") as copy:
        with contextlib.redirect_stdout(_Tee(sys.stdout, copy)), contextlib.redirect_stderr(_Tee(sys.stderr, copy)):
            yield


if __name__ == "__main__":
    sys.exit(main())
