"""What an expert-parallel run's save writes: the routed experts as an ep 1 run at the same tp holds them.

At ep > 1 each rank holds E / ep whole experts (``parallelize.local_experts``), and DeepSpeed's pipeline writes a
layer's file from data-parallel rank 0 only, which would keep only that rank's experts when the EP group spans the
data axis.  So for the length of the save, each expert parameter (and its Adam moments) is gathered over the EP group
into the stacked [E, ...] tensor, cut by the TP rule (``StateDictAdapter.saved_from_gathered``; at expert_tp = tp
the EP group's experts are already this TP rank's shards) and handed to DeepSpeed's own writer; afterwards the rank's
own experts are put back, the same tensor objects, untouched.

On DeepSpeed's BF16 optimizer (bf16 at ZeRO 0, bf16 + ZeRO-1) and its ZeRO optimizer (fp32 + ZeRO-1, bf16 + ZeRO-1
accumulating in bf16) the fp32 masters and Adam moments live in flat partitions, and at ep > 1 the experts sit in
groups of their own cut over the expert-DP group (``engine.expert_param_groups``).  For the save, every rank's
optimizer file is written as the same rank of the ep 1 run holds it instead: the groups of ``optim.param_groups``
(experts in model order among the others), each cut over the data axis as that optimizer cuts it
(``masters.zero_flat_layout``), this rank's partition filled parameter by parameter from the masters and moments
gathered over the group they are cut over (and the experts over the EP group).

The files are then those of the same run at ep 1: every reader (``--load`` at any ep, resharding on load and
offline, export) reads them as it reads any checkpoint, and the checkpoint does not depend on ep.  The choice against
DeepSpeed's own MoE checkpoints and what the save costs in memory and traffic: docs/checkpoints.md, "Expert-parallel
runs".
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param_group
from deepspeed.utils.tensor_fragment import fragment_address
from torch.distributed import ProcessGroup

from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.checkpoint.masters import MOMENTS, rank_padding, zero_flat_layout
from ds_megatron.config.ep_rules import check_ep_zero_options
from ds_megatron.config.facts import ZERO_OPTIMIZER
from ds_megatron.optim import param_groups
from ds_megatron.parallelize import ParallelContext, is_expert_param
from ds_megatron.pipeline_parallel.module import pipeline_param_name, zero_param_shapes_saved_as

# the keys of DeepSpeed's BF16 and ZeRO optimizers' state_dict (deepspeed.checkpoint.constants) replaced for the save
BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS = "base_optimizer_state", "single_partition_of_fp32_groups"
GROUP_PADDINGS, PARTITION_COUNT, PARAM_SLICE_MAPPINGS = "group_paddings", "partition_count", "param_slice_mappings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # the ZeRO optimizer's only
# keys DeepSpeed's MoE split adds to a parameter group (``split_params_into_different_moe_groups_for_optimizer``)
MOE_GROUP_KEYS = ("name", "moe")


def gather_experts(local: torch.Tensor, ep_group: ProcessGroup) -> torch.Tensor:
    """Collective over ``ep_group``: the stacked tensor of every expert, [E, ...], from each EP rank's [E / ep, ...]
    (EP rank i holds experts i E / ep .. (i + 1) E / ep - 1, so the parts are concatenated in group-rank order)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, local.contiguous(), group=ep_group)
    return torch.cat(parts, dim=0)


@contextlib.contextmanager
def experts_as_saved(engine, parallel: ParallelContext, writes: bool) -> Iterator[int]:
    """Collective over every EP group (every rank enters it).  On a rank that ``writes`` checkpoint files, inside,
    each expert parameter of ``engine.module`` holds its ep 1 TP shard (``saved_shard`` of the gathered experts) and
    the optimizer's state of it (Adam's moments; the step count is the same on every rank) likewise, in host memory
    (the writer copies to the host anyway); on exit both are this rank's own again, the same tensor objects.  A rank
    that writes nothing takes part in the gathers and keeps nothing.  On DeepSpeed's BF16 and ZeRO optimizers every
    rank's optimizer state is, inside, the ep 1 run's (``optimizer_as_saved``).  Yields the number of parameters
    swapped (0 at ep 1, where nothing changes)."""
    if parallel.ep.size == 1:
        yield 0
        return
    with contextlib.ExitStack() as stack:
        if hasattr(engine.optimizer, "single_partition_of_fp32_groups") or hasattr(engine.optimizer, "bf16_groups"):
            stack.enter_context(optimizer_as_saved(engine, parallel))  # first: it reads the experts' own shapes
        yield stack.enter_context(_expert_weights_as_saved(engine, parallel, writes))


