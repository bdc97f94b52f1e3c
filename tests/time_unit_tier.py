"""Time the unit tier (what ``make test-fast`` runs) and write the result as markdown: the date, the machine, the load
average before and after, wall and CPU time (this process's children: pytest and the ranks it spawns) and pytest's
30 slowest durations.  The CPU time moves less with the machine's load than the wall time does.

    python tests/time_unit_tier.py [--out tests/unit_tier_time.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "tests" / "unit_tier_time.md"), help="the markdown file written")
    args = p.parse_args()
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/unit", "--durations=30", "-p", "no:cacheprovider"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    load_before = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    load_after = os.getloadavg()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = proc.stdout.splitlines()
    durations = out[next((i for i, line in enumerate(out) if "slowest 30 durations" in line), len(out)) :]
    text = "\n".join(
        [
            "# The unit tier's time",
            "",
            f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, "
            f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            f"- command: `OMP_NUM_THREADS=1 {' '.join(['python', *cmd[1:]])}` (exit status {proc.returncode})",
            f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
            f"after: {', '.join(f'{x:.2f}' for x in load_after)}",
            f"- wall {wall:.1f} s; CPU {usage.ru_utime:.1f} s user + {usage.ru_stime:.1f} s system",
            "",
            "```",
            *durations,
            "```",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
