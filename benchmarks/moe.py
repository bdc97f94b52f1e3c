"""Mixture of experts, four measurements in one run (results: benchmarks/results/moe.md):

1. layers: ds_megatron's routed MLP (``model.moe_layer.SparseMoeBlock``) against DeepSpeed's AutoEP layer
   (``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer``, the ``"expert_parallel"`` path, ep 1) and transformers'
   ``Qwen3MoeSparseMoeBlock``, the same weights in all three, each with its grouped GEMM and its per-expert loop, in
   fp32 and bf16: forward + backward tokens per CPU second and the bytes autograd saves for backward; then ours
   (``expert_parallel.layer.ExpertParallelMoE``) against the AutoEP layer at ep 2 over 2 gloo processes.
2. gemm: ours, ``torch._grouped_mm`` against the per-expert loop at several token counts.
3. memory: one routed block's saved bytes (qwen3_moe and mixtral shapes, fp32 and bf16, with and without selective
   ``moe`` recompute) against the tuner's formula (``memory.activation_bytes_per_layer(..., routed=...)``).
4. tuner: the time model for a published MoE run (Qwen3-30B-A3B on 16 H100, Megatron-Bridge's performance summary).

    OMP_NUM_THREADS=1 python benchmarks/moe.py [--repeats 7] [--trials 2] [--parts layers,ep,gemm,memory,tuner]
        [--markdown benchmarks/results/moe.md]

The markdown holds the tables and their conditions; the reading under them in benchmarks/results/moe.md is written
by hand from the run.

Timing: CPU seconds of this process (``time.process_time``: on a machine shared with other jobs its own clock, not
the wall clock), one thread, one warm-up, then ``--repeats`` rounds in which every variant of a row runs once in
turn (so a burst of other work hits them alike); the median per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._results import OtherWork, write_markdown  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARTS = ("layers", "ep", "gemm", "memory", "tuner")

# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers (tests/unit/test_benchmark_moe.py)


def saved_bytes(run: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves while ``run()`` builds its graph, the storages of ``params``
    left out (the model states count them), and ``run()``'s result.  A storage saved twice (a view, the same tensor
    for two ops) counts once."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int, clock=time.process_time) -> dict[str, float]:
    """Median seconds of each of ``fns`` on ``clock``: one warm-up call each, then ``repeats`` rounds calling every
    one once in turn."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def relative_gap(value: float, reference: float) -> float:
    """value / reference - 1 (e.g. +0.25: 25% above the reference)."""
    return value / reference - 1.0


# ---------------------------------------------------------------------------------------------------------------------
# 1. Our layer vs DeepSpeed's AutoEP layer vs transformers' block

# (name, tokens as b x s, h, expert width F, E, k): Mixtral's routing (8 experts, top 2) and Qwen3-MoE's (many
# narrow experts, top 8), both scaled down to CPU size.
LAYER_SHAPES = (("mixtral-like", (2, 512), 256, 512, 8, 2), ("qwen3-like", (2, 512), 256, 128, 32, 8))
AUTOEP_INIT_NOTE = (
    'DeepSpeed\'s AutoEP through `deepspeed.initialize` (config `"expert_parallel": {"enabled": true, '
    '"autoep_size": 1, "preset_model": "qwen3_moe"}`) fails on this install: deepspeed 0.19.8 with '
    "transformers {tf}, `TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given` in "
    "`auto_ep_presets/base.py` (retargeting transformers' output recorders, after the layer swap). So the AutoEP "
    "layer is built as that swap builds it: `AutoEP(model, config).ep_parser()` finds the spec and "
    "`AutoEPMoELayer(spec, hf_block, ep_size=1, ep_rank=0, config)` copies the block's weights. AutoEP is "
    "the peer rather than the older `deepspeed.moe.layer.MoE` because it is the path DeepSpeed offers for a "
    "transformers MoE model, and its layer runs on CPU (gloo at ep 2 too)."
)


