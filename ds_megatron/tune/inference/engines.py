"""The inference model's fitted constants and its engine presets (``inference --engine NAME``): the compute
efficiency of every matmul, the fraction of the HBM bandwidth decode's reads reach, and a fixed time per forward
(scheduler, sampler, kernel launches) per serving engine.  All are fitted by ``tune.inference.fit`` to the published
measurements of ``tune.inference.anchors`` (docs/tuner.md, "Inference model: accuracy"); a test refits them and
checks these figures.  Standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_megatron.config import ConfigError
from ds_megatron.tune.core.spec import Cluster

# Fitted to the 21 anchors together (inference_fit.fit_anchors): matmuls reach this fraction of the peak of their
# precision, decode's weight and KV reads this fraction of the HBM bandwidth.
INFERENCE_EFFICIENCY = 0.711
BANDWIDTH_EFFICIENCY = 0.782


@dataclass(frozen=True)
class Engine:
    """A serving engine's fixed time per forward (the prefill and each decode step), and what it rests on."""

    name: str
    step_overhead_s: float
    basis: str


ENGINES = {
    e.name: e
    for e in (
        Engine("tensorrt-llm", 0.65e-3, "fitted to its 12 anchors (TensorRT-LLM's tables, NIM)"),
        Engine("vllm", 2.38e-3, "fitted to its 2 anchors (vLLM's CI latency tests)"),
        Engine("lmdeploy", 1.71e-3, "fitted to its 7 anchors (lmdeploy's A100 tables)"),
        Engine(
            "deepspeed",
            2.52e-3,
            "no published DeepSpeed figure among the anchors: one overhead fitted to every engine's rows together; "
            "--empirical measures DeepSpeed's own on the machine",
        ),
    )
}
DEFAULT_ENGINE = "deepspeed"  # what the recommendation is run with (docs/tuner.md, "Serving a trained model")

# What the model is accurate to: median and worst |measured / predicted - 1| of the anchors, each predicted by the
# fit to the other sources' rows (inference_fit.leave_one_source_out), per figure.
EXPECTED_ERROR = {"ttft": (0.086, 0.193), "tpot": (0.117, 0.262)}


def inference_cluster(
    cluster: Cluster,
    engine: str = DEFAULT_ENGINE,
    efficiency: float | None = None,
    bandwidth_efficiency: float | None = None,
    step_overhead_s: float | None = None,
) -> Cluster:
    """``cluster`` with the inference model's constants: the fitted efficiencies and ``engine``'s overhead per
    forward, each replaced by the value given (the command line's --efficiency, --bandwidth-efficiency,
    --step-overhead-s)."""
    if engine not in ENGINES:
        raise ConfigError("--engine", "unknown serving engine", repr(engine), f"use one of {', '.join(ENGINES)}")
    for flag, value in (("--efficiency", efficiency), ("--bandwidth-efficiency", bandwidth_efficiency)):
        if value is not None and not 0 < value <= 1:
            raise ConfigError(flag, "a fraction of the peak", f"got {value}", f"pass e.g. {flag} 0.7")
    if step_overhead_s is not None and step_overhead_s < 0:
        raise ConfigError("--step-overhead-s", "negative", f"got {step_overhead_s}", "pass 0 or more")
    return dataclasses.replace(
        cluster,
        efficiency=INFERENCE_EFFICIENCY if efficiency is None else efficiency,
        bandwidth_efficiency=BANDWIDTH_EFFICIENCY if bandwidth_efficiency is None else bandwidth_efficiency,
        step_overhead_s=ENGINES[engine].step_overhead_s if step_overhead_s is None else step_overhead_s,
    )


def expected_error_text(figure: str) -> str:
    """``±12%`` for "ttft" or "tpot": the median held-out error of the anchors (docs/tuner.md)."""
    return f"±{EXPECTED_ERROR[figure][0]:.0%}"
