"""Expert parallelism on DeepSpeed's BF16 and ZeRO optimizers: ``ep_training.py --out DIR --cases NAME,...``, each
case one engine (moe-tiny, 2 steps of 8 sequences, gradient clipping at 1.0) built and trained after the other in this
launch.
A case is ``<layout>-<precision>-ep<N>[-L<layers>]``: layout ``dp2`` (tp 1, the world size as dp), ``tp2sp`` (tp 2
with sequence parallelism, dp = world size / 2), ``tp2etp`` (``tp2sp`` with expert_tp 2: each expert split over the
tp ranks, EP over the dp ranks of one tp index; the case also saves its step 2 under ``<out>/<case>-ckpt``,
records what the files must hold, trains one more step and loads the save back, recording what it loaded) or
``pp2`` (two pipeline stages, dp = world size / 2); ``L<layers>``
cuts moe-tiny to that many blocks (its first is dense); precision ``bf16`` (ZeRO 0, bf16 gradient accumulation) or
``bf16z1`` (ZeRO 1, fp32 accumulation), both DeepSpeed's BF16 optimizer; ``fp32z1`` (fp32, ZeRO 1) or ``bf16z1b``
(bf16, ZeRO 1, bf16 accumulation), both DeepSpeed's ZeRO optimizer.

Rank 0 writes ``<case>.pt``: the per-step losses and grad norms of every rank (clipping acts on the norm: every
rank must see the same one), the optimizer's partition count per parameter group and whether the group is an
expert group, the dtype of every all-reduce over the expert-DP group during the steps, and every expert tensor's
fp32 master (``deepspeed.utils.safe_get_full_fp32_param``: the optimizer's partitions gathered over the group
they are cut over) after the steps, all EP ranks' experts concatenated along the expert dim (the single-device
layout), with the masters before the first step.  A case the engine refuses writes ``{"refused": <its one line>}``.

``--checkpoints PRECISION[:RUN+RUN...],...``: checkpoints of EP runs on the BF16 and ZeRO optimizers
(``checkpoint/ep_state.py``), for each precision the engines of ``CHECKPOINT_RUNS`` (those named, when named) one
after the other, 3 steps of the same tokens in all: ``dp2`` at ep 2 and at ep 1 train straight through, saving step 2
under ``<out>/<precision>-<run>`` (the ep 1 one step 3 under ``...-step3``); the others load one of those step-2
checkpoints and train step 3 (``tp2sp`` at ep 2: resharded on load, saving its step 3; ``ep2-to-ep1-saved`` saves
the loaded step 2 again at ep 1 before its step, which ``ep1-saved-to-ep2`` resumes at ep 2).  Rank 0 writes
``<precision>-<run>.pt``: the per-step losses and grad norms, every parameter's fp32 master after the last step in
the single-device layout, and for the ep 2 straight run the masters and Adam moments at its save."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import micro_batches, token_batches  # noqa: E402
from deepspeed.moe.utils import is_moe_param_group  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from ds_megatron.checkpoint.adapter import StateDictAdapter  # noqa: E402
from ds_megatron.checkpoint.ep_state import gather_experts  # noqa: E402
from ds_megatron.checkpoint.run_state import load_run, save_run  # noqa: E402
from ds_megatron.config import ConfigError, resolve  # noqa: E402
from ds_megatron.engine import build_engine  # noqa: E402
from ds_megatron.model.family import EXPERT_SPLITS  # noqa: E402
from ds_megatron.parallelize import is_expert_param  # noqa: E402
from ds_megatron.pipeline_parallel.module import pipeline_param_name  # noqa: E402
from ds_megatron.tensor_parallel.sharding import ShardRule, unshard  # noqa: E402

STEPS = 2
# tp, sequence_parallel, pp (at 4 processes tp2sp is tp 2 x dp 2: at ep 2, expert-DP groups of 2)
LAYOUTS = {"dp2": (1, False, 1), "tp2sp": (2, True, 1), "tp2etp": (2, True, 1), "pp2": (1, False, 2)}
EXPERT_TP_LAYOUTS = ("tp2etp",)  # expert_tp = tp
PRECISIONS = {
    "bf16": {"bf16": {"enabled": True}},
    "bf16z1": {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
    },
    # DeepSpeed's ZeRO optimizer: fp32 + ZeRO-1, and bf16 + ZeRO-1 accumulating in bf16
    "fp32z1": {"zero_optimization": {"stage": 1}},
    "bf16z1b": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
}


def config(case: str, world: int) -> dict:
    layout, precision, ep, *layers = case.split("-")
    tp, sp, pp = LAYOUTS[layout]
    dp = world // (tp * pp)
    model = {"size": "moe-tiny", "vocab_size": 64, "seq_length": 16, "dropout": 0.0, "attention": "eager"}
    if layers:
        model["num_layers"] = int(layers[0].removeprefix("L"))
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 8 // (2 * dp),
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "betas": [0.9, 0.95], "eps": 1.0, "weight_decay": 0.0}},
        **PRECISIONS[precision],
        "ds_megatron": {
            "model": model,
            "parallel": {"tp": tp, "pp": pp, "sequence_parallel": sp, "ep": int(ep.removeprefix("ep"))}
            | ({"expert_tp": tp} if layout in EXPERT_TP_LAYOUTS else {}),
            "train": {"seed": 1234, "train_iters": STEPS},
        },
    }


def expert_masters(engine, topo) -> dict[str, torch.Tensor]:
    """Every expert tensor's fp32 master as the single-device model holds it (collective): at ep > 1 the EP ranks'
    experts concatenated along dim 0; at ep 1 (and at expert_tp = tp > 1) the TP shards merged by the plan's rule."""
    masters = {}
    for name, param in engine.module.named_parameters():
        if ".experts." not in name:
            continue
        local = safe_get_full_fp32_param(param)
        if topo.ep > 1:
            local = gather_experts(local, topo.ep_group)
        if topo.tp > 1 and (topo.ep == 1 or topo.expert_tp > 1):
            parts = [torch.empty_like(local) for _ in range(topo.tp)]
            dist.all_gather(parts, local, group=topo.tp_group)
            dim, fused = EXPERT_SPLITS[name.rsplit(".", 1)[1]]
            local = unshard(parts, ShardRule(dim=dim, fused=fused))
        masters[name] = local.cpu()
    if topo.pp > 1:  # every stage's experts (their names are the pipeline's layer indices: distinct per stage)
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, masters)
        masters = {name: tensor for stage in stages for name, tensor in stage.items()}
    return masters