def _hf_block(h: int, f: int, e: int, k: int, kernel: str):
    """transformers' Qwen3-MoE model of one block, its routed MLP and the experts kernel (``_experts_implementation``:
    "grouped_mm" or "eager", transformers' loop over the experts that got tokens)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=f, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, num_experts=e, num_experts_per_tok=k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        block = model.model.layers[0].mlp
        block.gate.weight.normal_(0.0, 0.02)
        block.experts.gate_up_proj.normal_(0.0, 0.02)
        block.experts.down_proj.normal_(0.0, 0.02)
    block.experts.config._experts_implementation = kernel
    return model, block


def _autoep_layer(model, hf_block, grouped: bool, ep: tuple[int, int] = (1, 0)):
    """DeepSpeed's AutoEP layer for ``hf_block`` at (ep size, ep rank), as its engine's layer swap builds it."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    config = parse_autoep_config(
        {"enabled": True, "autoep_size": ep[0], "preset_model": "qwen3_moe", "use_grouped_mm": grouped}
    )
    with contextlib.redirect_stdout(io.StringIO()):
        (spec,) = AutoEP(model, config).ep_parser()
    return AutoEPMoELayer(spec, hf_block, ep[0], ep[1], config)


def _our_block(hf_block, h: int, f: int, e: int, k: int, gemm: str):
    from ds_megatron.model.moe_layer import SparseMoeBlock

    block = SparseMoeBlock(h, f, e, k, norm_topk_prob=True, gemm=gemm)
    with torch.no_grad():  # the same names and layouts as transformers' block: the key map is the identity
        block.load_state_dict(hf_block.state_dict())
    return block


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def layer_rows(repeats: int, trials: int) -> list[str]:
    from deepspeed.utils import logger

    logger.setLevel("ERROR")
    rows = [
        "| shape (tokens, h, F, E, k) | dtype | kernel | ours tokens/s | AutoEP tokens/s | transformers tokens/s | "
        "AutoEP / ours | transformers / ours | ours saved KiB | AutoEP saved KiB | transformers saved KiB | "
        "max output difference vs ours | other work (cores) |",
        "|---" * 13 + "|",
    ]
    for name, (b, s), h, f, e, k in LAYER_SHAPES:
        for dtype_name, dtype in DTYPES.items():
            for kernel, (ours_gemm, hf_kernel, ds_grouped) in (
                ("grouped GEMM", ("grouped", "grouped_mm", True)),
                ("loop", ("loop", "eager", False)),
            ):
                model, hf = _hf_block(h, f, e, k, hf_kernel)
                layers = {
                    "ours": _our_block(hf, h, f, e, k, ours_gemm),
                    "AutoEP": _autoep_layer(model, hf, ds_grouped),
                    "transformers": hf,
                }
                for layer in layers.values():
                    layer.to(dtype).train()
                torch.manual_seed(1)
                x = torch.randn(b, s, h).to(dtype)
                saved, outs = {}, {}
                for who, layer in layers.items():
                    xi = x.clone().requires_grad_()
                    saved[who], out = saved_bytes(
                        lambda layer=layer, xi=xi: _first(layer(xi)), list(layer.parameters())
                    )
                    out.backward(torch.ones_like(out))
                    outs[who] = out.detach().float()

                def step(layer, x=x):
                    xi = x.detach().requires_grad_()
                    out = _first(layer(xi))
                    out.backward(torch.ones_like(out))
                    layer.zero_grad(set_to_none=True)

                fns = {who: (lambda layer=layer: step(layer)) for who, layer in layers.items()}
                diff = max((outs[w] - outs["ours"]).abs().max().item() for w in ("AutoEP", "transformers"))
                for _ in range(trials):
                    with OtherWork() as other:
                        sec = interleaved_medians(fns, repeats)
                    tps = {who: b * s / t for who, t in sec.items()}
                    rows.append(
                        f"| {name} ({b * s}, {h}, {f}, {e}, {k}) | {dtype_name} | {kernel} | {tps['ours']:,.0f} | "
                        f"{tps['AutoEP']:,.0f} | {tps['transformers']:,.0f} | {tps['AutoEP'] / tps['ours']:.2f} | "
                        f"{tps['transformers'] / tps['ours']:.2f} | {saved['ours'] / 1024:,.0f} | "
                        f"{saved['AutoEP'] / 1024:,.0f} | {saved['transformers'] / 1024:,.0f} | {diff:.1e} | "
                        f"{other.cores:.1f} |"
                    )
                    print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 1b. Ours vs AutoEP at ep 2 (2 gloo processes; transformers' block has no expert parallelism)


def _ep_rank(rank: int, world: int, init: str, repeats: int, out: dict) -> None:
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger

    from ds_megatron.expert_parallel.layer import ExpertParallelMoE
    from ds_megatron.topology import Group

    torch.set_num_threads(1)
    logger.setLevel("ERROR")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer over the same process group
    group = Group(dist.new_group(list(range(world))), rank, world)
    for name, (b, s), h, f, e, k in LAYER_SHAPES:
        for dtype_name, dtype in DTYPES.items():
            model, hf = _hf_block(h, f, e, k, "grouped_mm")  # seeded: the same weights on every rank
            ours = ExpertParallelMoE.from_block(_our_block(hf, h, f, e, k, "grouped"), group).to(dtype).train()
            with contextlib.redirect_stdout(io.StringIO()):
                theirs = _autoep_layer(model, hf, True, ep=(world, rank)).to(dtype).train()
                theirs.set_deepspeed_parallelism()
            layers = {"ours": ours, "AutoEP": theirs}
            torch.manual_seed(1 + rank)  # each rank its own tokens
            x = torch.randn(b, s, h).to(dtype)
            saved, outs = {}, {}
            for who, layer in layers.items():
                xi = x.clone().requires_grad_()
                saved[who], y = saved_bytes(lambda layer=layer, xi=xi: _first(layer(xi)), list(layer.parameters()))
                y.backward(torch.ones_like(y))
                outs[who] = y.detach().float()

            def step(layer, x=x):
                xi = x.detach().requires_grad_()
                y = _first(layer(xi))
                y.backward(torch.ones_like(y))
                layer.zero_grad(set_to_none=True)

            def timed(fn):  # the slowest rank's CPU seconds of fn, between barriers
                def run():
                    dist.barrier()
                    t0 = time.process_time()
                    fn()
                    spent = torch.tensor([time.process_time() - t0], dtype=torch.float64)
                    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
                    return float(spent)

                return run

            results: dict[str, list[float]] = {who: [] for who in layers}
            for i in range(repeats + 1):
                for who, layer in layers.items():
                    spent = timed(lambda layer=layer: step(layer))()
                    if i:
                        results[who].append(spent)
            sec = {who: statistics.median(ts) for who, ts in results.items()}
            stats = torch.tensor([saved["ours"], saved["AutoEP"], (outs["AutoEP"] - outs["ours"]).abs().max().item()],
                                 dtype=torch.float64)  # fmt: skip
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            if rank == 0:
                out[(name, dtype_name)] = (b * s, sec, stats.tolist())
    dist.destroy_process_group()


def ep_rows(repeats: int, trials: int) -> list[str]:
    import tempfile

    import torch.multiprocessing as mp

    rows = [
        "| shape (tokens per rank, h, F, E, k) | dtype | ours tokens/s per rank | AutoEP tokens/s per rank | "
        "AutoEP / ours | ours saved KiB per rank | AutoEP saved KiB per rank | max output difference | "
        "other work (cores) |",
        "|---" * 9 + "|",
    ]
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager, OtherWork() as other:
            out = manager.dict()
            mp.spawn(_ep_rank, args=(2, os.path.join(tmp, "init"), repeats, out), nprocs=2)
            results = dict(out)
        for name, _tokens, h, f, e, k in LAYER_SHAPES:
            for dtype_name in DTYPES:
                n, sec, (ours_saved, theirs_saved, diff) = results[(name, dtype_name)]
                rows.append(
                    f"| {name} ({n}, {h}, {f}, {e}, {k}) | {dtype_name} | {n / sec['ours']:,.0f} | "
                    f"{n / sec['AutoEP']:,.0f} | {sec['ours'] / sec['AutoEP']:.2f} | {ours_saved / 1024:,.0f} | "
                    f"{theirs_saved / 1024:,.0f} | {diff:.1e} | {other.cores:.1f} |"
                )
                print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 2. Ours: grouped GEMM vs the per-expert loop, by token count

GEMM_SHAPE = (256, 128, 32, 8)  # h, F, E, k (the qwen3-like layer above)
GEMM_TOKENS = (32, 128, 512, 2048, 8192)


def gemm_rows(repeats: int, trials: int) -> list[str]:
    from ds_megatron.model.moe_layer import SparseMoeBlock

    h, f, e, k = GEMM_SHAPE
    rows = [
        "| tokens (rows per expert, mean) | dtype | grouped ms | loop ms | loop / grouped | other work (cores) |",
        "|---" * 6 + "|",
    ]
    for n in GEMM_TOKENS:
        for dtype_name, dtype in DTYPES.items():
            torch.manual_seed(0)
            block = SparseMoeBlock(h, f, e, k, norm_topk_prob=True)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.02)
            block.to(dtype)
            x = torch.randn(n, h).to(dtype)

            def step(kind, block=block, x=x):
                block.experts.gemm = kind
                xi = x.detach().requires_grad_()
                out, _ = block(xi)
                out.backward(torch.ones_like(out))
                block.zero_grad(set_to_none=True)

            for _ in range(trials):
                with OtherWork() as other:
                    sec = interleaved_medians({kind: (lambda kind=kind: step(kind)) for kind in ("grouped", "loop")},
                                              repeats)  # fmt: skip
                rows.append(
                    f"| {n} ({n * k / e:g}) | {dtype_name} | {1e3 * sec['grouped']:.2f} | {1e3 * sec['loop']:.2f} | "
                    f"{sec['loop'] / sec['grouped']:.2f} | {other.cores:.1f} |"
                )
                print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 3. Saved bytes of one routed block against the tuner's formula

