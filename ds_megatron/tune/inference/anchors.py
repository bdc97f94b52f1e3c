"""Published inference measurements the inference model is fitted and tested on: the serving half's counterpart of
``paper_runs`` (Table 5 for training).  Every row is a figure printed on a page or in a file read at the address its
source names, with the setup as published and what separates that setup from the model's static batch
(``mismatch``).  Only Llama models (Llama 2 7B and 70B, Llama 3 / 3.1 / 3.3 8B and 70B) on A100, H100 and H200.
:func:`check_anchors` validates the records.  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from ds_megatron.config import ModelShape
from ds_megatron.config.sizes import named
from ds_megatron.tune.core.gpus import GPUS
from ds_megatron.tune.core.spec import Cluster, build_cluster, build_model_shape
from ds_megatron.tune.inference.model import KV_PRECISIONS, PRECISION_BYTES, Serving, Workload, inference_time


@dataclass(frozen=True)
class Source:
    """Where a set of rows was published and what ran them."""

    name: str
    address: str  # a URL, or "owner/repo:path@commit" of the file read
    engine: str  # the engine preset it is compared under (tune.inference.engines.ENGINES)
    version: str  # the engine's version as the source states it
    setup: str  # how the figures were measured, in the source's words reduced to facts


SOURCES = {
    s.name: s
    for s in (
        Source(
            "lmdeploy",
            "InternLM/lmdeploy:docs/en/benchmark/a100_fp16.md@3e391df4673326f79363eebe030876861a9b7090",
            "lmdeploy",
            "lmdeploy v0.1.0a1 (TurboMind), CUDA 11.8",
            "'Static Inference Benchmark' on A100-80G: `batch` clients each send requests of fixed prompt and "
            "output lengths; throughput in output tokens/s; FTL = first token latency",
        ),
        Source(
            "trtllm-perf",
            "NVIDIA/TensorRT-LLM:docs/source/performance.md@138f96d45f90b9667426f7c47297d8c06bafac73",
            "tensorrt-llm",
            "TensorRT-LLM v0.6.1 (throughput tables), v0.5 (first-token latency tables)",
            "gptSessionBenchmark: static batches; H100 engines built with --enable_fp8 --fp8_kv_cache, A100 "
            "engines without them (fp16); first-token latency = a run with 1 output token",
        ),
        Source(
            "vllm-ci",
            "https://buildkite.com/vllm/performance-benchmark/builds/9515",
            "vllm",
            "vLLM at the commit of CI build 9515 (the page states no release)",
            "'Latency tests': input 32, output 128 tokens, batch fixed at 8, end-to-end latency of one batch "
            "(mean of the runs), one H200 per tp rank",
        ),
        Source(
            "nim",
            "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance.md",
            "tensorrt-llm",
            "NIM for LLMs 1.8.0 (Llama-3.3-70b-Instruct container)",
            "AIPerf against the NIM server, '2 x H100 80G, fp8 TP2', fixed input / output token counts, one "
            "concurrent request; TTFT and ITL (inter-token latency) in ms",
        ),
    )
}

# The models, as their config.json files give them (Llama 2: 32,000 vocabulary, 4,096 positions, 7B without
# grouped-query attention, the family of the named shape it is ``like``; Llama 3.1 8B and 3.3 70B have the shapes of
# Llama 3 8B and 70B).
MODELS = {
    "llama2-7b": dict(
        like="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, context=4096
    ),
    "llama2-70b": dict(
        like="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, context=4096
    ),
    "llama3.1-8b": dict(size="llama3-8b"),
    "llama3-70b": dict(size="llama3-70b"),
    "llama3.3-70b": dict(size="llama3-70b"),
}
# What a row's value is: "ttft_s" / "tpot_s" (seconds), "batch_s" (one static batch from its prompts to its last
# token, seconds), "output_tokens_per_s" (B x O over the batch's time).  Each is a sum of TTFT and TPOT.
METRICS = ("ttft_s", "tpot_s", "batch_s", "output_tokens_per_s")
LMDEPLOY_MISMATCH = (
    "a client per batch slot on TurboMind's persistent batch, not one static batch; prompt 1 token, so the run is "
    "decode at the batch's size"
)
TRT_TTFT_MISMATCH = (
    "a run of 1 output token (prefill + one step); the table says batch 1, the command shown runs larger batches"
)
NIM_MISMATCH = (
    "through an HTTP server at concurrency 1 (tokenization, streaming); the page names no backend (NIM's fp8 "
    "profiles are TensorRT-LLM engines) and no KV-cache precision (bf16 assumed)"
)
VLLM_MISMATCH = "precision not stated (vLLM's default, the checkpoint's bf16); one offline batch, vLLM's scheduler"


@dataclass(frozen=True)
class Anchor:
    """One published figure and the setup it was measured in."""

    source: str  # a SOURCES name
    model: str  # a MODELS name
    gpu: str  # a tune.core.gpus preset
    weight_dtype: str
    kv_dtype: str
    tp: int
    batch: int  # the static batch (or the clients of lmdeploy's persistent batch)
    prompt_length: int
    output_length: int
    metric: str  # one of METRICS
    value: float  # as published, in the metric's unit
    mismatch: str  # what separates the published setup from the model's static batch

    @property
    def label(self) -> str:
        what = self.metric.removesuffix("_s").replace("output_tokens_per", "tok/s").replace("batch", "batch time")
        return (
            f"{self.model} {self.gpu} {self.weight_dtype} tp{self.tp} b{self.batch} "
            f"{self.prompt_length}/{self.output_length} {what}"
        )

    @property
    def engine(self) -> str:
        return SOURCES[self.source].engine

    def model_shape(self) -> ModelShape:
        m = MODELS[self.model]
        if "size" in m:
            return build_model_shape(m["size"], None, None, None, None, None)
        return build_model_shape(
            None, m["layers"], m["hidden"], m["heads"], m["vocab"], m["context"], family=named(m["like"]).family,
            kv_heads=m["kv_heads"], intermediate_size=m["ffn"], tie_word_embeddings=False,
        )  # fmt: skip

    def cluster(self, **constants: float) -> Cluster:
        """The source's GPUs (one node of tp) with the model's constants (efficiencies, step overhead)."""
        return build_cluster(self.gpu, self.tp, max(self.tp, 8), **constants)

    def workload(self) -> Workload:
        return Workload(self.prompt_length, self.output_length, self.weight_dtype, self.kv_dtype)

    @property
    def serving(self) -> Serving:
        return Serving(self.tp, 1, self.batch, 1)

    @property
    def measured_s(self) -> float:
        """The figure as seconds of the prediction it is compared with (a throughput as its batch's time)."""
        if self.metric == "output_tokens_per_s":
            return self.batch * self.output_length / self.value
        return self.value

    def weights(self) -> tuple[float, float]:
        """(TTFT, TPOT) coefficients of the prediction: predicted = a x TTFT + b x TPOT."""
        if self.metric == "ttft_s":
            return 1.0, 0.0
        if self.metric == "tpot_s":
            return 0.0, 1.0
        return 1.0, self.output_length - 1.0  # batch_s, and a throughput's batch time

    def predicted_s(self, cluster: Cluster) -> float:
        t = inference_time(self.model_shape(), cluster, self.serving, self.workload())
        a, b = self.weights()
        return a * t.ttft_s + b * t.tpot_s

    def ratio(self, cluster: Cluster) -> float:
        """Measured over predicted (above 1: the model is optimistic)."""
        return self.measured_s / self.predicted_s(cluster)


def _lm(model: str, tp: int, batch: int, prompt: int, output: int, metric: str, value: float, why: str) -> Anchor:
    return Anchor("lmdeploy", model, "a100-80gb", "fp16", "fp16", tp, batch, prompt, output, metric, value, why)


def _trt(model: str, gpu: str, tp: int, batch: int, prompt: int, output: int, metric: str, value: float, why: str):
    dtype = "fp8" if gpu != "a100-80gb" else "fp16"
    return Anchor("trtllm-perf", model, gpu, dtype, dtype, tp, batch, prompt, output, metric, value, why)


def _nim(prompt: int, output: int, metric: str, value: float) -> Anchor:
    return Anchor("nim", "llama3.3-70b", "h100-sxm", "fp8", "bf16", 2, 1, prompt, output, metric, value, NIM_MISMATCH)


ANCHORS = (
    # lmdeploy, a100_fp16.md, "llama2-7b" and "llama2-70b" tables: throughput(out tok/s); FTL(ave)(s).
    _lm("llama2-7b", 1, 1, 1, 128, "output_tokens_per_s", 100.02, "prompt 1 token: decode at batch 1"),
    _lm("llama2-7b", 1, 16, 1, 128, "output_tokens_per_s", 1504.72, LMDEPLOY_MISMATCH),
    _lm("llama2-7b", 1, 64, 1, 128, "output_tokens_per_s", 4154.81, LMDEPLOY_MISMATCH),
    _lm("llama2-7b", 1, 1, 2048, 128, "ttft_s", 0.139, "FTL of one client: the prefill of one 2,048-token prompt"),
    _lm("llama2-70b", 4, 1, 1, 128, "output_tokens_per_s", 33.94, "prompt 1 token: decode at batch 1"),
    _lm("llama2-70b", 4, 64, 1, 128, "output_tokens_per_s", 1425.79, LMDEPLOY_MISMATCH),
    _lm("llama2-70b", 4, 1, 2048, 128, "ttft_s", 0.402, "FTL of one client: the prefill of one 2,048-token prompt"),
    # TensorRT-LLM, performance.md: "Low Latency" tables (1st token latency, ms) and "Peak Throughput" tables.
    _trt("llama2-7b", "a100-80gb", 1, 1, 128, 1, "ttft_s", 0.016, TRT_TTFT_MISMATCH),
    _trt("llama2-7b", "a100-80gb", 1, 1, 2048, 1, "ttft_s", 0.133, TRT_TTFT_MISMATCH),
    _trt("llama2-70b", "a100-80gb", 4, 1, 128, 1, "ttft_s", 0.047, TRT_TTFT_MISMATCH),
    _trt("llama2-70b", "a100-80gb", 4, 1, 2048, 1, "ttft_s", 0.377, TRT_TTFT_MISMATCH),
    _trt("llama2-7b", "h100-sxm", 1, 1, 2048, 1, "ttft_s", 0.036, TRT_TTFT_MISMATCH + "; fp8 engine"),
    _trt("llama2-70b", "h100-sxm", 4, 1, 2048, 1, "ttft_s", 0.109, TRT_TTFT_MISMATCH + "; fp8 engine"),
    _trt("llama2-7b", "a100-80gb", 1, 60, 128, 2048, "output_tokens_per_s", 1928, "the largest batch that fit"),
    _trt("llama2-7b", "h100-sxm", 1, 112, 128, 2048, "output_tokens_per_s", 6818, "fp8 engine and KV cache"),
    # vLLM CI build 9515, "Latency tests": mean latency (ms) of latency_llama8B_tp1 and latency_llama70B_tp4.
    Anchor("vllm-ci", "llama3.1-8b", "h200", "bf16", "bf16", 1, 8, 32, 128, "batch_s", 0.833421, VLLM_MISMATCH),
    Anchor("vllm-ci", "llama3-70b", "h200", "bf16", "bf16", 4, 8, 32, 128, "batch_s", 2.07753, VLLM_MISMATCH),
    # NIM 1.8.0, Llama-3.3-70b-instruct, 2 x H100 80G fp8 TP2: the concurrency-1 rows of two length settings.
    _nim(5000, 500, "ttft_s", 0.40677),
    _nim(5000, 500, "tpot_s", 0.01858),
    _nim(500, 2000, "ttft_s", 0.04777),
    _nim(500, 2000, "tpot_s", 0.01891),
)

MIN_ROWS, MIN_SOURCES = 15, 4


def check_anchors(anchors: tuple[Anchor, ...] = ANCHORS, sources: dict[str, Source] = SOURCES) -> None:
    """Refuse a record that names an unknown source, model, GPU, precision or metric, a non-positive figure or
    length, a tp the model cannot split, a source without an address, engine or rows, or too few rows or sources
    (the fit's cross-check holds out one source at a time), or no Llama 3 row: ``ValueError`` naming the row."""
    from ds_megatron.config.rules import tp_misfit
    from ds_megatron.tune.inference.engines import ENGINES

    for s in sources.values():
        if not (s.address and s.version and s.setup) or s.engine not in ENGINES:
            raise ValueError(f"anchor source {s.name!r}: needs an address, a version, a setup and a known engine")
    for a in anchors:
        problems = [
            f"source {a.source!r}" * (a.source not in sources),
            f"model {a.model!r}" * (a.model not in MODELS),
            f"gpu {a.gpu!r}" * (a.gpu not in GPUS),
            f"weights {a.weight_dtype!r}" * (a.weight_dtype not in PRECISION_BYTES),
            f"KV cache {a.kv_dtype!r}" * (a.kv_dtype not in KV_PRECISIONS),
            f"metric {a.metric!r}" * (a.metric not in METRICS),
            "a figure or length that is not positive" * (min(a.value, a.tp, a.batch, a.prompt_length) <= 0),
            "no output token" * (a.output_length < 1 or (a.metric != "ttft_s" and a.output_length < 2)),
            "no mismatch stated" * (not a.mismatch),
        ]
        if a.model in MODELS and not any(problems) and (why := tp_misfit(a.model_shape(), a.tp)):
            problems.append(f"tp {a.tp}: {why}")
        if bad := [p for p in problems if p]:
            raise ValueError(f"anchor {a.label!r}: {'; '.join(bad)}")
    used = {a.source for a in anchors}
    if unused := set(sources) - used:
        raise ValueError(f"anchor sources without rows: {sorted(unused)}")
    if len(anchors) < MIN_ROWS or len(used) < MIN_SOURCES:
        raise ValueError(f"{len(anchors)} anchors from {len(used)} sources: need {MIN_ROWS} from {MIN_SOURCES}")
    if not any(a.model.startswith("llama3") for a in anchors):
        raise ValueError("no Llama 3 anchor")
