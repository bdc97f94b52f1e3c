"""Resume a checkpoint at another tensor/pipeline layout (weights *and* optimizer state).

Every save records, per rank, the full GPT name of each parameter in the optimizer's order
(``params_rank<r>.json``).  To resume at a new (tp, pp), each new rank takes, for every parameter it holds, the old
TP shards of the weight (from DeepSpeed's per-layer files) and of the Adam moments (from the old ranks'
``mp_rank_XX_model_states.pt``), merges them with the old shard rule and cuts its own shard with the new one: the same
one rule per parameter that builds the layers and exports to transformers.  The learning-rate schedule, step
counters and data position carry over; dropout RNG streams cannot (they depend on the layout).

Supported: the fp32 path (ds_megatron's AdamW, ZeRO 0), where DeepSpeed keeps the optimizer state per parameter.
bf16/ZeRO-1 keep flat, DP-partitioned fp32 copies; resuming those at another layout is refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.checkpoint.manifest import tag_config
from ds_megatron.config import resolve
from ds_megatron.config.facts import deepspeed_wraps_optimizer, saved_layout
from ds_megatron.model import GPTConfig
from ds_megatron.parallelize import ParallelPlan, shard_rule
from ds_megatron.pipeline import PipelineLayout, pipeline_param_name
from ds_megatron.tensor_parallel import shard, unshard


def model_param_groups(optimizer) -> list[list[torch.Tensor]]:
    """The model's parameters per optimizer group, in the order the optimizer holds them.

    On the fp32 path the optimizer's ``param_groups`` hold the model's parameters.  DeepSpeed's mixed-precision
    wrappers replace them with flat fp32 partitions and keep the model's (bf16/fp16) parameters elsewhere: the BF16
    optimizer in ``bf16_groups``, the ZeRO-1/2 optimizer in ``bit16_groups``, the fp16 optimizers in
    ``fp16_groups``.  The flat buffers are laid out in exactly this order, which is what makes them readable by name."""
    for attr in ("bf16_groups", "bit16_groups", "fp16_groups"):
        groups = getattr(optimizer, attr, None)
        if groups:
            return [list(g) for g in groups]
    return [list(g["params"]) for g in optimizer.param_groups]


def param_names_record(engine, topology) -> dict:
    """This rank's optimizer parameter order as full GPT names (written with every checkpoint)."""
    names = {id(p): pipeline_param_name(n, engine.module) for n, p in engine.module.named_parameters()}
    groups = [[names[id(p)] for p in g] for g in model_param_groups(engine.optimizer)]
    return {"tp_rank": topology.tp_rank, "pp_rank": topology.pp_rank, "dp_rank": topology.dp_rank, "groups": groups}


def _base_optimizer(engine):
    return engine.optimizer


class OldCheckpoint:
    """Read access to one tag of a checkpoint written at another layout."""

    def __init__(self, root: Path, tag: str):
        self.root, self.tag = root, tag
        cfg = tag_config(root, tag)
        if cfg is None:
            raise FileNotFoundError(f"error: --load: {root}/{tag} has no config.json; cannot reshard it")
        self.tp, self.pp, dp = saved_layout(cfg)
        self.run = resolve(cfg, self.tp * self.pp * dp)
        self.gpt = GPTConfig.from_shape(self.run.model)
        self.layout = PipelineLayout(self.gpt.n_layer)
        self.plan = ParallelPlan(self.gpt, None, 0, self.tp, False, None, self.run.section.parallel.vocab_multiple)
        self.where: dict[str, dict[int, tuple[int, int]]] = {}  # name -> {old tp rank: (mp file index, position)}
        for f in sorted((root / tag).glob("params_rank*.json")):
            rec = json.loads(f.read_text())
            if rec["dp_rank"] != 0:
                continue
            flat = [n for group in rec["groups"] for n in group]
            mp_index = rec["pp_rank"] * self.tp + rec["tp_rank"]
            for pos, name in enumerate(flat):
                self.where.setdefault(name, {}).setdefault(rec["tp_rank"], (mp_index, pos))
        self._states: dict[int, dict] = {}
        self._layers: dict[tuple[int, int], dict] = {}

    def client(self, mp_index: int = 0) -> dict:
        if mp_index not in self._states:
            f = self.root / self.tag / f"mp_rank_{mp_index:02d}_model_states.pt"
            self._states[mp_index] = torch.load(f, map_location="cpu", weights_only=False)
        return self._states[mp_index]

    def full_weight(self, name: str) -> torch.Tensor:
        idx = self.layout.index_of(name)
        parts = []
        for r in range(self.tp):
            if (idx, r) not in self._layers:
                f = self.root / self.tag / f"layer_{idx:02d}-model_{r:02d}-model_states.pt"
                self._layers[(idx, r)] = torch.load(f, map_location="cpu", weights_only=True)
            parts.append(self._layers[(idx, r)][self.layout.key_in_layer(name)])
        return self._merge(name, parts)

    def full_optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        where = self.where.get(name)
        if where is None or len(where) != self.tp:
            return None
        per_rank = []
        for r in range(self.tp):
            mp_index, pos = where[r]
            opt = self.client(mp_index)["optimizer"]
            per_rank.append(opt["state"].get(pos))
        if any(s is None for s in per_rank):
            return None
        out = {"step": per_rank[0]["step"]}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = self._merge(name, [s[key] for s in per_rank])
        return out

    def _merge(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        rule = shard_rule(name, self.plan)
        full = self.gpt.vocab_size if name.endswith("wte.weight") else None
        return unshard(parts, rule, full)


@torch.no_grad()
def load_resharded(engine, plan: ParallelPlan, topology, root: Path, tag: str) -> dict:
    """Collective.  Fill the engine (weights, AdamW state, LR schedule, counters) from a checkpoint written at
    another (tp, pp); returns its client state."""
    old = OldCheckpoint(root, tag)
    if deepspeed_wraps_optimizer(old.run.ds_config):
        raise ValueError(
            f"error: --load: resuming a bf16/ZeRO checkpoint at another layout is not supported (saved at tp "
            f"{old.tp} x pp {old.pp}); resume at that layout, or export and restart with --init-from-hf"
        )
    optimizer = _base_optimizer(engine)
    for local, param in engine.module.named_parameters():
        name = pipeline_param_name(local, engine.module)
        rule = shard_rule(name, plan)
        param.copy_(shard(old.full_weight(name), rule, plan.tp_rank, plan.tp_size))
        state = old.full_optimizer_state(name)
        if state is not None:
            optimizer.state[param] = {
                "step": state["step"].clone(),
                "exp_avg": shard(state["exp_avg"], rule, plan.tp_rank, plan.tp_size),
                "exp_avg_sq": shard(state["exp_avg_sq"], rule, plan.tp_rank, plan.tp_size),
            }
    client = old.client(0)
    # The current learning rate lives in the optimizer's param groups (the schedule writes it there each step).
    for group, saved in zip(optimizer.param_groups, client["optimizer"]["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if engine.lr_scheduler is not None and client.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(client["lr_scheduler"])
    engine.global_steps = client.get("global_steps", 0)
    engine.global_samples = client.get("global_samples", 0)
    engine.skipped_steps = client.get("skipped_steps", 0)
    dist.barrier()
    return {k: client[k] for k in ("step", "config", "wandb_run_id", "skipped") if k in client}
