"""L1: the process layout, on DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model; model innermost,
so a TP group is consecutive ranks and stays inside a node).

Context parallelism (CP) is folded into DeepSpeed's data axis: DeepSpeed is given ``num_dp = dp * cp`` and data
coordinate ``d = dp_rank * cp + cp_rank``, so the rank order is tp innermost, then cp, then dp, then pp (a TP x CP
block is consecutive ranks and stays inside a node when it fits).  CP ranks hold the same weights and see different
tokens of the same sequences, which is what data-parallel replicas are to DeepSpeed: its gradient average over the
data axis (dp x cp ranks) averages the CP ranks too, and ZeRO-1 partitions over dp x cp.  ``dp`` / ``dp_rank`` here
keep their meaning, the true data-parallel replicas (which samples a rank reads).

One object owns the groups and ranks and is passed explicitly; there are no globals.  A layer that works over one
axis takes that axis as a :class:`Group` (process group, this rank, size): ``tp_axis``, ``cp_axis``, ``ep_axis``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:  # deepspeed is imported by ``build`` only: the layers that take a ``Group`` need no deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class Group:
    """This rank's place on one parallel axis (tp, cp, ep): the process group (None with one rank: every collective
    over it is then a no-op), this rank's index in it and its size."""

    group: ProcessGroup | None = None
    rank: int = 0
    size: int = 1


@dataclass
class ParallelTopology:
    """Ranks and groups of this process for a (tp, cp, pp, dp) layout.  Build with :meth:`build` after
    ``torch.distributed`` is initialised; every rank must build the same layouts in the same order."""

    tp: int
    pp: int
    dp: int
    rank: int
    ds_topology: PipeModelDataParallelTopology
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: ProcessGroup | None = field(default=None, repr=False)
    dp_group: ProcessGroup | None = field(default=None, repr=False)
    model_group: ProcessGroup | None = field(default=None, repr=False)  # all pp x tp ranks holding one model replica
    cp: int = 1
    cp_rank: int = 0
    # The CP ranks of one replica: same pipe stage, same dp_rank, same TP coordinate (None when cp is 1).
    cp_group: ProcessGroup | None = field(default=None, repr=False)
    # DeepSpeed's data axis (dp x cp ranks, what it averages gradients over) is ``ds_topology``'s "data" axis;
    # ``dp_group`` is the true data-parallel replicas only (same cp_rank).
    # Expert parallelism (set by ``expert_parallel.dispatch.attach_ep_groups``; ep 1: none): this rank's EP group
    # (the ranks splitting its routed experts), its expert-DP group (the ranks holding the same experts), and what
    # the expert-DP sum of expert gradients is divided by (dp x cp); ``expert_tp``: the ranks each expert's width
    # is split over at ep > 1 (1: whole experts; tp: expert tensor parallelism, ``expert_parallel.layout``).
    ep: int = 1
    ep_group: ProcessGroup | None = field(default=None, repr=False)
    expert_dp_group: ProcessGroup | None = field(default=None, repr=False)
    expert_grad_divisor: int = 1
    expert_tp: int = 1

    @classmethod
    def build(cls, tp: int, pp: int, dp: int, cp: int = 1) -> ParallelTopology:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        world = dist.get_world_size()
        if tp * cp * pp * dp != world:
            raise ValueError(f"tp({tp})*cp({cp})*pp({pp})*dp({dp})={tp * cp * pp * dp} != world size {world}")
        rank = dist.get_rank()
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
        coord = topo.get_coord(rank)
        dp_rank, cp_rank = divmod(coord.data, cp)
        self = cls(tp, pp, dp, rank, topo, tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=dp_rank)
        self.cp, self.cp_rank = cp, cp_rank
        self.tp_group = _my_group(topo.get_axis_comm_lists("model"), rank)
        # Each data-axis line (fixed pipe, model) holds dp x cp ranks in data order d = dp_rank * cp + cp_rank.
        lines = topo.get_axis_comm_lists("data")
        self.cp_group = _my_group([line[i * cp : (i + 1) * cp] for line in lines for i in range(dp)], rank)
        self.dp_group = _my_group([line[c::cp] for line in lines for c in range(cp)], rank)
        self.model_group = _my_group([topo.filter_match(data=d) for d in range(dp * cp)], rank)
        return self

    @property
    def tp_axis(self) -> Group:
        return Group(self.tp_group, self.tp_rank, self.tp)

    @property
    def cp_axis(self) -> Group:
        return Group(self.cp_group, self.cp_rank, self.cp)

    @property
    def ep_axis(self) -> Group:
        """The EP group once ``expert_parallel.dispatch.attach_ep_groups`` has set it (ep 1: no group, rank 0)."""
        return Group(self.ep_group, dist.get_rank(self.ep_group) if self.ep_group is not None else 0, self.ep)

    @property
    def data_coord(self) -> int:
        """This rank's coordinate on DeepSpeed's data axis (dp_rank * cp + cp_rank)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank with side effects (console, wandb, exported files): last stage, dp 0, cp 0, tp 0."""
        return self.is_last_stage and self.dp_rank == 0 and self.cp_rank == 0 and self.tp_rank == 0

    def describe(self) -> str:
        return (
            f"rank {self.rank}: tp {self.tp_rank}/{self.tp} cp {self.cp_rank}/{self.cp} pp {self.pp_rank}/{self.pp} "
            f"dp {self.dp_rank}/{self.dp}" + (f" ep {self.ep}" if self.ep > 1 else "")
        )


def _my_group(rank_lists: list[list[int]], rank: int) -> ProcessGroup | None:
    """Create every group in ``rank_lists`` (collective: all ranks call new_group for each) and return ours."""
    mine = None
    for ranks in rank_lists:
        if len(ranks) == 1:  # a group of one needs no communicator; collectives return early on None
            continue
        group = dist.new_group(ranks=sorted(ranks))
        if rank in ranks:
            mine = group
    return mine
