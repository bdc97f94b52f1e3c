"""Top-level keys of a DeepSpeed JSON config (read off DeepSpeed 0.19.8's config parser and its sub-configs).

DeepSpeed ignores a top-level key it does not know, so a typo there ("zero_optimisation") silently trains with the
default.  ds_megatron warns about unknown top-level keys in the file and refuses ``--set`` of a path that starts
with one (a flag the user typed and expects to act)."""

from __future__ import annotations

import difflib

DEEPSPEED_TOP_LEVEL_KEYS = frozenset(
    {
        "activation_checkpointing",
        "aio",
        "amp",
        "autotuning",
        "bf16",
        "checkpoint",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "compression_training",
        "csv_monitor",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "flops_profiler",
        "fp16",
        "gradient_accumulation_steps",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "graph_harvesting",
        "hybrid_engine",
        "log_level",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "monitor_config",
        "nebula",
        "optimizer",
        "pipeline",
        "prescale_gradients",
        "progressive_layer_drop",
        "quantize_training",
        "scheduler",
        "seq_parallel_communication_data_type",
        "sparse_attention",
        "sparse_gradients",
        "steps_per_print",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "torch_autocast",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "zero_optimization",
    }
)


def is_known_top_level(key: str) -> bool:
    return key in DEEPSPEED_TOP_LEVEL_KEYS or key == "ds_megatron"


def nearest_top_level(key: str) -> str | None:
    match = difflib.get_close_matches(key, sorted(DEEPSPEED_TOP_LEVEL_KEYS | {"ds_megatron"}), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_top_level_warnings(ds_config: dict) -> list[str]:
    """One warning line per top-level key that neither DeepSpeed nor ds_megatron reads."""
    lines = []
    for key in sorted(k for k in ds_config if not is_known_top_level(k)):
        near = nearest_top_level(key)
        hint = f"; did you mean '{near}'?" if near else ""
        lines.append(f"warning: {key}: not a DeepSpeed or ds_megatron key, DeepSpeed ignores it{hint}")
    return lines
