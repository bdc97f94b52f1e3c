"""Resume a checkpoint at another tensor/pipeline/data-parallel layout (weights *and* optimizer state), on load.
Each new rank takes, for every parameter it holds (by the full names each save records per rank in
``params_rank<r>.json``), the old TP shards of the weight and of the Adam moments, merges them with the old shard rule
and cuts its own with the new one.  fp32: Adam state per parameter from the old ``mp_rank_XX_model_states.pt``; bf16
and DeepSpeed's ZeRO optimizer: masters and moments from the flat partitions (``masters.py``), written into the new
engine's at each fragment's address, the 16-bit copy set to the master rounded.  What carries over and what cannot
(dropout's RNG streams), and what is refused: docs/checkpoints.md, "Resuming at another layout".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_megatron.checkpoint import safe_load
from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.checkpoint.layout import pipeline_layout, run_model_config, shard_context
from ds_megatron.checkpoint.manifest import tag_config
from ds_megatron.checkpoint.masters import MasterWeights
from ds_megatron.config import ConfigError, resolve
from ds_megatron.config.facts import data_axis, precision, saved_cp, saved_layout, saved_world
from ds_megatron.optim import param_groups
from ds_megatron.parallelize import ParallelContext
from ds_megatron.pipeline_parallel.module import pipeline_param_name


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
    """This rank's optimizer parameter order as full GPT names (written with every checkpoint).  An optimizer with
    expert groups of its own (DeepSpeed's BF16 or ZeRO optimizer at ep > 1) is recorded as the ep 1 run's, whose
    order its save writes (``ep_state.optimizer_as_saved``): the groups of ``optim.param_groups``."""
    names = {id(p): pipeline_param_name(n, engine.module) for n, p in engine.module.named_parameters()}
    groups = model_param_groups(engine.optimizer)
    if any(g.get("moe", False) for g in engine.optimizer.param_groups):
        optimized = {id(p) for g in groups for p in g}
        groups = [[p for p in g["params"] if id(p) in optimized] for g in param_groups(engine.module, 0.0)]
    groups = [[names[id(p)] for p in g] for g in groups]
    ranks = {"tp_rank": topology.tp_rank, "pp_rank": topology.pp_rank, "dp_rank": topology.dp_rank}
    return {**ranks, "cp_rank": topology.cp_rank, "groups": groups}


class OldCheckpoint:
    """Read access to one tag of a checkpoint written at another layout: full (unsharded) fp32 weights and Adam
    states by full GPT name.

    Files are read weights-only (``safe_load``; ``trust`` lifts that) and memory-mapped: a tensor's pages are read
    when it is used, and only the current pipeline layer's files stay open, so a caller walking the parameters in
    pipeline order holds about one full parameter (and its Adam moments) at a time."""

    def __init__(self, root: Path, tag: str, trust: bool = False):
        self.root, self.tag, self.trust = root, tag, trust
        cfg = tag_config(root, tag)
        if cfg is None:
            raise ConfigError("--load", "no config.json, cannot reshard", f"{root}/{tag}", "resume at the saved layout")
        self.tp, self.pp, _ = saved_layout(cfg)
        # The optimizer files hold one partition per rank of DeepSpeed's data axis (dp x cp): a cp change is only a
        # change in their number, which the readers below take from the files.
        self.cp, self.data_axis = saved_cp(cfg), data_axis(cfg)
        self.run = resolve(cfg, saved_world(cfg))
        self.model_config = run_model_config(self.run)
        self.layout = pipeline_layout(self.model_config)
        self.parallel = shard_context(self.model_config, self.run, self.tp)
        self.adapter = StateDictAdapter(self.parallel)
        self.masters = MasterWeights.open(root / tag, self.tp, self.layout, trust=trust)  # None on the fp32 path
        self.where: dict[str, dict[int, tuple[int, int]]] = {}  # name -> {old tp rank: (mp file index, position)}
        for f in sorted((root / tag).glob("params_rank*.json")):
            rec = json.loads(f.read_text())
            if rec["dp_rank"] != 0 or rec.get("cp_rank", 0) != 0:  # every data rank holds the same order
                continue
            flat = [n for group in rec["groups"] for n in group]
            mp_index = rec["pp_rank"] * self.tp + rec["tp_rank"]
            for pos, name in enumerate(flat):
                self.where.setdefault(name, {}).setdefault(rec["tp_rank"], (mp_index, pos))
        self._states: dict[int, dict] = {}
        self._layers: dict[tuple[int, int], dict] = {}
        self._stages: dict[int, int] = {}

    def client(self, mp_index: int = 0) -> dict:
        """DeepSpeed's ``mp_rank_XX_model_states.pt`` (counters, schedule, our client state; on the fp32 path the
        optimizer's per-parameter state too, memory-mapped)."""
        if mp_index not in self._states:
            f = self.root / self.tag / f"mp_rank_{mp_index:02d}_model_states.pt"
            self._states[mp_index] = safe_load.load(f, trust=self.trust, mmap=True)
        return self._states[mp_index]

    def layer_file(self, idx: int, tp_rank: int) -> dict[str, torch.Tensor]:
        """The per-layer file of layer ``idx`` written by ``tp_rank`` (memory-mapped; only the current layer's
        files are kept)."""
        if (idx, tp_rank) not in self._layers:
            if any(i != idx for i, _ in self._layers):
                self._layers.clear()
            f = self.root / self.tag / f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"
            self._layers[(idx, tp_rank)] = safe_load.load(f, trust=self.trust, mmap=True)
        return self._layers[(idx, tp_rank)]

    def _layer_shards(self, name: str) -> list[torch.Tensor]:
        """This parameter's tensors in the per-layer files, one per old TP rank (the model copy: bf16 under bf16)."""
        idx, key = self.layout.index_of(name), self.layout.key_in_layer(name)
        return [self.layer_file(idx, r)[key] for r in range(self.tp)]

    def _master_shards(self, name: str, state_key: str | None) -> list[torch.Tensor]:
        idx, key = self.layout.index_of(name), self.layout.key_in_layer(name)
        if idx not in self._stages:
            self._stages[idx] = self.masters.stage_of(idx, key)
        stage = self._stages[idx]
        shapes = [t.shape for t in self._layer_shards(name)]
        return [self.masters.find(idx, key, r, stage, state_key).view(shapes[r]) for r in range(self.tp)]

    def full_shape(self, name: str) -> torch.Size:
        """The full parameter's shape (vocabulary padding stripped), from the shards' shapes alone."""
        return self._merge(name, [torch.empty(t.shape, device="meta") for t in self._layer_shards(name)]).shape

    def full_weight(self, name: str) -> torch.Tensor:
        """The full fp32 weight: the master under bf16, the per-layer files' tensor on the fp32 path."""
        if self.masters is not None:
            return self._merge(name, self._master_shards(name, None))
        return self._merge(name, self._layer_shards(name))

    def full_optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """{"step", "exp_avg", "exp_avg_sq"} of the full parameter, or None before the first optimizer step."""
        if self.masters is not None:
            step = self.masters.optimizer_step()
            if step is None:
                return None
            moments = {k: self._merge(name, self._master_shards(name, k)) for k in ("exp_avg", "exp_avg_sq")}
            return {"step": step, **moments}
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
        """The full fp32 tensor of ``name`` from its old TP shards; the old shard rule strips any vocabulary padding
        (whose size depends on the old tp), so the new layout's rule pads it afresh."""
        return self.adapter.merge(name, [p.float() for p in parts])


def _fill_fp32_optimizer(engine, parallel: ParallelContext, old: OldCheckpoint) -> None:
    """ds_megatron's AdamW: the model's parameters are the optimizer's, with per-parameter state."""
    optimizer, adapter = engine.optimizer, StateDictAdapter(parallel)
    for local, param in engine.module.named_parameters():
        name = pipeline_param_name(local, engine.module)
        param.copy_(adapter.shard(name, old.full_weight(name)))
        state = old.full_optimizer_state(name)
        if state is not None:
            optimizer.state[param] = {
                "step": state["step"].clone(),
                "exp_avg": adapter.shard(name, state["exp_avg"]),
                "exp_avg_sq": adapter.shard(name, state["exp_avg_sq"]),
            }


def _fill_partitioned_optimizer(engine, parallel: ParallelContext, old: OldCheckpoint) -> None:
    """DeepSpeed's BF16 (or ZeRO-1) optimizer: each model parameter owns a fragment (``_hp_mapping``: where it
    starts in the parameter and in this data-parallel rank's flat fp32 partition) of its group's partition; the Adam
    moments are flat tensors laid out like the partition.  Every rank also sets its full 16-bit model copy."""
    optimizer, adapter = engine.optimizer, StateDictAdapter(parallel)
    names = {id(p): pipeline_param_name(n, engine.module) for n, p in engine.module.named_parameters()}
    partitions = getattr(optimizer, "fp32_groups_flat_partition", None) or optimizer.single_partition_of_fp32_groups
    for group, hp in zip(model_param_groups(optimizer), partitions):
        moments = {k: torch.zeros_like(hp) for k in ("exp_avg", "exp_avg_sq")}
        step = None
        for lp in group:
            name = names[id(lp)]
            weight = adapter.shard(name, old.full_weight(name))
            lp.data.copy_(weight.to(lp.dtype))
            state = old.full_optimizer_state(name)
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:  # no fragment of this parameter lives in this data-parallel rank's partition
                continue
            lp_at, hp_at = mapping.lp_fragment_address.start, mapping.hp_fragment_address.start
            n = mapping.lp_fragment_address.numel
            hp.data.narrow(0, hp_at, n).copy_(weight.reshape(-1).narrow(0, lp_at, n))
            if state is not None:
                step = state["step"]
                for k, flat in moments.items():
                    part = adapter.shard(name, state[k]).reshape(-1)
                    flat.narrow(0, hp_at, n).copy_(part.narrow(0, lp_at, n))
        if step is not None:
            optimizer.optimizer.state[hp] = {"step": step.clone(), **moments}
    # The optimizer links each fragment to its slice of the moments lazily, at its next step.
    optimizer._hp_optimizer_states_linked = False


@torch.no_grad()
def load_resharded(engine, parallel: ParallelContext, topology, root: Path, tag: str) -> dict:
    """Collective.  Fill the engine (weights, fp32 masters, Adam state, LR schedule, counters) from a checkpoint
    written at another layout; returns its client state."""
    old = OldCheckpoint(root, tag)
    if precision(old.run.ds_config) == "fp16":
        raise ConfigError("--load", "fp16 checkpoints resume only at their own layout", f"{root}/{tag}", "resume there")
    if hasattr(engine.optimizer, "bf16_groups") or hasattr(engine.optimizer, "bit16_groups"):
        _fill_partitioned_optimizer(engine, parallel, old)
    else:
        _fill_fp32_optimizer(engine, parallel, old)
    client = old.client(0)
    # The current learning rate lives in the optimizer's param groups (the schedule writes it there each step).
    saved_groups = (client.get("optimizer") or {}).get("param_groups") or []
    for group, saved in zip(engine.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if engine.lr_scheduler is not None and client.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(client["lr_scheduler"])
    engine.global_steps = client.get("global_steps", 0)
    engine.global_samples = client.get("global_samples", 0)
    engine.skipped_steps = client.get("skipped_steps", 0)
    dist.barrier()
    return {k: client[k] for k in ("step", "config", "wandb_run_id", "skipped", "resharded_from") if k in client}
