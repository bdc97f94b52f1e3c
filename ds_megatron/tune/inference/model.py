"""The tuner's inference half: predicted time to first token (TTFT), time per output token (TPOT), throughput and
memory of serving a model with tensor parallelism (and a pipeline where it helps memory) on the GPUs given, and the
search over (tp, pp, request batch, replicas).  Prefill is the training time model's matmuls and fused attention at
the prompt's tokens; decode is memory-bound (every weight and the batch's KV cache read once per token) plus two TP
all-reduces per layer.  A mixture of experts holds every expert (split over TP as in training) and reads, per routed
layer and forward, the experts its tokens touch.  Derived in docs/tuner.md, "Inference model".  Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.rules import tp_misfit
from ds_megatron.model import family_of
from ds_megatron.model.family import RoutedShape
from ds_megatron.tune.core.links import link, ring_s
from ds_megatron.tune.core.matmuls import block_matmuls, core_attention_matmuls
from ds_megatron.tune.core.memory_model import (
    ACT_BYTES,
    GIB,
    MARGIN_BYTES,
    MARGIN_FRACTION,
    block_param_count,
    layers_per_stage,
    padded_vocab_size,
    stage_param_counts,
)
from ds_megatron.tune.core.spec import Candidate, Cluster, check_positive

# Bytes per weight or KV-cache element of each storage precision.  Weights are read at their size; fp8 and int8
# weights are multiplied at the GPU's fp8 / int8 peak where it has one (Cluster.matmul_peak_flops), int4 at bf16.
PRECISION_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8")
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOGIT_BYTES = 4  # the last position's fp32 logits per request, kept for sampling


@dataclass(frozen=True)
class Workload:
    """What is served: prompt and output lengths in tokens, the storage precisions, the latency limits (None: no
    limit) and the request batch sizes to try."""

    prompt_length: int
    output_length: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_ttft_s: float | None = None
    max_tpot_s: float | None = None
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES

    @property
    def context_length(self) -> int:
        """Tokens a request holds in its KV cache at the end: prompt plus output."""
        return self.prompt_length + self.output_length

    @property
    def mean_decode_context(self) -> float:
        """Cached tokens a decode step reads, averaged over the output: prompt + (output - 1) / 2."""
        return self.prompt_length + (self.output_length - 1) / 2


@dataclass(frozen=True)
class Serving:
    """One serving layout: a model replica on tp x pp GPUs, serving ``batch`` requests at once; ``replicas`` copies."""

    tp: int
    pp: int
    batch: int
    replicas: int

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class InferenceMemory:
    """Bytes per GPU on the fuller pipeline stage."""

    weights: float
    kv_cache: float
    activations: float  # the prefill's largest live tensors of one block, and the last position's logits

    @property
    def predicted_bytes(self) -> float:
        return self.weights + self.kv_cache + self.activations

    @property
    def required_bytes(self) -> float:
        """With the training model's margin for what the terms do not see (workspaces, the CUDA context)."""
        return self.predicted_bytes * (1 + MARGIN_FRACTION) + MARGIN_BYTES


@dataclass(frozen=True)
class InferenceTime:
    """Seconds for one batch of requests on one replica, with the physical floors they never go below."""

    ttft_s: float  # prefill of the batch's prompts: the first token of every request
    tpot_s: float  # one decode step of the batch at the mean context length
    prefill_tp_comm_s: float
    decode_tp_comm_s: float
    decode_bytes_floor_s: float  # weights and KV cache read once at the HBM bandwidth
    prefill_flops_floor_s: float  # prefill FLOPs at the peak

    def batch_s(self, output_length: int) -> float:
        """One batch from its prompts to its last token: the prefill, then one decode step per further token."""
        return batch_s(self.ttft_s, self.tpot_s, output_length)


def batch_s(ttft_s: float, tpot_s: float, output_length: int) -> float:
    """A static batch's time (predicted or measured): the prefill, then one decode step per further token."""
    return ttft_s + (output_length - 1) * tpot_s


