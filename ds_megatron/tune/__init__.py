"""L3.8: the hyperparameter tool.  Finds the fastest (tp, pp, dp, sp, micro-batch, recompute, attention kernel, ZeRO)
for a GPT or a Llama on a cluster from analytic memory and time models; no torch, no deepspeed, no GPU.

    python -m ds_megatron.tune --model gpt3-175b --global-batch-size 1536 --gpus 1024 --gpu h100-sxm

docs/tuner.md describes the models, their assumptions and a worked example.
"""

from ds_megatron.tune.core.calibration import Calibration
from ds_megatron.tune.core.gpus import GPUS, GpuPreset
from ds_megatron.tune.core.memory_model import StageMemory, stage_memory, stage_param_counts, total_param_count
from ds_megatron.tune.core.spec import Candidate, Cluster, Pins, build_cluster, build_model_shape
from ds_megatron.tune.training.calibration import Measurement, calibrate, fit_time_model
from ds_megatron.tune.training.search import Evaluation, SearchResult, common_configuration, evaluate, search
from ds_megatron.tune.training.space import Rejection, enumerate_candidates
from ds_megatron.tune.training.time_model import StepTime, step_time

__all__ = [
    "Calibration",
    "Candidate",
    "Cluster",
    "Evaluation",
    "GPUS",
    "GpuPreset",
    "Measurement",
    "Pins",
    "Rejection",
    "SearchResult",
    "StageMemory",
    "StepTime",
    "build_cluster",
    "build_model_shape",
    "calibrate",
    "common_configuration",
    "enumerate_candidates",
    "evaluate",
    "fit_time_model",
    "search",
    "stage_memory",
    "stage_param_counts",
    "step_time",
    "total_param_count",
]
