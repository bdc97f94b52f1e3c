"""What an expert-parallel run's save writes: the routed experts as an ep 1 run at the same tp holds them.

At ep > 1 each rank holds E / ep whole experts (``parallelize.local_experts``), and DeepSpeed's pipeline writes a
layer's file from data-parallel rank 0 only, which would keep only that rank's experts when the EP group spans the
data axis.  So for the length of the save, each expert parameter (and its Adam moments) is gathered over the EP group
into the stacked [E, ...] tensor, cut by the TP rule (``StateDictAdapter.saved_shard``) and handed to DeepSpeed's own
writer; afterwards the rank's own experts are put back, the same tensor objects, untouched.  The files are then those
of the same run at ep 1: every reader (``--load`` at any ep, resharding on load and offline, export) reads them as it
reads any checkpoint, and the checkpoint does not depend on ep.  The choice against DeepSpeed's own MoE checkpoints
and what the save costs in memory: docs/checkpoints.md, "Expert-parallel runs".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_megatron.checkpoint.adapter import StateDictAdapter
from ds_megatron.parallelize import ParallelContext, is_expert_param
from ds_megatron.pipeline_parallel.module import pipeline_param_name


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
    that writes nothing takes part in the gathers and keeps nothing.  Yields the number of parameters swapped (0 at
    ep 1, where nothing changes)."""
    if parallel.ep.size == 1:
        yield 0
        return
    adapter, state = StateDictAdapter(parallel), engine.optimizer.state
    kept: list[tuple[torch.nn.Parameter, torch.Tensor, dict | None]] = []
    try:
        for local_name, param in engine.module.named_parameters():
            name = pipeline_param_name(local_name, engine.module)
            if name is None or not is_expert_param(name, parallel):
                continue
            own = state.get(param)
            # the moments have the parameter's shape; the step count is a scalar
            moments = [k for k, v in (own or {}).items() if torch.is_tensor(v) and v.shape == param.shape]
            if not writes:  # take part in the gathers, keep nothing
                for t in [own[k] for k in moments] + [param.data]:
                    gather_experts(t, parallel.ep.group)
                continue

            def saved(t: torch.Tensor, name: str = name) -> torch.Tensor:
                return adapter.saved_shard(name, gather_experts(t, parallel.ep.group)).cpu()

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
