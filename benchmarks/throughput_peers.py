"""Llama training at tp 2 on 2 CPU processes against its peers, at equal attention kernel and equal recompute:
ds_megatron (SP on), PyTorch-native tensor + sequence parallelism the torchtitan way (DTensor
``parallelize_module`` on transformers' ``LlamaForCausalLM``) and DeepSpeed's AutoTP training of the same model,
each with ``sdpa`` and ``eager`` attention, without recompute and with per-layer activation checkpointing.

    python benchmarks/throughput_peers.py [--layers 4 --hidden 256 --heads 8 --kv-heads 2 --ffn 704 --seq 2048
                                          --batch 1 --vocab 8192] [--warmup 1 --steps 6] [--variants a,b,...]
                                          [--no-memory | --saved-only] [--times-json RANK0.json] [--markdown OUT.md]

Every system: bf16 weights with fp32 master weights, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1 on
matrices), clipping 1.0, no dropout, untied output layer, the same initial weights (ds_megatron's, loaded into the
transformers model by name) and the same tokens; every system predicts all s tokens (labels already shifted).

The PyTorch-native peer (``TorchTP`` below), written after torchtitan's Llama plan: the embedding row-parallel
with a sequence-sharded output, q/k/v and gate/up column-parallel, o and down row-parallel with sequence-sharded
outputs, both RMSNorms and the final norm ``SequenceParallel``, the attention and MLP inputs gathered by
``PrepareModuleInput``, the output layer column-parallel with vocabulary-sharded logits and the cross entropy under
``loss_parallel``; "full" wraps every decoder layer in ``checkpoint_wrapper`` (non-reentrant).  The decoder layers
are called by a short loop here instead of ``LlamaModel.forward``, which would take the sequence-sharded embedding
output for the whole sequence (positions and causal mask of s/2 tokens); the loop passes the s global positions,
and for eager attention the s x s causal mask transformers itself builds (sdpa gets no mask and runs causal, as in
transformers).  Its fp32 masters are DTensors beside the bf16 weights: AdamW and ``clip_grad_norm_`` on them, the
result copied back (DeepSpeed's BF16 optimizer does the same for the other two systems, with ZeRO-1 at dp 1).

Timing: one launch builds every variant and runs their steps in turn (one round = one step of each, the order
rotating every round), so machine noise hits them alike; per step the slowest rank's wall time and CPU time.
Memory (unless ``--no-memory``): one launch per variant, nothing else resident: the peak RSS per rank over two
training steps (VmHWM reset after the build) and the bytes one forward with the loss saves for backward (unique
storages, parameters excluded, DTensors counted by their local shard); ``--saved-only`` measures the saved bytes of
every variant in one launch instead (no peak RSS: on a loaded machine a launch per variant takes minutes), and
``--times-json`` reuses the times of an earlier launch (its rank-0 JSON, which records the load average).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _results import write_markdown  # noqa: E402
from throughput_vs_autotp import (  # noqa: E402
    BETAS,
    EPS,
    LR,
    TP,
    WEIGHT_DECAY,
    _port,
    autotp_engine,
    batches,
    ds_megatron_config,
    num_params,
    proc_status_kb,
    timed_rounds,
)

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {"dsm": "ds_megatron, SP", "torch": "PyTorch TP + SP (DTensor)", "autotp": "DeepSpeed AutoTP"}
# name -> (system, attention kernel, recompute); the row order of the table.
VARIANTS = {
    f"{system}-{kernel}-{recompute}": (system, kernel, recompute)
    for kernel in ("sdpa", "eager")
    for recompute in ("none", "full")
    for system in SYSTEMS
}
DEFAULT_VARIANTS = [n for n, (_, kernel, recompute) in VARIANTS.items() if kernel == "sdpa" or recompute == "none"]


# ---------------------------------------------------------------------------------------------------------------
# Worker side (runs under the deepspeed launcher, one process per TP rank).


def reference_state(args, kernel: str):
    """ds_megatron's initial Llama weights and the equivalent ``transformers.LlamaConfig`` for ``kernel``."""
    from ds_megatron.config import resolve
    from ds_megatron.model import build_model, model_config

    run = resolve(ds_megatron_config(args, "none", kernel), TP)
    reference = build_model(model_config(run.model), seed=run.section.train.seed)
    return reference.state_dict(), reference.config.to_hf()


