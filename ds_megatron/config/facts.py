"""Facts read off a DeepSpeed config in one place each: its precision, its ZeRO stage, whether DeepSpeed wraps the
optimizer, and the (tp, pp, dp) layout a saved config was resolved for."""

from __future__ import annotations


def precision(ds_config: dict) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` (DeepSpeed's ``bf16.enabled`` / ``fp16.enabled``)."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return "bf16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def deepspeed_wraps_optimizer(ds_config: dict) -> bool:
    """bf16, fp16 and ZeRO replace the optimizer's parameters by flat fp32 partitions held in DeepSpeed's wrapper
    (which also computes the gradient norm and clips); plain fp32 with ZeRO 0 keeps the model's parameters."""
    return precision(ds_config) != "fp32" or zero_stage(ds_config) > 0


def saved_layout(ds_config: dict) -> tuple[int, int, int]:
    """(tp, pp, dp) a resolved config (as saved with every checkpoint) was trained at; dp from its batch arithmetic
    (``train_batch_size = micro x accumulation x dp``)."""
    par = (ds_config.get("ds_megatron") or {}).get("parallel") or {}
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    micro, gas, glob = (
        ds_config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    dp = glob // (micro * gas) if micro and gas and glob else 1
    return tp, pp, dp


def needs_resharding(saved: dict, now: dict) -> bool:
    """Whether a checkpoint saved with config ``saved`` must be resharded to resume with config ``now``: another
    tp or pp always; another dp too when either run partitions its optimizer state over data parallelism (bf16,
    fp16 or ZeRO: the flat partitions are cut per dp rank)."""
    (tp0, pp0, dp0), (tp1, pp1, dp1) = saved_layout(saved), saved_layout(now)
    partitioned = deepspeed_wraps_optimizer(saved) or deepspeed_wraps_optimizer(now)
    return (tp0, pp0) != (tp1, pp1) or (partitioned and dp0 != dp1)