def rank_key(meets_limits: bool, tokens_per_s: float, tpot_s: float, gpus_per_replica: int) -> tuple:
    """The order of every ranking, predicted or measured: meets the limits, then the most output tokens/s over all
    the GPUs, then the lowest TPOT, then the fewest GPUs per replica."""
    return (not meets_limits, -tokens_per_s, tpot_s, gpus_per_replica)


@dataclass(frozen=True)
class InferenceEvaluation:
    serving: Serving
    memory: InferenceMemory
    time: InferenceTime
    fits: bool
    meets_limits: bool
    output_length: int

    @property
    def replica_tokens_per_s(self) -> float:
        """Output tokens per second of one replica: the batch's tokens over its time."""
        return self.tokens_per_s / self.serving.replicas

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of every replica together."""
        return output_tokens_per_s(self.serving, self.output_length, self.time.ttft_s, self.time.tpot_s)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.replica_tokens_per_s / self.serving.gpus_per_replica

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self.serving),
            "ttft_s": self.time.ttft_s,
            "tpot_s": self.time.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "memory_gib": self.memory.required_bytes / GIB,
            "memory_parts_gib": {k: v / GIB for k, v in dataclasses.asdict(self.memory).items()},
            "fits": self.fits,
            "meets_limits": self.meets_limits,
        }


def experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens reach when each picks k of E at random: E (1 - (1 - k/E)^n); k at one
    token, E in the limit."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expert_params(model: ModelShape, tp: int) -> int:
    """One expert's parameters on a TP rank (gate, up and down, F/t wide each): 3 h F / t; 0 for a dense model."""
    r = RoutedShape.of(model)
    return 0 if r is None else 3 * model.hidden_size * r.width // tp


def block_params_read(model: ModelShape, tp: int, tokens: float) -> float:
    """Parameters of one block a forward over ``tokens`` tokens reads on a TP rank: all of a dense block; a routed
    block's non-expert ones and the experts its tokens touch (:func:`experts_touched`)."""
    r = RoutedShape.of(model)
    return block_params_run(model, tp, None if r is None else experts_touched(r.num_experts, r.top_k, tokens))


def block_params_run(model: ModelShape, tp: int, experts: float | None = None) -> float:
    """Parameters of one block a token is multiplied with on a TP rank (a routed block: k of its E experts, or
    ``experts`` of them)."""
    params = block_param_count(model, tp)
    r = RoutedShape.of(model)
    if r is None:
        return params
    return params - (r.num_experts - (r.top_k if experts is None else experts)) * expert_params(model, tp)


def kv_cache_bytes_per_token(model: ModelShape, kv_dtype: str, tp: int = 1, num_layers: int | None = None) -> float:
    """K and V of one token over ``num_layers`` layers (all by default) on one TP rank:
    2 x layers x kv_heads / t x head_dim x bytes (grouped-query attention stores only the KV heads)."""
    layers = model.num_layers if num_layers is None else num_layers
    return 2 * layers * model.num_kv_heads // tp * model.head_dim * PRECISION_BYTES[kv_dtype]