@contextlib.contextmanager
def recording_all_reduces(group, seen: list[str]):
    """Inside the block, the dtype of every all-reduce over ``group`` (None: none recorded) appended to ``seen``."""
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        if group is not None and kwargs.get("group", args[1] if len(args) > 1 else None) is group:
            seen.append(str(tensor.dtype).removeprefix("torch."))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield
    finally:
        dist.all_reduce = all_reduce


def gathered(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def train(case: str, out: str) -> None:
    run = resolve(config(case, int(os.environ["WORLD_SIZE"])), int(os.environ["WORLD_SIZE"]))
    try:
        built = build_engine(run)
    except ConfigError as err:  # raised on every rank alike
        if dist.get_rank() == 0:
            torch.save({"refused": str(err)}, os.path.join(out, f"{case}.pt"))
        return
    engine, topo = built.engine, built.topology
    before = expert_masters(engine, topo)
    losses, norms, sums = [], [], []
    for tokens in token_batches(STEPS, run.global_batch_size, run.model.seq_length, run.model.vocab_size):
        batches = micro_batches(tokens, run.micro_batch_size, run.dp, topo.data_coord)
        with recording_all_reduces(topo.expert_dp_group, sums):
            losses.append(gathered(float(engine.train_batch(iter(batches)))))
        norms.append(gathered(float(engine.get_global_grad_norm())))
    opt = engine.optimizer
    groups = [(is_moe_param_group(g), int(n)) for g, n in zip(opt.optimizer.param_groups, opt.partition_count)]
    result = {"losses": losses, "norms": norms, "groups": groups, "before": before, "expert_dp_sums": sums}
    result["after"] = expert_masters(engine, topo)
    result["optimizer"] = type(opt).__name__
    if case.split("-")[0] in EXPERT_TP_LAYOUTS:  # the save at expert_tp = tp, its files, its load
        client, directory = {"step": STEPS, "config": run.ds_config}, os.path.join(out, f"{case}-ckpt")
        save_run(engine, directory, STEPS, client, built.rng, topology=topo, parallel=built.parallel)
        result["saved"] = {k: full_state(engine, built, k) for k in (None, "exp_avg", "exp_avg_sq")}
        engine.train_batch(iter(batches))  # one more step moves every parameter; the load must bring them back
        load_run(engine, directory, built.rng, built.parallel, topo, run.ds_config)
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # the moments' links, else made at the next step
        result["loaded"] = {k: full_state(engine, built, k) for k in (None, "exp_avg", "exp_avg_sq")}
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, f"{case}.pt"))
    engine.destroy()


