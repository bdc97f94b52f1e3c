"""The tuner's empirical mode with fake launches and a fake clock, for scripts/tune_golden.sh: every console line,
JSON and written config of five sessions (measured, failed, out of memory, timed out, not run for the budget, GPU
and CPU), the probe's configs, its failure reasons and metrics parsing, and the calibration fits.  Deterministic:
a refactoring of ds_megatron/tune must leave the output byte-identical.   python scripts/tune_golden_empirical.py OUT
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
import time
from pathlib import Path

from ds_megatron.tune import Cluster, Measurement, build_model_shape, fit_time_model, search
from ds_megatron.tune import __main__ as cli
from ds_megatron.tune.core import launch, session
from ds_megatron.tune.core.spec import Candidate
from ds_megatron.tune.training import empirical, probe
from ds_megatron.tune.training.empirical_report import format_empirical

OUT = Path(sys.argv[1])
CLOCK = [1000.0]
time.monotonic = lambda: CLOCK[0]  # noqa: E731  every budget decision reads this clock
# (status, duration in s, measured/predicted factor) per launch index; a missing index runs ok
PLANS: dict[int, tuple[str, float, float]] = {}


def fake_probe(result, e, index, options, timeout_s):
    status, duration, factor = PLANS.get(index, ("ok", 20.0 + index, 1.2 + 0.15 * index))
    duration = min(duration, timeout_s)
    CLOCK[0] += duration
    run_dir = str(Path(options.work_dir) / probe.run_slug(index, e))
    cmd = ["deepspeed", "--num_gpus", str(result.cluster.num_gpus), "recipes/train_gpt.py"]
    if status == "ok":
        times = [e.time.step_s * factor * (1 + 0.01 * k) for k in range(options.steps)]
        return probe.ProbeResult("ok", None, times[len(times) // 2], times, 1.25 * index, duration, run_dir, cmd, 0)
    reason = {"failed": "exit 1: RuntimeError: boom", "out of memory": "out of memory (exit 1): CUDA out of memory"}
    if status == "timeout":
        return probe.ProbeResult("timeout", f"timeout after {timeout_s:.0f} s", None, [], None, duration, run_dir, cmd)
    return probe.ProbeResult(status, reason[status], None, [], None, duration, run_dir, cmd, 1)


empirical.probe = fake_probe
empirical.resolve_device = lambda device, num_gpus: "cpu" if device == "auto" else device  # no torch asked
TINY = ["--model", "gpt-tiny", "--vocab", "1024", "--seq-length", "128", "--global-batch-size", "16", "--gpus", "4"]
TINY += ["--gpus-per-node", "4", "--gpu-memory-gb", "3", "--gpu-peak-tflops", "0.05", "--device", "cpu"]
SESSIONS = {
    "mixed": (["--empirical-top", "5", "--max-minutes", "10"], {2: ("failed", 5, 0), 3: ("out of memory", 8, 0)}),
    "budget": (["--empirical-top", "6", "--max-minutes", "2"], {1: ("ok", 40, 1.2), 2: ("ok", 45, 1.4)}),
    "timeout": (["--empirical-top", "3", "--max-minutes", "6", "--empirical-steps", "4"], {1: ("timeout", 500, 0)}),
    "all_failed": (["--empirical-top", "2", "--max-minutes", "5"], {1: ("failed", 5, 0), 2: ("failed", 5, 0)}),
    "one": (["--empirical-top", "1", "--max-minutes", "5", "--empirical-warmup", "0"], {}),
}
for name, (extra, plans) in SESSIONS.items():
    CLOCK[0], PLANS = 1000.0, plans
    d = OUT / f"empirical-{name}"
    d.mkdir(parents=True)
    argv = [*TINY, "--empirical", "--empirical-dir", "runs", *extra, "--json", str(d / "out.json")]
    argv += ["--write-config", str(d / "cfg.json"), "--top", "4"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(argv)
    text = stdout.getvalue().replace(str(d), "D")
    (d / "stdout").write_text(__import__("re").sub(r"candidates in [0-9.]+ s:", "candidates in X s:", text))
    (d / "stderr").write_text(stderr.getvalue())
    (d / "rc").write_text(f"{rc}\n")
    data = json.loads((d / "out.json").read_text())
    data["search_seconds"] = "X"
    (d / "out.json").write_text(json.dumps(data, indent=1))

# The GPU path through the API (no GPU needed: the device is resolved by hand).
model = build_model_shape("llama3.2-1b", None, None, None, None, 2048)
cluster = Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=989, memory_gbps=3350)
result = search(model, cluster, 64)
CLOCK[0], PLANS = 1000.0, {2: ("out of memory", 30, 0)}
options = probe.EmpiricalOptions(max_minutes=20, top=4, device="gpu", work_dir="runs")
emp = empirical.run_empirical(result, options, deadline=1000.0 + 1200, say=lambda s: None)
lines = [format_empirical(emp, 64, 2048, top=6), json.dumps(emp.as_dict(top=6), indent=1)]
for i, e in enumerate(result.ranked[:3]):
    cfg = probe.probe_config(result, e, dataclasses.replace(options, extra_sets=("a.b=1",)), Path("runs/x"))
    cpu = probe.probe_config(result, e, dataclasses.replace(options, device="cpu"), Path("runs/y"))
    lines += [probe.run_slug(i + 1, e), json.dumps(cfg, indent=1), json.dumps(cpu, indent=1)]
lines.append(repr(probe.split_sets(dataclasses.replace(options, extra_sets=("x=1", "ds_megatron.data.cache_dir=/c")))))
for e in result.ranked[:8]:
    lines.append(repr([probe.run_slug(3, e), empirical.top_candidates(result.ranked, 5, "cpu").count(e)]))
for rc, log in (
    (None, ""),
    (1, "x\nRuntimeError: CUDA out of memory. Tried"),
    (-9, "killed"),
    (1, "error: a: b"),
    (1, "Traceback\nValueError: bad"),
    (2, "[launch.py:1] error x\nsome error here"),
    (3, ""),
    (1, "y" * 400 + " error"),
):
    lines.append(repr(launch.failure_reason(rc, log, 12.0)))
for args in ((100, 3, []), (5, 1, []), (300, 3, [40.0]), (50, 2, [40.0, 60.0]), (1000, 1, [10.0]), (20, 4, [25.0])):
    lines.append(repr(session.plan_timeout(*args)))
lines.append(
    repr(
        [
            session.spearman(x, y)
            for x, y in (([1, 2, 3], [3, 2, 1]), ([1, 1], [1, 2]), ([1, 2, 2, 4], [2, 1, 3, 3]), ([1], [1]))
        ]
    )
)
metrics = OUT / "metrics.jsonl"
metrics.write_text(
    '{"step": 1, "step_ms": 900}\n{"step": 2, "step_ms": 500, "peak_mem_gb": 1.5}\n{"cut\n'
    '{"step": 3, "step_ms": 700, "peak_mem_gb": 2.5}\n{"step": 3, "val_loss": 1}\n'
)
lines.append(repr(probe.read_metrics(metrics, 1)))
metrics.unlink()

# Calibration fits: a known truth recovered with each set of terms, and the refusals.
tiny = build_model_shape("gpt-tiny", None, None, None, 1024, 128)
cpu4 = Cluster(num_gpus=4, gpus_per_node=4, gpu_memory_gb=3, peak_tflops=0.05)
found = search(tiny, cpu4, 16).ranked[:12]
truth = dataclasses.replace(cpu4, efficiency=0.31, intra_node_latency_s=0.004, step_overhead_s=0.2)
from ds_megatron.tune import step_time  # noqa: E402

for n, terms, noise in (
    (12, ("latency", "overhead"), 0.0),
    (12, ("latency", "overhead"), 0.03),
    (3, ("latency",), 0),
    (2, (), 0.0),
    (6, ("overhead",), 0.1),
    (12, (), 0.05),
):
    meas = [
        Measurement(
            tiny, cpu4, e.candidate, 16, step_time(tiny, truth, e.candidate, 16).step_s * (1 + noise * ((i % 3) - 1))
        )
        for i, e in enumerate(found[:n])
    ]
    lines.append(repr(dataclasses.asdict(fit_time_model(meas, terms))))
for bad in (0.0, 1e-9):
    try:
        fit_time_model([Measurement(tiny, cpu4, found[0].candidate, 16, bad)])
    except ValueError as err:
        lines.append(str(err))
cand = Candidate(1, 1, 4, False, 4, 1, "selective")
lines.append(repr(dataclasses.asdict(fit_time_model([Measurement(tiny, cpu4, cand, 16, 3.0)]))))
(OUT / "empirical-api.txt").write_text("\n".join(lines) + "\n")