def inference_memory(model: ModelShape, serving: Serving, work: Workload) -> InferenceMemory:
    """Per GPU on the fuller stage: its weights, the batch's KV cache for prompt + output, the prefill's tensors."""
    t, b = serving.tp, serving.batch
    first, last = stage_param_counts(model, t, serving.pp)
    weights = max(first, last) * PRECISION_BYTES[work.weight_dtype]
    stage_layers = layers_per_stage(model.num_layers, serving.pp)
    kv = b * work.context_length * kv_cache_bytes_per_token(model, work.kv_dtype, t, stage_layers)
    # One block's prefill at its peak: the block input and its norm (2 h), q, k, v of this rank, and the MLP's
    # up-projections (gate and up for a Llama, fc1 for a GPT) of this rank, at bf16, for every prompt token.
    h, f = model.hidden_size, model.intermediate_size
    kv_width = model.head_dim * model.num_kv_heads
    mlp_up = (family_of(model).mlp_matrices - 1) * f  # every MLP matrix but the down-projection reads h, writes F
    routed = RoutedShape.of(model)
    if routed is not None:  # k routed copies of each token (every TP rank holds them) and their gate|up, F/t wide
        k = routed.top_k
        live = b * work.prompt_length * (2 * h + k * h + (h + 2 * kv_width + 2 * k * routed.width) // t) * ACT_BYTES
    else:
        live = b * work.prompt_length * (2 * h + (h + 2 * kv_width + mlp_up) // t) * ACT_BYTES
    logits = b * padded_vocab_size(model.vocab_size, t) // t * LOGIT_BYTES
    return InferenceMemory(weights=weights, kv_cache=kv, activations=live + logits)


def _as_candidate(serving: Serving, batch_tokens: int) -> Candidate:
    """The training model's candidate whose block matmuls are this serving step's: ``batch_tokens`` rows at tp."""
    return Candidate(
        tp=serving.tp,
        pp=serving.pp,
        dp=1,
        sequence_parallel=False,
        micro_batch_size=batch_tokens,
        num_micro_batches=1,
        recompute="none",
        attention="sdpa",
    )


def inference_time(model: ModelShape, cluster: Cluster, serving: Serving, work: Workload) -> InferenceTime:
    """TTFT and TPOT of one batch on one replica (derived in docs/tuner.md, "Inference model"): every matmul's FLOPs
    at ``cluster.efficiency`` of the peak of its precision, every byte read at ``cluster.bandwidth_efficiency`` of the
    HBM bandwidth, the TP collectives, and the engine's fixed time per forward (``cluster.step_overhead_s``)."""
    t, b, layers = serving.tp, serving.batch, model.num_layers
    gbps, latency = link(cluster, inter_node=False)  # tp and pp stay inside a node (searched so)
    h, vocab = model.hidden_size, padded_vocab_size(model.vocab_size, t) // t
    hbm = cluster.memory_gbps * 1e9
    weight_bytes = PRECISION_BYTES[work.weight_dtype]
    # this rank's weights a forward reads, one vocabulary table (a routed block: the experts the tokens touch)
    weight_read = (layers * block_params_read(model, t, b * work.prompt_length) + h * vocab) * weight_bytes
    weight_peak, attn_peak = cluster.matmul_peak_flops(work.weight_dtype), cluster.peak_flops

    # Prefill: the training model's block matmuls and fused attention at s = prompt length, b = the batch (their
    # bf16 weight bytes replaced by the weights' own), two all-reduces of [s, b, h] per layer, one send per stage
    # boundary, the last position's logits.
    prompt = dataclasses.replace(model, seq_length=work.prompt_length)
    cand = _as_candidate(serving, b)
    mm, attn = block_matmuls(prompt, cand), core_attention_matmuls(prompt, cand)
    mm_flops = layers * sum(op.flops for op in mm) + 2.0 * b * h * vocab
    attn_flops = layers * sum(op.flops for op in attn)
    # the GEMMs' bytes less their weights' (the routed GEMMs count one expert's weights per expert GEMM)
    activation_bytes = layers * (sum(op.bytes for op in mm + attn) - block_params_run(model, t, 1) * ACT_BYTES)
    prefill_bytes = weight_read + max(activation_bytes, 0.0) + b * (h + vocab) * ACT_BYTES
    prefill_comm = layers * 2 * ring_s(b * work.prompt_length * h * ACT_BYTES, t, gbps, latency)
    sends = (serving.pp - 1) * (latency + b * work.prompt_length * h * ACT_BYTES / (gbps * 1e9))
    # A fixed time per forward outside the terms above (the engine's scheduler, sampler, kernel launches, Python):
    # the engine preset's (tune.inference.engines), fitted by the empirical mode or passed as --step-overhead-s;
    # prefill and each decode step are one forward.
    overhead = cluster.step_overhead_s
    compute = (mm_flops / weight_peak + attn_flops / attn_peak) / cluster.efficiency
    ttft = compute + prefill_bytes / (hbm * cluster.bandwidth_efficiency) + prefill_comm + sends + overhead
    prefill_floor = mm_flops / weight_peak + attn_flops / attn_peak

    # Decode: per token every weight of this rank is read once and multiplied with b rows; attention reads the
    # batch's cached K and V and multiplies them with one query row per head.
    context = work.mean_decode_context
    kv_read = b * context * kv_cache_bytes_per_token(model, work.kv_dtype, t, layers)
    if RoutedShape.of(model) is not None:  # the experts b tokens touch, k per token multiplied
        weight_read = (layers * block_params_read(model, t, b) + h * vocab) * weight_bytes
    decode_mm = layers * 2.0 * b * block_params_run(model, t) + 2.0 * b * h * vocab
    decode_attn = layers * 4.0 * b * model.num_heads // t * context * model.head_dim
    activations = layers * b * h * ACT_BYTES * 8  # the block's few [b, h] inputs and outputs, read and written
    bytes_moved = weight_read + kv_read + activations
    decode_comm = layers * 2 * ring_s(b * h * ACT_BYTES, t, gbps, latency)
    decode_comm += ring_s(b * LOGIT_BYTES, t, gbps, latency, passes=1)  # the vocabulary shards' best tokens
    decode_sends = (serving.pp - 1) * (latency + b * h * ACT_BYTES / (gbps * 1e9))
    decode_floor = (weight_read + kv_read) / hbm
    decode_compute = (decode_mm / weight_peak + decode_attn / attn_peak) / cluster.efficiency
    tpot = decode_compute + bytes_moved / (hbm * cluster.bandwidth_efficiency) + decode_comm + decode_sends + overhead
    return InferenceTime(
        ttft_s=max(ttft, prefill_floor),
        tpot_s=max(tpot, decode_floor),
        prefill_tp_comm_s=prefill_comm,
        decode_tp_comm_s=decode_comm,
        decode_bytes_floor_s=decode_floor,
        prefill_flops_floor_s=prefill_floor,
    )


def meets_limits(work: Workload, ttft_s: float, tpot_s: float) -> bool:
    """Whether a TTFT and a TPOT (predicted or measured) are within the workload's limits."""
    return (work.max_ttft_s is None or ttft_s <= work.max_ttft_s) and (
        work.max_tpot_s is None or tpot_s <= work.max_tpot_s
    )


def output_tokens_per_s(serving: Serving, output_length: int, ttft_s: float, tpot_s: float) -> float:
    """Output tokens per second of every replica together (predicted or measured): each replica yields batch x
    output tokens per batch time; replicas are independent copies, so they add up."""
    return serving.replicas * serving.batch * output_length / batch_s(ttft_s, tpot_s, output_length)


def evaluate_serving(model: ModelShape, cluster: Cluster, serving: Serving, work: Workload) -> InferenceEvaluation:
    memory = inference_memory(model, serving, work)
    time = inference_time(model, cluster, serving, work)
    meets = meets_limits(work, time.ttft_s, time.tpot_s)
    fits = memory.required_bytes <= cluster.gpu_memory_gb * GIB
    return InferenceEvaluation(serving, memory, time, fits, meets, work.output_length)


@dataclass(frozen=True)
class InferenceResult:
    model: ModelShape
    cluster: Cluster
    workload: Workload
    evaluations: tuple[InferenceEvaluation, ...]  # every candidate that fits, best first

    @property
    def qualifying(self) -> tuple[InferenceEvaluation, ...]:
        return tuple(e for e in self.evaluations if e.meets_limits)

    @property
    def winner(self) -> InferenceEvaluation | None:
        return self.qualifying[0] if self.qualifying else None

    def pareto_front(self) -> tuple[InferenceEvaluation, ...]:
        """Candidates no other beats on all of tokens/s per GPU (higher), TPOT and TTFT (lower), best first."""

        def beats(a: InferenceEvaluation, b: InferenceEvaluation) -> bool:
            at, bt = a.time, b.time
            no_worse = (
                a.tokens_per_s_per_gpu >= b.tokens_per_s_per_gpu and at.tpot_s <= bt.tpot_s and at.ttft_s <= bt.ttft_s
            )
            better = a.tokens_per_s_per_gpu > b.tokens_per_s_per_gpu or at.tpot_s < bt.tpot_s or at.ttft_s < bt.ttft_s
            return no_worse and better

        return tuple(e for e in self.evaluations if not any(beats(o, e) for o in self.evaluations))

    def closest(self, count: int = 3) -> tuple[InferenceEvaluation, ...]:
        """When nothing meets the limits: the candidates that miss them by the smallest factor."""

        def miss(e: InferenceEvaluation) -> float:
            w = self.workload
            ttft = e.time.ttft_s / w.max_ttft_s if w.max_ttft_s else 0.0
            tpot = e.time.tpot_s / w.max_tpot_s if w.max_tpot_s else 0.0
            return max(ttft, tpot)

        return tuple(sorted(self.evaluations, key=miss)[:count])


def tp_sizes(model: ModelShape, cluster: Cluster) -> list[int]:
    """Tensor-parallel sizes that divide what TP splits and stay inside a node."""
    limit = min(cluster.gpus_per_node, cluster.num_gpus)
    return [t for t in range(1, limit + 1) if tp_misfit(model, t) is None and limit % t == 0]


def pp_sizes(model: ModelShape, cluster: Cluster, tp: int) -> list[int]:
    """Pipeline depths that keep a replica inside a node (a replica's stages exchange activations every token)."""
    limit = min(cluster.gpus_per_node, cluster.num_gpus) // tp
    return [p for p in range(1, limit + 1) if limit % p == 0 and p <= model.num_layers]


def check_workload(model: ModelShape, work: Workload) -> None:
    """Refuse lengths, precisions, limits and batch sizes that mean nothing, naming the flag."""
    check_positive("--prompt-length", work.prompt_length, "2048")
    check_positive("--output-length", work.output_length, "256")
    if work.context_length > model.max_position_embeddings:
        raise ConfigError(
            "--output-length",
            "prompt plus output longer than the model's context",
            f"{work.prompt_length} + {work.output_length} > {model.max_position_embeddings}",
            "shorten the prompt or the output, or pass --seq-length for a model trained on longer sequences",
        )
    for flag, value, allowed in (
        ("--weight-dtype", work.weight_dtype, tuple(PRECISION_BYTES)),
        ("--kv-dtype", work.kv_dtype, KV_PRECISIONS),
    ):
        if value not in allowed:
            raise ConfigError(flag, "unknown precision", repr(value), f"use one of {', '.join(allowed)}")
    for flag, limit in (("--max-ttft-ms", work.max_ttft_s), ("--max-tpot-ms", work.max_tpot_s)):
        if limit is not None:
            check_positive(flag, limit, "100")
    if not work.batch_sizes:
        raise ConfigError("--batch-sizes", "empty", "no batch size", "pass e.g. --batch-sizes 1,8,64")
    for b in work.batch_sizes:
        check_positive("--batch-sizes", b, "1,8,64")


def search_inference(model: ModelShape, cluster: Cluster, work: Workload) -> InferenceResult:
    """Every (tp, pp, batch) that fits, replicas filling the GPUs; best first: meets the limits, then the most output
    tokens/s over all the GPUs, then the lowest TPOT."""
    check_workload(model, work)
    evaluations = []
    for tp in tp_sizes(model, cluster):
        for pp in pp_sizes(model, cluster, tp):
            replicas = cluster.num_gpus // (tp * pp)
            for b in sorted(set(work.batch_sizes)):
                e = evaluate_serving(model, cluster, Serving(tp, pp, b, replicas), work)
                if e.fits:
                    evaluations.append(e)
    evaluations.sort(key=lambda e: rank_key(e.meets_limits, e.tokens_per_s, e.time.tpot_s, e.serving.gpus_per_replica))
    return InferenceResult(model, cluster, work, tuple(evaluations))


def smallest_fit_note(model: ModelShape, cluster: Cluster, work: Workload) -> str:
    """Why nothing fits: the weights alone at the widest layout, against the GPU's memory."""
    tp = max(tp_sizes(model, cluster))
    pp = max(pp_sizes(model, cluster, tp))
    mem = inference_memory(model, Serving(tp, pp, min(work.batch_sizes), 1), work)
    return (
        f"at tp {tp} x pp {pp} and batch {min(work.batch_sizes)} a GPU needs {mem.required_bytes / GIB:.1f} GiB "
        f"(weights {mem.weights / GIB:.1f}, KV cache {mem.kv_cache / GIB:.1f}) > {cluster.gpu_memory_gb:g} GiB; "
        f"use more GPUs per node, a smaller --weight-dtype / --kv-dtype or shorter requests"
    )