def hf_llama(args, kernel: str):
    """transformers' LlamaForCausalLM in bf16 with ds_megatron's initial weights (the key map is the identity)."""
    from transformers import LlamaForCausalLM

    state, config = reference_state(args, kernel)
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    assert model.config._attn_implementation == kernel, model.config._attn_implementation
    return model


class TorchTP:
    """PyTorch-native TP + SP of transformers' Llama (see the module docstring): ``engine.module`` is the model."""

    def __init__(self, args, kernel: str, recompute: str):
        import torch.distributed as dist
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        assert dist.get_world_size() == TP
        mesh = init_device_mesh("cpu", (TP,))
        model = hf_llama(args, kernel).to(torch.bfloat16)
        parallelize_module(
            model,
            mesh,
            {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            },
        )
        layer_plan = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        layers = model.model.layers
        for i, layer in enumerate(layers):
            parallelize_module(layer, mesh, layer_plan)
            if recompute == "full":
                layers[i] = checkpoint_wrapper(layer)
            if getattr(args, "compile_peer", False):  # torchtitan's way: each decoder layer compiled, after TP
                layers[i] = torch.compile(layers[i], fullgraph=True)
        model.train()
        self.module = model
        self.kernel = kernel
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch (call inside ``loss_parallel``: the logits are vocabulary-sharded)."""
        import torch.nn.functional as F

        llama = self.module.model
        s = x.shape[1]
        position_ids = torch.arange(s).unsqueeze(0)
        hidden = llama.embed_tokens(x)  # [b, s/t, h], a plain local tensor
        position_embeddings = llama.rotary_emb(hidden, position_ids=position_ids)
        mask = None  # sdpa: transformers passes is_causal=True when there is no mask
        if self.kernel == "eager":
            mask = torch.full((s, s), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)[None, None]
        for layer in llama.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids
            )
        logits = self.module.lm_head(llama.norm(hidden))  # DTensor [b, s, V], Shard(-1)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = self.forward_loss(x, y)
            loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return float(loss.detach().full_tensor())


class Variant:
    """One system's engine, ``train_step(x, y)`` (one optimizer step, returns the loss) and ``forward_loss``."""

    def __init__(self, name: str, args):
        self.name = name
        system, kernel, recompute = VARIANTS[name]
        getattr(self, f"_build_{system}")(args, kernel, recompute)

    def _build_dsm(self, args, kernel: str, recompute: str) -> None:
        from ds_megatron.config import resolve
        from ds_megatron.engine import build_engine

        self.engine = build_engine(resolve(ds_megatron_config(args, recompute, kernel), TP)).engine
        self.train_step = lambda x, y: float(self.engine.train_batch(iter([(x, y)])))
        module = self.engine.module
        self.forward_loss = lambda x, y: module.loss_fn(module(x), y)
        self.loss_context = _no_context

    def _build_torch(self, args, kernel: str, recompute: str) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        self.engine = TorchTP(args, kernel, recompute)
        self.train_step = self.engine.train_step
        self.forward_loss = self.engine.forward_loss
        self.loss_context = loss_parallel

    def _build_autotp(self, args, kernel: str, recompute: str) -> None:
        self.engine, self.train_step, self.forward_loss = autotp_engine(args, hf_llama(args, kernel), recompute)
        self.loss_context = _no_context


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a rank really holds: a DTensor's local shard, the result inside a functional collective's
    not-yet-waited wrapper (both have no storage of their own); any other tensor itself."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


