"""The inference tuner's report: the winner under the latency limits, why it beats the runner-up, the Pareto front
of output tokens/s per GPU against TTFT and TPOT, and the constants the prediction rests on."""

from __future__ import annotations

from ds_megatron.tune.core.memory_model import GIB, total_param_count
from ds_megatron.tune.core.report import text_table
from ds_megatron.tune.core.spec import Cluster
from ds_megatron.tune.inference.engines import EXPECTED_ERROR, expected_error_text
from ds_megatron.tune.inference.model import InferenceEvaluation, InferenceResult, smallest_fit_note

COLUMNS = ("rank", "tp", "pp", "batch", "replicas", "tok/s/GPU", "tok/s all", "TTFT", "TPOT", "memory", "limits")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _row(rank: int, e: InferenceEvaluation) -> list[str]:
    s = e.serving
    return [
        str(rank),
        str(s.tp),
        str(s.pp),
        str(s.batch),
        str(s.replicas),
        f"{e.tokens_per_s_per_gpu:,.0f}",
        f"{e.tokens_per_s:,.0f}",
        ms(e.time.ttft_s),
        ms(e.time.tpot_s),
        f"{e.memory.required_bytes / GIB:.1f} GiB",
        "met" if e.meets_limits else "missed",
    ]


def describe(e: InferenceEvaluation) -> str:
    s = e.serving
    return (
        f"tp {s.tp} x pp {s.pp}, batch {s.batch}, {s.replicas} replica{'s' if s.replicas > 1 else ''}: "
        f"{e.tokens_per_s:,.0f} output tokens/s ({e.tokens_per_s_per_gpu:,.0f} per GPU), TTFT {ms(e.time.ttft_s)} "
        f"{expected_error_text('ttft')}, TPOT {ms(e.time.tpot_s)} {expected_error_text('tpot')}, "
        f"{e.memory.required_bytes / GIB:.1f} GiB per GPU"
    )


def why_ahead(a: InferenceEvaluation, b: InferenceEvaluation) -> str:
    """Why the winner ``a`` beats the runner-up ``b``, in the terms that differ."""
    sa, sb = a.serving, b.serving
    parts = [f"{a.tokens_per_s / b.tokens_per_s:.2f}x the output tokens/s of {describe(b)}"]
    if sa.tp != sb.tp:
        parts.append(
            f"tp {sa.tp} vs {sb.tp}: each decode step pays {ms(a.time.decode_tp_comm_s)} vs "
            f"{ms(b.time.decode_tp_comm_s)} of TP all-reduces and reads 1/{sa.tp} vs 1/{sb.tp} of the weights, and "
            f"{sa.replicas} vs {sb.replicas} replicas share the GPUs"
        )
    if sa.batch != sb.batch:
        parts.append(
            f"batch {sa.batch} vs {sb.batch}: a decode step reads the weights once for the whole batch, so a larger "
            "batch yields more tokens per step at a longer TPOT (and more KV cache)"
        )
    if sa.pp != sb.pp:
        parts.append(f"pp {sa.pp} vs {sb.pp}: a batch runs the stages one after the other, so a pipeline adds sends")
    return "; ".join(parts)


def model_line(c: Cluster, engine: str | None) -> str:
    """The constants the prediction rests on and what it is accurate to (docs/tuner.md, "Inference model")."""
    (tm, tw), (pm, pw) = EXPECTED_ERROR["ttft"], EXPECTED_ERROR["tpot"]
    return (
        f"model: {f'engine {engine}, ' if engine else ''}{c.step_overhead_s * 1e3:.2f} ms per forward, matmuls at "
        f"{c.efficiency:.1%} of peak, reads at {c.bandwidth_efficiency:.1%} of HBM; expected error TTFT ±{tm:.0%} "
        f"(worst {tw:.0%}), TPOT ±{pm:.0%} (worst {pw:.0%}), held out by source against published measurements"
    )


def format_inference(result: InferenceResult, top: int = 10, engine: str | None = None) -> str:
    m, c, w = result.model, result.cluster, result.workload
    limits = [f"{name} <= {ms(limit)}" for name, limit in (("TTFT", w.max_ttft_s), ("TPOT", w.max_tpot_s)) if limit]
    lines = [
        f"inference: {m.size or m.family} ({total_param_count(m) / 1e9:.2f}B parameters, {m.num_layers} layers, "
        f"h {m.hidden_size}, {m.num_heads} heads, {m.num_kv_heads} KV heads) on {c.num_gpus} x {c.gpu or 'GPU'} "
        f"({c.gpus_per_node} per node)",
        f"requests: prompt {w.prompt_length}, output {w.output_length} tokens; weights {w.weight_dtype}, KV cache "
        f"{w.kv_dtype}; limits: {', '.join(limits) or 'none'}",
        model_line(c, engine),
    ]
    if not result.evaluations:
        lines.append(f"nothing fits: {smallest_fit_note(m, c, w)}")
        return "\n".join(lines)
    winner = result.winner
    if winner is None:
        lines.append(f"no configuration meets the limits; the closest of {len(result.evaluations)} that fit:")
        lines += text_table(list(COLUMNS), [_row(i + 1, e) for i, e in enumerate(result.closest())])
        return "\n".join(lines)
    lines.append(f"winner: {describe(winner)}")
    others = [e for e in result.qualifying[1:] if e.serving != winner.serving]
    if others:
        lines.append(f"why: {why_ahead(winner, others[0])}")
    front = result.pareto_front()
    lines.append(
        f"Pareto front (output tokens/s per GPU against TTFT and TPOT): {len(front)} of {len(result.evaluations)} "
        f"candidates that fit, by total output tokens/s"
    )
    lines += text_table(list(COLUMNS), [_row(i + 1, e) for i, e in enumerate(front[:top])])
    return "\n".join(lines)