@contextlib.contextmanager
def _expert_weights_as_saved(engine, parallel: ParallelContext, writes: bool) -> Iterator[int]:
    adapter, state = StateDictAdapter(parallel), engine.optimizer.state
    kept: list[tuple[torch.nn.Parameter, torch.Tensor, dict | None]] = []
    try:
        for local_name, param in engine.module.named_parameters():
            name = pipeline_param_name(local_name, engine.module)
            if name is None or not is_expert_param(name, parallel):
                continue
            # the torch optimizer's per-parameter state (none on the BF16 optimizer, whose state is by flat group)
            own = state.get(param)
            # the moments have the parameter's shape; the step count is a scalar
            moments = [k for k, v in (own or {}).items() if torch.is_tensor(v) and v.shape == param.shape]
            if not writes:  # take part in the gathers, keep nothing
                for t in [own[k] for k in moments] + [param.data]:
                    gather_experts(t, parallel.ep.group)
                continue

            def saved(t: torch.Tensor, name: str = name) -> torch.Tensor:
                return adapter.saved_from_gathered(name, gather_experts(t, parallel.ep.group)).cpu()

            swapped = {k: saved(own[k]) for k in moments}
            kept.append((param, param.data, own))
            param.data = saved(param.data)
            if own is not None:
                state[param] = {**own, **swapped}
        yield len(kept)
    finally:
        for param, data, own in kept:
            param.data = data
            if own is not None:
                state[param] = own


