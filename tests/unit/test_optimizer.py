"""The optimizer every training path hands its parameters to is torch's fused AdamW: fp32 (ds_megatron's clipping
AdamW on the parameters), bf16 + ZeRO-1 with fp32 accumulation (DeepSpeed's BF16 optimizer over fp32 master
partitions) and bf16 without it (DeepSpeed's ZeRO optimizer).  fp16 is refused by DeepSpeed's CPU accelerator; it
takes the same ``adamw_kwargs``.  Each engine is the recipe's (``build_engine``), one process, here in the test."""

from __future__ import annotations

import pytest
import torch
from engine_here import one_process_engine
from test_data_training import TINY

from ds_megatron.config import load_json, resolve


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (each holds the one it wraps as ``.optimizer``)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@pytest.mark.parametrize(
    "precision",
    [
        {},
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    ],
    ids=["fp32", "bf16-zero1-fp32-accumulation", "bf16-zero1"],
)
def test_every_path_steps_with_fused_adamw(monkeypatch, precision):
    cfg = load_json(TINY)
    cfg["ds_megatron"]["parallel"].update(tp=1, pp=1)
    cfg.update(precision)
    # DeepSpeed's BF16 optimizer prints the memory in use four times while it builds, each after a full
    # gc.collect() (0.2-0.4 s apiece in a test session's heap); what it prints is no part of what this test checks
    from deepspeed.runtime import bf16_optimizer

    monkeypatch.setattr(bf16_optimizer, "see_memory_usage", lambda *args, **kwargs: None)
    with one_process_engine(resolve(cfg, 1), monkeypatch) as built:
        inner = _torch_optimizer(built.engine.optimizer)
        assert all(group["fused"] for group in inner.param_groups), type(built.engine.optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        assert params and all(p.dtype == torch.float32 for p in params)  # the fp32 masters (or parameters)
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.ones_like(p)
        inner.step()  # the fused kernel takes what this path hands it
        assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_the_schedule_resumes_across_a_change_in_group_count():
    """An expert-parallel run on DeepSpeed's BF16 optimizer holds its experts in parameter groups of their own, ep 1
    does not: the schedule's state saved at one count of groups loads at another (every group built from the same
    rate takes it, at the saved step), and saved rates that differ with the count changed are refused."""
    from ds_megatron.config.schedule import WarmupCosine
    from ds_megatron.optim import WarmupCosineScheduler

    schedule = WarmupCosine(warmup_steps=2, total_steps=10)

    def scheduler(groups: int) -> WarmupCosineScheduler:
        params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
        return WarmupCosineScheduler(torch.optim.AdamW(params, lr=0.5), schedule)

    saved = scheduler(2)
    for _ in range(3):
        saved.step()
    for groups in (3, 1):
        loaded = scheduler(groups)
        loaded.load_state_dict(saved.state_dict())
        assert loaded.get_last_lr() == [saved.get_last_lr()[0]] * groups and loaded.steps_done == 3
    with pytest.raises(ValueError, match="saved base learning rates"):
        scheduler(3).load_state_dict({"steps_done": 3, "base_lrs": [0.5, 0.25]})
