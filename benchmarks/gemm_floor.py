"""Distance to the compute floor: one training step of each system against the time of its matmuls and attention
kernels alone, and where the rest of the step goes.

    python benchmarks/gemm_floor.py [shape flags of throughput_peers.py] [--kernel sdpa] [--markdown OUT.md]

For every system (ds_megatron at tp 1 in one process; ds_megatron, DeepSpeed AutoTP and PyTorch-native TP + SP at
tp 2 on 2 processes, as in ``throughput_peers.py``), in the process that trains it:

1. the step: median wall time of ``--steps`` training steps after two warm-up steps;
   (CPU time, the process's own, is the measure: on a shared machine wall time also counts the time other jobs
   hold the core; wall time is reported beside it, and at tp 2 its excess includes the waits in collectives);
2. the floor: every matmul (``mm``, also into ``out``, ``addmm``, ``bmm``, ``baddbmm``) and attention kernel (sdpa
   forward and backward; eager: the softmax and its backward, its matmuls being ``bmm``) that one step dispatches is
   recorded with a ``TorchDispatchMode`` (shapes, strides, dtypes and the other arguments exactly), and the same
   calls are replayed back to back on random tensors of those layouts in the same process and thread count (best of
   ``--replays``): what this machine needs for the step's arithmetic alone;
3. the breakdown: the CPU time of every op one step dispatches below autograd (a ``TorchDispatchMode`` reading the
   process's CPU clock around each call: torch.profiler's times are wall times, which a loaded machine inflates
   at random), grouped into matmuls, attention, collectives, copies and casts, other aten ops (elementwise
   passes, reductions, indexing, the optimizer's arithmetic), DTensor operations (timed whole) and the rest of the
   step's CPU time, outside any op (Python, autograd and dispatch overhead, DeepSpeed's engine).

A dispatch mode sees DTensor operations with their global shapes, above the local matmuls that DTensor runs, so the
PyTorch-native peer's floor is taken from AutoTP's recorded step: the same transformers modules split the same way
(q/k/v/gate/up by output columns, o/down by input rows), the same local matmul shapes; the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402
from throughput_peers import SYSTEMS, VARIANTS, Variant, parse_args  # noqa: E402
from throughput_vs_autotp import _port, batches, ds_megatron_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
MATMUL = {aten.mm.default, aten.mm.out, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._softmax.default,
    aten._softmax_backward_data.default,
}
TOP_OPS = 25  # the breakdown's per-op list: this many ops (by name, dtype and first input's shape), largest first
COPIES = {aten.copy_.default, aten._to_copy.default, aten.clone.default}
GROUPS = (
    "matmuls",
    "attention",
    "collectives",
    "copies and casts",
    "other aten ops",
    "DTensor ops",
    "outside aten ops",
)


class Spec:
    """A tensor argument's layout, to rebuild it on random data."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype

    def build(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        return t.normal_() if self.dtype.is_floating_point else t.zero_()


class RecordCompute(TorchDispatchMode):
    """Records every matmul and attention call on plain tensors: (op, args with tensors as ``Spec``, kwargs)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self.skipped = 0  # calls on tensor subclasses (DTensor): their local matmuls are not visible here

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMUL or func in ATTENTION:
            flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if all(type(a) is torch.Tensor or isinstance(a, torch.nn.Parameter) for a in flat):
                spec = lambda a: Spec(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
                self.calls.append((func, [spec(a) for a in args], {k: spec(v) for k, v in kwargs.items()}))
            else:
                self.skipped += 1
        return func(*args, **kwargs)


def replay(calls: list, repeats: int) -> tuple[float, float]:
    """Best (CPU, wall) seconds of running ``calls`` back to back on random tensors of the recorded layouts."""
    build = lambda a: a.build() if isinstance(a, Spec) else a  # noqa: E731
    ready = [(f, [build(a) for a in args], {k: build(v) for k, v in kw.items()}) for f, args, kw in calls]
    best_cpu = best_wall = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass warms the kernels' caches
            wall, cpu = time.perf_counter(), time.process_time()
            for f, args, kw in ready:
                f(*args, **kw)
            best_cpu = min(best_cpu, time.process_time() - cpu)
            best_wall = min(best_wall, time.perf_counter() - wall)
    return best_cpu, best_wall


def gemm_flops(calls: list) -> float:
    """2 m n k per matmul (the attention kernels' FLOPs are not counted here)."""
    total = 0.0
    for f, args, _ in calls:
        if f in (aten.mm.default, aten.mm.out, aten.bmm.default):
            a, b = args[0], args[1]
        elif f in (aten.addmm.default, aten.baddbmm.default):
            a, b = args[1], args[2]
        else:
            continue
        batch = a.shape[0] if len(a.shape) == 3 else 1
        total += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return total


class TimeOps(TorchDispatchMode):
    """CPU seconds (the process's own, which other jobs on a shared machine do not inflate) per group of ops that
    reach the dispatcher below autograd; a DTensor operation is timed whole (its local kernels, its redistribution
    and its Python) and counted as "DTensor ops"."""

    def __init__(self):
        super().__init__()
        self.seconds = dict.fromkeys(GROUPS, 0.0)
        self.ops: dict[str, list] = {}  # "op dtype shape" -> [CPU seconds, calls, group]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        seconds = time.process_time() - start
        group = self.group(func, types)
        self.seconds[group] += seconds
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        where = "" if first is None else f" {str(first.dtype).removeprefix('torch.')} {list(first.shape)}"
        entry = self.ops.setdefault(f"{func.name().removeprefix('aten::')}{where}", [0.0, 0, group])
        entry[0] += seconds
        entry[1] += 1
        return out

    @staticmethod
    def group(func, types) -> str:
        if func.namespace in ("c10d", "_c10d_functional"):
            return "collectives"
        if any(t.__name__ == "DTensor" for t in types):
            return "DTensor ops"
        if func in MATMUL:
            return "matmuls"
        if func in ATTENTION:
            return "attention"
        if func in COPIES:
            return "copies and casts"
        return "other aten ops"


def breakdown(step) -> tuple[dict[str, float], float, float, list]:
    """CPU seconds per group over one step, the step's CPU time, its wall time and its largest ops; "outside aten
    ops" is the CPU time not inside any op (Python, autograd, DeepSpeed's engine, and this mode's own bookkeeping)."""
    mode = TimeOps()
    wall, cpu = time.perf_counter(), time.process_time()
    with mode:
        step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    mode.seconds["outside aten ops"] = max(0.0, cpu - sum(mode.seconds.values()))
    top = sorted(([k, *v] for k, v in mode.ops.items()), key=lambda e: -e[1])[:TOP_OPS]
    return mode.seconds, cpu, wall, top


def measure(variant_name: str, args, tp1: bool = False) -> dict:
    """Step time, floor and breakdown of one system, in this process (CPU and wall seconds)."""
    import torch.distributed as dist

    variant = single_process_variant(args) if tp1 else Variant(variant_name, args)
    data = batches(args, 3 + args.steps)
    barrier = dist.barrier if dist.get_world_size() > 1 else (lambda: None)
    compiling = compile_seconds()
    warm = time.perf_counter()
    for x, y in data[:2]:
        variant.train_step(x, y)
    warm, compiling = time.perf_counter() - warm, compile_seconds() - compiling
    graphs_after_warmup = unique_graphs()
    recorder = RecordCompute()
    with recorder:
        variant.train_step(*data[2])
    wall, cpu = [], []
    for x, y in data[3:]:
        barrier()
        w, c = time.perf_counter(), time.process_time()
        variant.train_step(x, y)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    barrier()
    groups, step_cpu, step_wall, top_ops = breakdown(lambda: variant.train_step(*data[0]))
    barrier()
    floor_cpu, floor_wall = replay(recorder.calls, args.replays)
    return {
        "step_cpu": statistics.median(cpu),
        "step_wall": statistics.median(wall),
        "floor_cpu": floor_cpu,
        "floor_wall": floor_wall,
        "calls": len(recorder.calls),
        "skipped": recorder.skipped,
        "gemm_flops": gemm_flops(recorder.calls),
        "groups": groups,
        "top_ops": top_ops,
        "breakdown_cpu": step_cpu,
        "breakdown_wall": step_wall,
        "compile_s": compiling,
        "warmup_wall": warm,
        "graphs_after_warmup": graphs_after_warmup,
        "graphs_at_end": unique_graphs(),
    }


def compile_seconds() -> float:
    """Seconds dynamo and inductor spent compiling in this process so far (dynamo's own timer)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(t) for name, t in compilation_time_metrics.items() if name.endswith("compile_inner"))


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def single_process_variant(args):
    """ds_megatron at tp 1, pp 1 in this process (its pipeline engine, no SP), the same model and kernel."""
    from ds_megatron.config import resolve
    from ds_megatron.engine import build_engine

    config = ds_megatron_config(args, "none", args.kernel)
    config["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1, "sequence_parallel": False}
    engine = build_engine(resolve(config, 1)).engine

    class One:
        pass

    one = One()
    one.train_step = lambda x, y: float(engine.train_batch(iter([(x, y)])))
    return one


def worker(args) -> None:
    import torch.distributed as dist

    from ds_megatron.engine import init_distributed

    init_distributed()
    rank = dist.get_rank()
    results = {}
    if args.compile_ab:  # ds_megatron alone, model.compile off then on, in this process
        for args.compile in (False, True):
            suffix = COMPILED if args.compile else ""
            if dist.get_world_size() == 1:
                results["dsm-tp1" + suffix] = measure("", args, tp1=True)
            else:
                results[f"dsm-{args.kernel}-none{suffix}"] = measure(f"dsm-{args.kernel}-none", args)
    elif dist.get_world_size() == 1:
        results["dsm-tp1"] = measure("", args, tp1=True)
    else:
        k = args.kernel
        for name in (f"dsm-{k}-none", f"autotp-{k}-none", f"torch-{k}-none"):
            results[name] = measure(name, args)
        # DTensor hides the local matmuls from a dispatch mode: replay AutoTP's (same modules, same splits).
        for key in ("floor_cpu", "floor_wall"):
            results[f"torch-{k}-none"][key] = results[f"autotp-{k}-none"][key]
        results[f"torch-{k}-none"]["gemm_flops"] = results[f"autotp-{k}-none"]["gemm_flops"]
        results[f"torch-{k}-none"]["floor_from"] = "AutoTP's recorded calls"
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))


def launch(args, world: int, out: Path) -> list[dict]:
    script = [__file__, "--worker", "--out", str(out), "--kernel", args.kernel]
    script += ["--compile-ab"] if args.compile_ab else []
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "batch", "vocab", "steps", "replays"):
        script += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    if world == 1:
        port = str(_port())
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, *script]
    else:
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        cmd = [deepspeed, "--num_gpus", str(world), "--master_port", str(_port()), *script]
    timeout = 3600 if args.compile_ab else 900  # two engines per process, and compiling, on a shared CPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"world {world} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


COMPILED = "-compiled"  # a result's name suffix: the same system with model.compile on


def label(name: str) -> str:
    compiled = ", model.compile on" if name.endswith(COMPILED) else ""
    name = name.removesuffix(COMPILED)
    if name == "dsm-tp1":
        return f"ds_megatron, tp 1, 1 process{compiled}"
    system, _, _ = VARIANTS[name]
    return f"{SYSTEMS[system]}, tp 2, 2 processes{compiled}"


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| system | step CPU ms (median) | floor CPU ms: matmuls + attention alone | floor / step | **step / floor** "
        "| step wall ms | floor wall ms | matmul + attention calls per step | matmul GFLOP per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        step, floor = max(r["step_cpu"] for r in ranks), max(r["floor_cpu"] for r in ranks)
        note = " (AutoTP's calls)" if "floor_from" in ranks[0] else ""
        calls = "-" if note else f"{ranks[0]['calls']}"
        lines.append(
            f"| {label(name)} | {step * 1e3:,.0f} | {floor * 1e3:,.0f}{note} | {floor / step:.2f} | "
            f"**{step / floor:.2f}** | {max(r['step_wall'] for r in ranks) * 1e3:,.0f} | "
            f"{max(r['floor_wall'] for r in ranks) * 1e3:,.0f} | {calls} | {ranks[0]['gemm_flops'] / 1e9:.1f} |"
        )
    compiled = [name for name in results if name.endswith(COMPILED)]
    if compiled:
        lines += [
            "",
            "Compilation (model.compile on): dynamo's compile time in the two warm-up steps (the most over ranks), the "
            "warm-up steps' wall time, and the graphs compiled after them (recompilation: must be 0):",
            "",
            "| system | compile s | warm-up wall s (2 steps) | graphs compiled in warm-up | graphs compiled after |",
            "|---|---|---|---|---|",
        ]
        for name in compiled:
            ranks = results[name]
            before = results.get(name.removesuffix(COMPILED), [{"graphs_at_end": 0}])[0]["graphs_at_end"]
            r = ranks[0]
            lines.append(
                f"| {label(name)} | {max(x['compile_s'] for x in ranks):.1f} | "
                f"{max(x['warmup_wall'] for x in ranks):.1f} | {r['graphs_after_warmup'] - before} | "
                f"{r['graphs_at_end'] - r['graphs_after_warmup']} |"
            )
    lines += [
        "",
        "Where one step's CPU time goes (rank 0, ms and share of that step's CPU time; per op, timed by a dispatch "
        "mode with the process's CPU clock; the step's wall time beside it, whose excess over CPU time is waiting: "
        "for the other rank in collectives, or for a core on this shared machine"
        + (
            "; a TorchDispatchMode runs no compiled code, so the rows with model.compile on are left out"
            if compiled
            else ""
        )
        + "):",
        "",
        "| system | " + " | ".join(GROUPS) + " | step CPU | step wall |",
        "|---|" + "---|" * (len(GROUPS) + 2),
    ]
    for name, ranks in results.items():
        if name.endswith(COMPILED):
            continue
        g, total = ranks[0]["groups"], ranks[0]["breakdown_cpu"]
        cells = " | ".join(f"{g[k] * 1e3:,.0f} ({g[k] / total:.0%})" for k in GROUPS)
        lines.append(f"| {label(name)} | {cells} | {total * 1e3:,.0f} | {ranks[0]['breakdown_wall'] * 1e3:,.0f} |")
    for name, ranks in results.items():
        if name.endswith(COMPILED) or not ranks[0].get("top_ops"):
            continue
        total = ranks[0]["breakdown_cpu"]
        lines += [
            "",
            f"Largest ops of one step, {label(name)} (rank 0; op, dtype and first input's shape; CPU ms):",
            "",
            "| op | group | calls | CPU ms | share of step |",
            "|---|---|---|---|---|",
        ]
        for op, seconds, calls, group in ranks[0]["top_ops"]:
            lines.append(f"| `{op}` | {group} | {calls} | {seconds * 1e3:,.1f} | {seconds / total:.1%} |")
    return "\n".join(lines)


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--kernel", default="sdpa", choices=("sdpa", "eager"))
    extra.add_argument("--replays", type=int, default=3)
    extra.add_argument("--only-tp1", action="store_true")
    extra.add_argument("--compile-ab", action="store_true", help="ds_megatron only, model.compile off and on")
    extra.add_argument("--raw-json", help="also write every rank's measurements to this JSON file")
    known, rest = extra.parse_known_args()
    args = parse_args(rest)
    args.kernel, args.replays, args.compile_ab = known.kernel, known.replays, known.compile_ab
    if args.worker:
        worker(args)
        return
    out = Path(tempfile.mkdtemp(prefix="gemm_floor_"))
    load_start = os.getloadavg()
    results = {name: [result] for name, result in launch(args, 1, out)[0].items()}  # with --compile-ab: two
    if not known.only_tp1:
        ranks = launch(args, 2, out)
        results.update({name: [r[name] for r in ranks] for name in ranks[0]})
    load_end = os.getloadavg()
    if known.raw_json:
        Path(known.raw_json).write_text(json.dumps({"load": [load_start, load_end], "results": results}, indent=1))
    body = (
        f"Llama, {args.layers} layers, h {args.hidden}, {args.heads} heads ({args.kv_heads} KV heads), SwiGLU "
        f"{args.ffn}, V {args.vocab} (untied), s {args.seq}, micro-batch {args.batch}; {args.kernel} attention, "
        f"no recompute, bf16 weights + fp32 masters, AdamW, clipping 1.0; one thread per process "
        f"(OMP_NUM_THREADS=1), gloo; step = median of {args.steps} steps after 2 warm-up, floor = best of "
        f"{args.replays} replays, both in CPU time unless labelled wall.  The machine was shared: load average "
        f"(1/5/15 min) "
        f"{'/'.join(f'{v:.1f}' for v in load_start)} at the start, {'/'.join(f'{v:.1f}' for v in load_end)} at "
        f"the end, on {os.cpu_count()} cores.\n\n{table(results)}"
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Distance to the compute floor: training step against its matmuls and attention alone",
            "python benchmarks/gemm_floor.py",
            body,
        )


if __name__ == "__main__":
    main()