# (family, s, b, h, heads, KV heads, head width, F, E, k): a Qwen3-MoE-like and a Mixtral-like block at CPU size.
MEMORY_SHAPES = (
    ("qwen3_moe", 256, 2, 256, 8, 2, 64, 128, 32, 8),
    ("mixtral", 256, 2, 256, 8, 2, 32, 512, 8, 2),
)


def memory_rows() -> list[str]:
    from ds_megatron.config.schema import RecomputeSection
    from ds_megatron.memory import activation_bytes_per_layer
    from ds_megatron.model import FAMILIES
    from ds_megatron.model.family import RoutedShape
    from ds_megatron.parallelize import ParallelContext, parallelize_block
    from ds_megatron.random import build_rng
    from ds_megatron.topology import Group

    rows = [
        "| family (s, b, h, heads/KV, d, F, E, k) | dtype | recompute | measured bytes | formula bytes | "
        "formula / measured - 1 |",
        "|---" * 6 + "|",
    ]
    for family, s, b, h, a, kv, d, f, e, k in MEMORY_SHAPES:
        config = FAMILIES[family].config(
            vocab_size=128, hidden_size=h, num_layers=1, num_heads=a, num_kv_heads=kv, head_dim=d,
            intermediate_size=2 * h, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
            max_position_embeddings=s, rope_theta=10000.0,
        )  # fmt: skip
        for dtype_name, dtype in DTYPES.items():
            for modules in ((), ("moe",)):
                torch_side = FAMILIES[family].torch_side()
                block = torch_side.block(config)
                torch_side.init(block, config, 1234, prefix="model.layers.0.")
                recompute = RecomputeSection("selective", modules=modules) if modules else RecomputeSection("none")
                plan = ParallelContext(config, Group(), False, build_rng(1234, 0, 0, 0), recompute=recompute)
                block = parallelize_block(block, plan).to(dtype).train()
                x = torch.randn(s, b, h).to(dtype).requires_grad_()
                measured, (y, stats) = saved_bytes(lambda block=block, x=x: block(x), list(block.parameters()))
                (y.float().sum() + stats.probs.sum() + stats.z).backward()
                act = torch.finfo(dtype).bits // 8
                measured -= 2 * s * d * act  # the rotary cos/sin tables, shared by every block (rotary_table_bytes)
                formula = activation_bytes_per_layer(
                    s, b, h, a, 1, False, "selective" if modules else "none", act, family=family, num_kv_heads=kv,
                    intermediate_size=2 * h, attention_dropout=0.0, modules=modules,
                    routed=RoutedShape(a, kv, d, e, k, f, True),
                )  # fmt: skip
                rows.append(
                    f"| {family} ({s}, {b}, {h}, {a}/{kv}, {d}, {f}, {e}, {k}) | {dtype_name} | "
                    f"{'+'.join(modules) or 'none'} | {measured:,} | {formula:,.0f} | "
                    f"{relative_gap(formula, measured):+.2%} |"
                )
                print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 4. The tuner against a published MoE run

