"""L3: optimizer construction and the TP/PP-correct gradient norm.

ds_megatron builds the optimizer itself (torch AdamW from the DeepSpeed config's ``optimizer`` section) so that no
DeepSpeed op has to be compiled and so that the fp32 path gets a correct gradient norm: DeepSpeed's fp32 clipping
(``clip_grad_norm_`` with the pipeline grid as mpu) decides "count replicated parameters on model-parallel rank 0"
with the *pipe x model* rank, so with pp > 1 it drops the replicated parameters (LayerNorms, biases) of every stage
but the first (measured on the 4-layer test model at pp 2: 2.1643 against the true 2.1743).  Under bf16/fp16/ZeRO,
DeepSpeed's optimizer wrappers compute the norm with the tensor-parallel rank and skip pipe-replicated copies, so
there DeepSpeed clips.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from torch import nn

from ds_megatron.config.schedule import WarmupCosine
from ds_megatron.tensor_parallel import is_tp_sharded
from ds_megatron.topology import ParallelTopology


def counts_in_norm(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``p`` contributes to the global gradient norm: TP shards always, replicated
    parameters on TP rank 0 only, and the second copy of a pipeline-tied parameter never."""
    if getattr(p, "ds_pipe_replicated", False):
        return False
    return is_tp_sharded(p) or tp_rank == 0


def global_grad_norm(params: Iterable[torch.Tensor], topology: ParallelTopology) -> torch.Tensor:
    """L2 norm of the full model's gradient (each parameter counted once), identical on every rank.

    Call after the data-parallel all-reduce (gradients then match across DP ranks).  Expert parameters split over
    an EP group (DeepSpeed's mark, ``is_moe_param``) are summed over that group first: it holds each of the stage's
    experts once, and after the expert-DP reduction every EP group of the stage holds the same sum, which TP rank 0
    of each stage then adds (the model group sums the stages).  At expert_tp = tp each tp rank's EP group holds its
    own slice of every expert, so every tp rank adds its sum (the model group sums them over tp too)."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    expert_sq = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        if is_moe_param(p):
            expert_sq += p.grad.detach().float().pow(2).sum()
        elif counts_in_norm(p, topology.tp_rank):
            sq += p.grad.detach().float().pow(2).sum()
    if topology.ep > 1:
        if topology.ep_group is not None:
            dist.all_reduce(expert_sq, group=topology.ep_group)
        if topology.tp_rank == 0 or topology.expert_tp > 1:
            sq += expert_sq
    if topology.model_group is not None:
        dist.all_reduce(sq, group=topology.model_group)
    return sq.sqrt()


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linears, embeddings); none on biases and LayerNorm parameters (GPT-3 practice)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that first computes the global gradient norm with ``grad_norm_fn`` (stored as ``_global_grad_norm``,
    which DeepSpeed's engine reports) and clips to ``max_norm`` (0 disables clipping)."""

    def __init__(self, params, *, grad_norm_fn: Callable[[], torch.Tensor], max_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self._grad_norm_fn = grad_norm_fn
        self._max_norm = max_norm
        self._global_grad_norm: float | None = None
        self.skipped_steps = 0
        # DeepSpeed's engine reads ``overflow`` after each step: True skips the learning-rate schedule's step too
        # (as on the bf16/fp16 paths), so a skipped update does not consume a step of warm-up or decay.
        self.overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        norm = self._grad_norm_fn()
        self._global_grad_norm = float(norm)
        self.overflow = not bool(torch.isfinite(norm).all())
        if self.overflow:  # non-finite gradients: skip the update (counted, logged by the recipe)
            self.skipped_steps += 1
            return None
        if self._max_norm > 0:
            coef = torch.clamp(self._max_norm / (norm + 1e-6), max=1.0)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(coef.to(p.grad.device))
        return super().step(closure)


def adamw_kwargs(ds_optimizer: dict | None) -> dict:
    """torch AdamW keyword arguments from DeepSpeed's ``optimizer`` section (type Adam or AdamW).

    ``fused``: torch's one-kernel AdamW (CPU and CUDA), on every path: the fp32 parameters themselves, or the fp32
    master partitions DeepSpeed's BF16/fp16/ZeRO wrappers hand the optimizer.  Its update equals the for-each one
    within fp32 rounding (2.4e-7 at most over six steps of 8.4M parameters), and one kernel replaces the for-each
    path's dozen passes over the parameters and both moments."""
    ds_optimizer = ds_optimizer or {"type": "AdamW", "params": {}}  # its type was checked by config.resolve
    p = dict(ds_optimizer.get("params", {}))
    return {
        "lr": float(p.get("lr", 1e-3)),
        "betas": tuple(p.get("betas", (0.9, 0.999))),
        "eps": float(p.get("eps", 1e-8)),
        "weight_decay": float(p.get("weight_decay", 0.0)),
        "fused": True,
    }


class WarmupCosineScheduler:
    """The learning-rate schedule of ``config.schedule.WarmupCosine`` applied to an optimizer's param groups.

    DeepSpeed calls ``step()`` after every applied optimizer step and saves/loads ``state_dict()`` with each
    checkpoint.  ``steps_done`` counts the optimizer steps taken; the groups always hold the learning rate of the
    *next* step (so ``engine.get_lr()`` read before a step is the rate that step uses)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: WarmupCosine):
        self.optimizer, self.schedule = optimizer, schedule
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.steps_done = 0
        self._apply()

    def _apply(self) -> None:
        ratio = self.schedule.ratio(self.steps_done + 1)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * ratio

    def step(self, *_args, **_kwargs) -> None:
        self.steps_done += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        """A state saved with another number of parameter groups (an expert-parallel run on DeepSpeed's BF16
        optimizer keeps its experts in groups of their own, ep 1 does not) holds one rate for all of them
        (``param_groups`` builds every group from the same one), which every group here takes."""
        saved = [float(x) for x in state["base_lrs"]]
        if len(saved) != len(self.optimizer.param_groups):
            if len(set(saved)) != 1:
                raise ValueError(f"{len(saved)} saved base learning rates {saved} for {len(self.base_lrs)} groups")
            saved = saved[:1] * len(self.optimizer.param_groups)
        self.steps_done, self.base_lrs = int(state["steps_done"]), saved
        self._apply()
