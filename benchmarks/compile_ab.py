"""model.compile off against on, alternating steps of two engines in one process (CPU time per step).

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29741 OMP_NUM_THREADS=1 \
        python benchmarks/compile_ab.py [shape flags of throughput_peers.py, e.g. --seq 512]

ds_megatron at tp 1 (``gemm_floor.single_process_variant``: its pipeline engine, the gemm_floor Llama), built twice,
two warm-up steps each (compiling happens there), then ``--steps`` steps of each in alternating order, so that a
shared machine's drift falls on both alike.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gemm_floor  # noqa: E402
from throughput_peers import parse_args  # noqa: E402
from throughput_vs_autotp import batches  # noqa: E402

from ds_megatron.engine import init_distributed  # noqa: E402


def main() -> None:
    init_distributed()
    args = parse_args(sys.argv[1:])
    args.kernel = "sdpa"
    engines = {}
    for args.compile in (False, True):
        engines[args.compile] = gemm_floor.single_process_variant(args)
    data = batches(args, 2 + args.steps)
    for compiled in (False, True):
        for x, y in data[:2]:
            engines[compiled].train_step(x, y)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i, (x, y) in enumerate(data[2:]):
        for compiled in (False, True) if i % 2 == 0 else (True, False):
            start = time.process_time()
            engines[compiled].train_step(x, y)
            times[compiled].append(time.process_time() - start)
    print("off CPU s:", [round(t, 2) for t in times[False]])
    print("on CPU s: ", [round(t, 2) for t in times[True]])
    print("off / on: ", [round(a / b, 3) for a, b in zip(times[False], times[True])])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"medians: off {off:.2f} s, on {on:.2f} s; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