PUBLISHED = dict(
    model="qwen3-30b-a3b", gpus=16, gpu="h100-sxm", seq=4096, gbs=512, mbs=2, tp=1, pp=2, vp=24, ep=8,
    tokens_per_gpu=5275, tflops_per_gpu=121, precision="FP8-CS",
    source="Megatron-Bridge performance summary, NeMo 25.11 container, DGX-H100 table "
    "(https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html; repository file "
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at commit 00b7660be0254ac6f95f44164ddd0c3e9cc798ed)",
)  # fmt: skip


def tuner_rows() -> list[str]:
    from ds_megatron.tune import Candidate, Pins, build_cluster, build_model_shape, search, step_time

    p = PUBLISHED
    model = build_model_shape(p["model"], None, None, None, None, p["seq"])
    rows = [
        "| what | layout | peak TFLOP/s used | predicted tokens/s/GPU | published tokens/s/GPU | predicted / "
        "published - 1 | predicted model TFLOP/s/GPU | memory |",
        "|---" * 8 + "|",
    ]
    dp = p["gpus"] // (p["tp"] * p["pp"])
    for peak, label in ((None, "bf16 dense peak"), (2.0, "FP8 peak (2x bf16) for every matmul")):
        cluster = build_cluster(p["gpu"], p["gpus"], 8)
        if peak:
            cluster = build_cluster(p["gpu"], p["gpus"], 8, peak_tflops=cluster.peak_tflops * peak)
        for schedule, vp in (("interleaved-1f1b", p["vp"]), ("1f1b", None)):
            cand = Candidate(
                tp=p["tp"], pp=p["pp"], dp=dp, sequence_parallel=False, micro_batch_size=p["mbs"],
                num_micro_batches=p["gbs"] // (dp * p["mbs"]), recompute="none", attention="sdpa", zero=1,
                schedule=schedule, virtual_stages=vp, ep=p["ep"],
            )  # fmt: skip
            t = step_time(model, cluster, cand, p["gbs"])
            per_gpu = t.tokens_per_s / p["gpus"]
            rows.append(
                f"| published layout ({label}) | tp {p['tp']} pp {p['pp']} dp {dp} ep {p['ep']} b {p['mbs']}, "
                f"{schedule}"
                f"{f' v {vp}' if vp else ''}, no recompute, sdpa | {cluster.peak_flops / 1e12:.0f} | {per_gpu:,.0f} | "
                f"{p['tokens_per_gpu']:,} | {relative_gap(per_gpu, p['tokens_per_gpu']):+.0%} | "
                f"{t.mfu * cluster.peak_flops / 1e12:.0f} | pinned |"
            )
        result = search(model, cluster, p["gbs"], Pins())
        best = result.ranked[0] if result.ranked else None
        if best is not None:
            c, t = best.candidate, best.time
            per_gpu = t.tokens_per_s / p["gpus"]
            rows.append(
                f"| the tuner's best layout ({label}) | tp {c.tp} pp {c.pp} dp {c.dp} ep {c.ep_size} "
                f"b {c.micro_batch_size}, "
                f"SP {'on' if c.sequence_parallel else 'off'}, {c.schedule}, {c.recompute_label()}, {c.attention} | "
                f"{cluster.peak_flops / 1e12:.0f} | {per_gpu:,.0f} | {p['tokens_per_gpu']:,} | "
                f"{relative_gap(per_gpu, p['tokens_per_gpu']):+.0%} | {t.mfu * cluster.peak_flops / 1e12:.0f} | "
                f"{best.required_bytes / 2**30:.1f} GiB of {cluster.gpu_memory_gb:.0f} |"
            )
        print(rows[-1], flush=True)
    return rows


