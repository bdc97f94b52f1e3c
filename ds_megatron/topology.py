"""L1: the process layout, on DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model; model innermost,
so a TP group is consecutive ranks and stays inside a node).

One object owns the groups and ranks and is passed explicitly; there are no globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch.distributed import ProcessGroup


@dataclass
class ParallelTopology:
    """Ranks and groups of this process for a (tp, pp, dp) layout.  Build with :meth:`build` after
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

    @classmethod
    def build(cls, tp: int, pp: int, dp: int) -> ParallelTopology:
        world = dist.get_world_size()
        if tp * pp * dp != world:
            raise ValueError(f"tp({tp})*pp({pp})*dp({dp})={tp * pp * dp} != world size {world}")
        rank = dist.get_rank()
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        coord = topo.get_coord(rank)
        self = cls(tp, pp, dp, rank, topo, tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=coord.data)
        self.tp_group = _my_group(topo.get_axis_comm_lists("model"), rank)
        self.dp_group = _my_group(topo.get_axis_comm_lists("data"), rank)
        self.model_group = _my_group([topo.filter_match(data=d) for d in range(dp)], rank)
        return self

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank with side effects (console, wandb, exported files): last stage, dp 0, tp 0."""
        return self.is_last_stage and self.dp_rank == 0 and self.tp_rank == 0

    def describe(self) -> str:
        return f"rank {self.rank}: tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp}"


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