def saved_bytes(variant: Variant, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes saved for backward by one forward (loss included): unique storages, parameters excluded."""
    params = {_local(p).untyped_storage().data_ptr() for p in variant.engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with variant.loss_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = variant.forward_loss(x, y)
    del loss
    return sum(seen.values())


def work_times(args, names: list[str]) -> dict:
    """All variants in one process, timed in rotating rounds, with the load average before and after."""
    load = os.getloadavg()
    variants = {name: Variant(name, args) for name in names}
    times = timed_rounds(variants, batches(args, args.warmup + args.steps), args.warmup)
    return {**times, "load": [list(load), list(os.getloadavg())]}


def work_memory(args, name: str) -> dict:
    """One variant alone: RSS after the build, the peak over two training steps, and the bytes one forward saves."""
    variant = Variant(name, args)
    data = batches(args, 2)  # Adam's moments appear in the first step; the second confirms the peak
    rss_built = proc_status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    for x, y in data:
        variant.train_step(x, y)
    peak = proc_status_kb("VmHWM")
    x, y = data[0]
    return {"rss_built_kb": rss_built, "peak_rss_kb": peak, "saved_bytes": saved_bytes(variant, x, y)}


def work_saved(args, names: list[str]) -> dict:
    """Every variant in one process: the bytes one forward with the loss saves for backward (no peak RSS, which
    needs the variant alone in its process)."""
    x, y = batches(args, 1)[0]
    return {name: {"saved_bytes": saved_bytes(Variant(name, args), x, y)} for name in names}


def worker(args) -> None:
    from ds_megatron.engine import init_distributed

    # Through ds_megatron, whichever variant comes first: it unlinks the /dev/shm buffer DeepSpeed's CPU all-reduce
    # leaves behind (~66 MB per rank and launch), which deepspeed.initialize alone would leak.
    init_distributed()
    names = args.variants.split(",")
    if args.work == "memory":
        result, tag = work_memory(args, names[0]), names[0]
    else:
        result, tag = (work_times if args.work == "times" else work_saved)(args, names), "all"
    Path(args.out, f"{args.work}-{tag}.rank{os.environ['RANK']}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# Driver side.


def launch(args, work: str, names: list[str], out: Path) -> list[dict]:
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(TP), "--master_port", str(_port())]
    cmd += [__file__, "--worker", "--work", work, "--variants", ",".join(names), "--out", str(out)]
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "batch", "vocab", "warmup", "steps"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--compile-peer"] if args.compile_peer else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{work} {names} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("step "):
            print(line, flush=True)
    print(f"{work} {','.join(names)}: {time.perf_counter() - start:.0f} s", flush=True)
    tag = names[0] if work == "memory" else "all"
    return [json.loads((out / f"{work}-{tag}.rank{r}.json").read_text()) for r in range(TP)]


def spread(values: list[float]) -> str:
    """median (min-max)"""
    return f"**{statistics.median(values):.2f}** ({min(values):.2f}-{max(values):.2f})"


def label(name: str) -> str:
    system, kernel, recompute = VARIANTS[name]
    return f"{SYSTEMS[system]}, {kernel}, {'per-layer checkpointing' if recompute == 'full' else 'no recompute'}"


def table(args, names: list[str], times: dict, memory: dict | None) -> str:
    tokens = args.batch * args.seq
    wall, cpu = times["wall"], times["cpu"]
    lines = [
        "| system, attention, recompute | tokens/s (median wall) | ms/step: median (min-max) | CPU ms/step: median "
        "| peak RSS per rank (MB) | saved for backward per rank (MB) | loss, last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        w = [v * 1e3 for v in wall[name]]
        peak = saved = "-"
        if memory:
            if "peak_rss_kb" in memory[name][0]:
                peak = f"{max(r['peak_rss_kb'] for r in memory[name]) / 1024:,.0f}"
            saved = f"{max(r['saved_bytes'] for r in memory[name]) / 2**20:.1f}"
        lines.append(
            f"| {label(name)} | {tokens / statistics.median(wall[name]):,.0f} | {statistics.median(w):,.0f} "
            f"({min(w):,.0f}-{max(w):,.0f}) | {statistics.median(cpu[name]) * 1e3:,.0f} | {peak} | {saved} | "
            f"{times['losses'][name][-1]:.4f} |"
        )
    lines += [
        "",
        "Speed ratios at equal kernel and equal recompute (> 1: ds_megatron is faster): the peer's step time over "
        "ds_megatron's in the same round, median (min-max) over the rounds.",
        "",
        "| kernel | recompute | peer | wall time ratio | CPU time ratio | saved bytes, ds_megatron / peer |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        system, kernel, recompute = VARIANTS[name]
        ours = f"dsm-{kernel}-{recompute}"
        if system == "dsm" or ours not in names:
            continue
        saved = "-"
        if memory:
            saved = f"{max(r['saved_bytes'] for r in memory[ours]) / max(r['saved_bytes'] for r in memory[name]):.2f}"
        lines.append(
            f"| {kernel} | {recompute} | {SYSTEMS[system]} | "
            f"{spread([b / a for a, b in zip(wall[ours], wall[name])])} | "
            f"{spread([b / a for a, b in zip(cpu[ours], cpu[name])])} | {saved} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704, help="SwiGLU width (intermediate_size)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (also the global batch: dp 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (one step of every variant each)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--no-memory", action="store_true", help="skip the one-launch-per-variant memory phase")
    ap.add_argument(
        "--saved-only", action="store_true", help="memory: saved bytes of every variant from one launch, no peak RSS"
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="ds_megatron with model.compile on (its RMSNorm, rotary and SwiGLU as compiled kernels)",
    )
    ap.add_argument(
        "--compile-peer",
        action="store_true",
        help="PyTorch TP + SP with every decoder layer under torch.compile (fullgraph), as torchtitan; on torch "
        "2.13 CPU its first backward fails inside DTensor's redistribute (benchmarks/results/gemm_floor.md)",
    )
    ap.add_argument("--markdown")
    ap.add_argument("--times-json", help="the times of an earlier launch (its rank-0 JSON): run the memory phase only")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", choices=("times", "memory", "saved"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [n for n in args.variants.split(",") if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    names = args.variants.split(",")
    out = Path(tempfile.mkdtemp(prefix="peers_"))
    load_start = os.getloadavg()
    if args.times_json:
        times = json.loads(Path(args.times_json).read_text())
    else:
        times = launch(args, "times", names, out)[0]
    if args.no_memory:
        memory = None
    elif args.saved_only:
        ranks = launch(args, "saved", names, out)
        memory = {n: [r[n] for r in ranks] for n in names}
    else:
        memory = {n: launch(args, "memory", [n], out) for n in names}
    load_end = os.getloadavg()
    memory_how = {
        None: "no memory phase",
        "saved": "saved bytes from one launch building every variant (no peak RSS)",
        "rss": "memory from one launch per variant (peak RSS: VmHWM over two steps, reset after the build)",
    }[None if args.no_memory else "saved" if args.saved_only else "rss"]
    if "load" in times:
        load_start, load_end = times["load"]  # the load while the times were measured
    timed_in = f"the times from {args.times_json}, an earlier launch" if args.times_json else "one launch"
    body = (
        f"Llama, {args.layers} layers, h {args.hidden}, {args.heads} heads ({args.kv_heads} KV heads, head dim "
        f"{args.hidden // args.heads}), SwiGLU width {args.ffn}, V {args.vocab} (untied), s {args.seq}, "
        f"micro-batch {args.batch}, {num_params(args) / 1e6:.1f}M parameters; tp {TP} on {TP} CPU processes "
        f"(gloo, OMP_NUM_THREADS=1: one thread per process, one process per core), bf16 weights + fp32 masters, "
        f"AdamW, clipping 1.0, no dropout; {args.steps} timed rounds after {args.warmup} warm-up, every variant's "
        f"step once per round in a rotating order, {timed_in} (wall and CPU time per step: the slowest rank's); "
        f"{memory_how}.  The machine was shared with other jobs: load average (1/5/15 min) "
        f"{'/'.join(f'{v:.1f}' for v in load_start)} at the start of the timing, "
        f"{'/'.join(f'{v:.1f}' for v in load_end)} at its end, on {os.cpu_count()} cores, so wall times "
        f"scatter; CPU time (the process's own) is less disturbed but leaves out waits in collectives."
        f"\n\n{table(args, names, times, memory)}"
    )
    print(body)
    if args.markdown:
        write_markdown(
            args.markdown,
            "Llama at tp 2: ds_megatron against PyTorch-native TP + SP and DeepSpeed AutoTP, at equal kernel",
            "python benchmarks/throughput_peers.py",
            body,
        )


if __name__ == "__main__":
    main()