def tuner_cli_text() -> str:
    """What ``python -m ds_megatron.tune`` says for the published layout pinned (its first lines)."""
    from ds_megatron.tune.__main__ import main as tune_main

    p = PUBLISHED
    dp = p["gpus"] // (p["tp"] * p["pp"])
    argv = [
        "--model", p["model"], "--seq-length", str(p["seq"]), "--global-batch-size", str(p["gbs"]), "--gpus",
        str(p["gpus"]), "--gpu", p["gpu"], "--tp", str(p["tp"]), "--pp", str(p["pp"]), "--dp", str(dp),
        "--micro-batch-size", str(p["mbs"]),
    ]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        with contextlib.suppress(SystemExit):
            tune_main(argv)
    lines = [line for line in buf.getvalue().splitlines() if line.strip()]
    return "`python -m ds_megatron.tune " + " ".join(argv) + "`:\n\n```\n" + "\n".join(lines[:6]) + "\n```"


# ---------------------------------------------------------------------------------------------------------------------

# Each section's heading and the conditions printed above its table.
HEADINGS = {
    "layers": (
        "1. The routed MLP: ours vs DeepSpeed's AutoEP layer vs transformers' `Qwen3MoeSparseMoeBlock`",
        "One process, one thread, ep 1. The same weights in all three (transformers' block is the source: ours loads "
        "its state dict, the key map being the identity; AutoEP copies it). Forward + backward of the layer alone "
        "(gradient of ones on its output; no auxiliary loss), x of b 2 x s 512. Kernels: grouped GEMM = ours "
        '`gemm="grouped"`, AutoEP `use_grouped_mm: true`, transformers `_experts_implementation="grouped_mm"` '
        '(all three `torch._grouped_mm`); loop = ours `gemm="loop"`, AutoEP `use_grouped_mm: false`, '
        'transformers `"eager"`. Tokens/s: tokens over the median CPU seconds of a step ({repeats} rounds after a '
        "warm-up, the three run in turn each round). Saved: the distinct storages autograd keeps for backward "
        "(saved-tensor hooks, parameters left out). Max output difference: the larger of AutoEP's and "
        "transformers' largest absolute difference from our output (bf16: ours computes the router logits in fp32, "
        "the other two in bf16 then the softmax in fp32, so near-tied experts can flip). Other work: cores the rest "
        "of the machine kept busy meanwhile (this is a shared 2-core machine).",
    ),
    "ep": (
        "1b. Expert parallelism 2: ours vs AutoEP over 2 gloo processes",
        "Two processes on this machine's 2 cores, one thread each, gloo (DeepSpeed's comm layer initialised over "
        "the same process group for AutoEP, whose `set_deepspeed_parallelism` builds its EP group). Each rank holds "
        "half of the experts and routes its own b 2 x s 512 tokens; grouped GEMM in both (`ExpertParallelMoE` and "
        "`AutoEPMoELayer` at ep 2). Time: the slowest rank's CPU seconds of forward + backward between barriers "
        "(CPU time of the process, gloo's threads included), median of {repeats} rounds after a warm-up, the two "
        "layers in turn each round. Saved and output difference: the larger of the two ranks' (the difference "
        "between AutoEP's output and ours on the same tokens).",
    ),
    "gemm": (
        "2. Ours: grouped GEMM vs the per-expert loop, by token count",
        "`SparseMoeBlock` at h 256, F 128, E 32, k 8 (the qwen3-like layer above), forward + backward, median CPU ms "
        "of {repeats} rounds (the two kernels in turn each round), one thread; rows per expert = tokens x k / E.",
    ),
    "memory": (
        "3. Saved bytes of one routed block vs the tuner's formula",
        "One whole routed block (attention + routed MLP, `parallelize_block` at tp 1, eager attention, no "
        "dropout), its saved tensors counted with saved-tensor hooks (each storage once; parameters and the rotary "
        "tables shared by every block left out), against `memory.activation_bytes_per_layer(..., routed=...)`, the "
        "formula the tuner's memory model uses. tp 2 + SP is checked to the byte by tests/unit/test_memory_moe.py "
        "(small shape, in-process gloo), not repeated here.",
    ),
    "tuner": (
        "4. The tuner's step-time model vs a published MoE run",
        "Published: Qwen3-30B-A3B pre-training on 16 H100 (DGX-H100), FP8 current scaling, global batch 512, "
        "micro-batch 2, s 4096, TP 1, PP 2, VP 24, EP 8: 5,275 tokens/s/GPU and 121 model TFLOP/s/GPU; "
        "dropless, tokens force-balanced over the experts. Source: {source}. The published layout is priced by "
        "the tuner's step-time model (`tune.step_time`, ep 8 pinned as published), and the search is run for its "
        "best layout. FP8: the tuner's training model runs every matmul at the bf16 peak; the rows at twice that "
        "peak bound what FP8 matmuls could give (attention and everything else unchanged).",
    ),
    "tuner_cli": ("The pinned layout through the command line", ""),
}