def _full_fp32(param: torch.Tensor, flat: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Collective over ``group`` (the ranks ``param``'s optimizer group is cut over): the whole fp32 value of
    ``param`` from ``flat`` (the group's fp32 partition, or a moment laid out like it), each rank adding the fragment
    it holds (``_hp_mapping``) to zeros: a sum of one value and zeros, exact."""
    full = torch.zeros(param.numel(), dtype=torch.float32, device=flat.device)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is not None:
        at, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        full.narrow(0, at, n).copy_(flat.narrow(0, mapping.hp_fragment_address.start, n))
    dist.all_reduce(full, group=group)
    return full.view(param.shape)


@torch.no_grad()
def ep1_optimizer_state(engine, parallel: ParallelContext) -> tuple[dict, list[OrderedDict]]:
    """Collective over the data axis, the expert-DP and the EP groups (every rank of the run calls it, at ep > 1
    on DeepSpeed's BF16 or ZeRO optimizer): this rank's optimizer ``state_dict`` as the same rank of the run at ep 1
    holds it, in host memory, and the parameter shapes of its groups in flat-buffer order (what DeepSpeed's ZeRO-1
    save records as ``param_shapes``).  The parameters are walked in module order, one at a time: each one's
    master and moments are gathered whole (over the group its optimizer group is cut over; an expert's then over
    the EP group and cut by the ep 1 TP rule), and the part inside this rank's ep 1 partition is kept."""
    opt, adapter, ep = engine.optimizer, StateDictAdapter(parallel), parallel.ep.size
    own = opt.state_dict()
    zero = not hasattr(opt, "bf16_groups")  # the ZeRO optimizer (stage_1_and_2), else the BF16 optimizer
    if zero:  # the config loader refuses the elastic layout; this guards direct callers, before any file is written
        check_ep_zero_options(ep, ZERO_OPTIMIZER, True, None, opt.elastic_checkpoint)
    lp_groups = opt.bit16_groups if zero else opt.bf16_groups
    hp_partitions = opt.single_partition_of_fp32_groups if zero else opt.fp32_groups_flat_partition
    groups_of = {id(p): i for i, group in enumerate(lp_groups) for p in group}
    element_size = lp_groups[0][0].element_size()
    dense = [i for i, g in enumerate(opt.optimizer.param_groups) if not is_moe_param_group(g)]
    data, rank = opt.partition_count[dense[0]], dist.get_rank(opt.real_dp_process_group[dense[0]])
    names = {id(p): n for n, p in engine.module.named_parameters()}
    ep1 = [[(names[id(p)], p) for p in g["params"] if id(p) in groups_of] for g in param_groups(engine.module, 0.0)]
    if len(ep1) != len(dense):
        raise RuntimeError(f"optimizer groups {len(dense)} outside the experts' against {len(ep1)} at ep 1")
    experts = {}  # local name -> full name, for the experts (the others' shards do not depend on ep)
    for local in names.values():
        name = pipeline_param_name(local, engine.module)
        if name is not None and is_expert_param(name, parallel):
            experts[local] = name
    shapes = [OrderedDict() for _ in ep1]
    for k, group in enumerate(ep1):
        for local, p in group:
            if local in experts:  # the ep 1 TP shard of all E experts
                meta = torch.empty((p.shape[0] * ep, *p.shape[1:]), device="meta")
                shapes[k][local] = adapter.saved_from_gathered(experts[local], meta).shape
            else:
                shapes[k][local] = p.shape
    state = opt.optimizer.state
    stepped = all(hp in state for hp in hp_partitions)  # Adam's state exists after a first step
    keys = ("master", *MOMENTS) if stepped else ("master",)
    partitions, paddings, mappings, aligned = [], [], [], []
    for k, group in enumerate(ep1):
        # the BF16 optimizer has neither of the ZeRO optimizer's layout options
        options = (getattr(opt, "round_robin_gradients", False), getattr(opt, "parameter_alignment", False))
        numels = [s.numel() for s in shapes[k].values()]
        order, size, padding, fragments, after = zero_flat_layout(numels, data, *options, element_size)
        shapes[k] = OrderedDict(list(shapes[k].items())[i] for i in order)
        part = {key: torch.zeros(size, dtype=torch.float32) for key in keys}
        mapping = OrderedDict()
        for (local, p), pieces in zip(group, fragments):
            i = groups_of[id(p)]
            hp = hp_partitions[i]
            for key in keys:
                value = _full_fp32(p, hp if key == "master" else state[hp][key], opt.real_dp_process_group[i])
                if local in experts:
                    value = adapter.saved_from_gathered(experts[local], gather_experts(value, parallel.ep.group))
                flat = value.reshape(-1)
                for d, at, start, n in pieces:
                    if d == rank:
                        part[key].narrow(0, start, n).copy_(flat.narrow(0, at, n))
            for d, _, start, n in pieces:
                if d == rank:
                    mapping[local] = fragment_address(numel=n, start=start)
        partitions.append(part)
        paddings.append(rank_padding(size, padding, data, rank) if zero else padding if rank == data - 1 else 0)
        mappings.append(mapping)
        aligned.append(after)
    base = own[BASE_OPTIMIZER_STATE]
    step = base["state"][0]["step"] if stepped else None
    masters = [p["master"] for p in partitions]
    if zero:  # the ZeRO optimizer writes its masters without their padding
        masters = [m.narrow(0, 0, m.numel() - pad) for m, pad in zip(masters, paddings)]
    saved = {
        **own,
        BASE_OPTIMIZER_STATE: {
            "state": {k: {"step": step.clone(), **{m: p[m] for m in MOMENTS}} for k, p in enumerate(partitions)}
            if stepped
            else {},
            "param_groups": [
                {**{key: v for key, v in base["param_groups"][i].items() if key not in MOE_GROUP_KEYS}, "params": [k]}
                for k, i in enumerate(dense)
            ],
        },
        SINGLE_PARTITION_OF_FP32_GROUPS: masters,
        GROUP_PADDINGS: paddings,
        PARTITION_COUNT: [data] * len(ep1),
        PARAM_SLICE_MAPPINGS: mappings,
    }
    if zero:
        saved[PARAM_ALIGNMENT_PADDINGS] = aligned
    return saved, shapes


@contextlib.contextmanager
def optimizer_as_saved(engine, parallel: ParallelContext) -> Iterator[None]:
    """Collective (every rank enters it, at ep > 1 on DeepSpeed's BF16 or ZeRO optimizer): inside, the optimizer's
    ``state_dict`` (which DeepSpeed's save writes into this rank's ``[bf16_]zero_pp_rank`` file and, on the BF16
    optimizer at ZeRO 0, data rank 0's into the ``mp_rank`` file) and the engine's ``param_shapes`` are the ep 1 run's
    (``ep1_optimizer_state``); on exit the optimizer and engine are untouched."""
    saved, shapes = ep1_optimizer_state(engine, parallel)
    engine.optimizer.state_dict = lambda: saved
    try:
        with zero_param_shapes_saved_as(engine, shapes):
            yield
    finally:
        del engine.optimizer.state_dict  # the instance entry: the class's own method again