# name, layout, ep, the run whose step-2 checkpoint it loads (None: trains from step 0), the steps it saves
CHECKPOINT_RUNS = [
    ("ep2", "dp2", 2, None, (2,)),
    ("ep1", "dp2", 1, None, (2, 3)),
    ("ep2-resumed", "dp2", 2, "ep2", ()),  # the saved layout: bit for bit
    ("ep2-to-ep1", "dp2", 1, "ep2", ()),
    ("ep1-to-ep2", "dp2", 2, "ep1", ()),
    ("ep1-to-tp2sp-ep2", "tp2sp", 2, "ep1", (3,)),  # EP folded over the tp ranks, resharded on load
    # the ep 2 save loaded at ep 1 (DeepSpeed's own load) and saved again at once by DeepSpeed's own writer: the
    # files of an ep 1 run, which the next run resumes at ep 2
    ("ep2-to-ep1-saved", "dp2", 1, "ep2", (2,)),
    ("ep1-saved-to-ep2", "dp2", 2, "ep2-to-ep1-saved", ()),
]
CHECKPOINT_STEPS = 3


def full_state(engine, built, key: str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master (``key``: its Adam state of that name) as the single-device model holds it
    (collective; pp 1): experts over the EP group joined along dim 0, TP shards merged by the plan's rule."""
    parallel, topo = built.parallel, built.topology
    adapter, out = StateDictAdapter(parallel), {}
    if key is not None:  # DeepSpeed's ZeRO optimizer links the moments' fragments after its first group's first
        # step, when the other groups have none yet (they stay unlinked): link them again now that all exist
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for local, param in engine.module.named_parameters():
        name = pipeline_param_name(local, engine.module)
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
        expert = topo.ep > 1 and is_expert_param(name, parallel)
        if expert:  # the EP group's experts joined
            value = gather_experts(value, topo.ep_group)
        if not expert or topo.expert_tp > 1:  # TP shards merged (at tp 1 too: the merge strips the vocab padding)
            parts = [torch.empty_like(value) for _ in range(topo.tp)] if topo.tp > 1 else [value]
            if topo.tp > 1:
                dist.all_gather(parts, value.contiguous(), group=topo.tp_group)
            value = adapter.merge(name, parts)
        out[name] = value.cpu()
    return out


def checkpoint_run(precision: str, out: str, name: str, layout: str, ep: int, load: str | None, saves) -> None:
    world = int(os.environ["WORLD_SIZE"])
    cfg = config(f"{layout}-{precision}-ep{ep}", world)
    cfg["ds_megatron"]["train"]["train_iters"] = CHECKPOINT_STEPS
    run = resolve(cfg, world)
    built = build_engine(run)
    engine, topo = built.engine, built.topology
    start, result = 0, {"losses": [], "norms": []}
    if load is not None:
        directory = os.path.join(out, f"{precision}-{load}")
        start = load_run(engine, directory, built.rng, built.parallel, topo, run.ds_config)["step"]
    tokens = token_batches(CHECKPOINT_STEPS, run.global_batch_size, run.model.seq_length, run.model.vocab_size)

    def save(step: int) -> None:
        client = {"step": step, "config": run.ds_config}
        # step 2 under <precision>-<name> (what the others load), a later step beside it
        directory = os.path.join(out, f"{precision}-{name}" + ("" if step == 2 else f"-step{step}"))
        save_run(engine, directory, step, client, built.rng, topology=topo, parallel=built.parallel)
        if ep > 1 and load is None:  # what the files must hold
            result["saved"] = {k: full_state(engine, built, k) for k in (None, "exp_avg", "exp_avg_sq")}

    if start in saves:  # the loaded step, saved again before any step
        save(start)
    for step in range(start + 1, CHECKPOINT_STEPS + 1):
        batches = micro_batches(tokens[step - 1], run.micro_batch_size, run.dp, topo.data_coord)
        result["losses"].append(gathered(float(engine.train_batch(iter(batches)))))
        result["norms"].append(gathered(float(engine.get_global_grad_norm())))
        if step in saves:
            save(step)
    result["after"] = full_state(engine, built)
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, f"{precision}-{name}.pt"))
    engine.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="", help="comma-separated <layout>-<precision>-ep<N> (module docstring)")
    ap.add_argument("--checkpoints", default="", help="comma-separated PRECISION[:RUN+RUN...] (module docstring)")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    for case in filter(None, args.cases.split(",")):
        train(case, args.out)
    for entry in filter(None, args.checkpoints.split(",")):
        precision, _, names = entry.partition(":")
        for run in CHECKPOINT_RUNS:
            if not names or run[0] in names.split("+"):
                checkpoint_run(precision, args.out, *run)


if __name__ == "__main__":
    main()
