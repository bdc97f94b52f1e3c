"""The learning-rate schedule of the GPT-3 recipe (Brown et al. 2020, appendix B): linear warm-up, then cosine
decay to a floor.  Pure Python: the formula lives here once and is used by the optimizer wrapper, the tests and the
docs.

Step numbers are optimizer steps counted from 1 (the number logged with each step).  With warm-up length W,
decay end T, peak learning rate lr and ratios w0 (``warmup_min_ratio``) and c (``cos_min_ratio``):

    step k <= W:  lr * (w0 + (1 - w0) * k / W)                      (step 1 already trains: lr * (w0 + (1-w0)/W))
    step k >  W:  lr * (c + (1 - c) * (1 + cos(pi * min(1, (k - W) / (T - W)))) / 2)   (lr at k = W, c*lr from T on)

A DeepSpeed config's ``scheduler`` of type ``WarmupCosineLR`` is read with these semantics (ds_megatron builds that
scheduler itself).  DeepSpeed's own implementation differs in two ways that the published recipe does not have: its
warm-up defaults to logarithmic, and it starts at iteration -1, so the first two optimizer steps run at learning
rate 0 while Adam's moments and step count advance.  Other scheduler types are left to DeepSpeed as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_megatron.config.errors import ConfigError

OWNED_SCHEDULER = "WarmupCosineLR"  # the scheduler type ds_megatron implements itself
_KEYS = ("total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio", "warmup_type")


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up over ``warmup_steps`` optimizer steps, cosine decay to ``min_ratio`` at ``total_steps``."""

    warmup_steps: int
    total_steps: int
    warmup_min_ratio: float = 0.0
    min_ratio: float = 0.1

    def ratio(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (1-based) as a fraction of the peak."""
        if step <= self.warmup_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_from(ds_config: dict) -> WarmupCosine | None:
    """The schedule of a DeepSpeed config whose scheduler ds_megatron owns, validated; None for any other."""
    sched = ds_config.get("scheduler")
    if not isinstance(sched, dict) or sched.get("type") != OWNED_SCHEDULER:
        return None
    params = sched.get("params") or {}
    unknown = sorted(set(params) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"scheduler.params.{unknown[0]}", "unknown key", f"valid keys: {', '.join(_KEYS)}", "remove it"
        )
    warmup_type = params.get("warmup_type", "linear")
    if warmup_type != "linear":
        raise ConfigError(
            "scheduler.params.warmup_type",
            "ds_megatron's WarmupCosineLR warms up linearly (the published GPT-3 schedule)",
            f"got {warmup_type!r}",
            'set "warmup_type": "linear" or remove it',
        )
    warmup, total = params.get("warmup_num_steps", 1000), params.get("total_num_steps")
    for key, value in (("warmup_num_steps", warmup), ("total_num_steps", total)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"scheduler.params.{key}", "must be a positive integer", f"got {value!r}", "set it")
    if total < warmup:
        raise ConfigError(
            "scheduler.params.total_num_steps",
            "decay ends before warm-up does",
            f"total_num_steps={total} < warmup_num_steps={warmup}",
            f"set total_num_steps >= {warmup} (usually the run's train_iters)",
        )
    ratios = {k: params.get(k, d) for k, d in (("warmup_min_ratio", 0.0), ("cos_min_ratio", 0.1))}
    for key, value in ratios.items():
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"scheduler.params.{key}", "must be in [0, 1]", f"got {value!r}", "set e.g. 0.1")
    return WarmupCosine(warmup, total, float(ratios["warmup_min_ratio"]), float(ratios["cos_min_ratio"]))