def cpu_text() -> str:
    """The CPU as ``lscpu`` names it and the cores this process may use (``nproc``)."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return (
        f"Machine: {model}, {len(os.sched_getaffinity(0))} cores (`nproc`), torch {torch.__version__}; "
        "timed rows are run --trials times each: the spread between a row's runs is the noise."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trials", type=int, default=2, help="timed runs of each row (their spread is the noise)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    started = time.perf_counter()
    sections: dict[str, list[str]] = {}
    if "layers" in parts:
        sections["layers"] = layer_rows(args.repeats, args.trials)
    if "ep" in parts:
        sections["ep"] = ep_rows(args.repeats, args.trials)
    if "gemm" in parts:
        sections["gemm"] = gemm_rows(args.repeats, args.trials)
    if "memory" in parts:
        sections["memory"] = memory_rows()
    if "tuner" in parts:
        sections["tuner"] = tuner_rows()
        sections["tuner_cli"] = [tuner_cli_text()]
    if args.markdown:
        import transformers

        cmd = f"OMP_NUM_THREADS=1 python benchmarks/moe.py --repeats {args.repeats} --trials {args.trials}"
        note = AUTOEP_INIT_NOTE.replace("{tf}", transformers.__version__)
        texts = []
        for name, rows in sections.items():
            heading, conditions = HEADINGS[name]
            conditions = conditions.replace("{repeats}", str(args.repeats)).replace("{source}", PUBLISHED["source"])
            texts.append(f"## {heading}\n\n" + (f"{conditions}\n\n" if conditions else "") + "\n".join(rows) + "\n")
        tables = "\n".join(texts)
        body = f"{cpu_text()}\n\n{tables}\n{note}\n\nRun time {time.perf_counter() - started:.0f} s."
        write_markdown(args.markdown, "Mixture of experts: layers, GEMM kernel, memory, tuner", cmd, body)


if __name__ == "__main__":
    main()
