"""What the tuner shows: the ranked console table, the winner and why it wins, the rejected families.  What it
writes (the JSON, the winner's config) is ds_megatron.tune.training.written."""

from __future__ import annotations

import math

from ds_megatron.config import ModelShape
from ds_megatron.model import family_of
from ds_megatron.pipeline_parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from ds_megatron.tune.core import memory_model
from ds_megatron.tune.core.memory_model import GIB, StageMemory, total_param_count
from ds_megatron.tune.core.report import efficiency_text
from ds_megatron.tune.core.spec import INTER_NODE_LATENCY_S, INTRA_NODE_LATENCY_S, Candidate, Cluster
from ds_megatron.tune.training.search import Evaluation, SearchResult, ranked_step

COLUMNS = (
    ("rank", 4),
    ("tp", 3),
    ("pp", 3),
    ("dp", 5),
    ("sp", 3),
    ("b", 3),
    ("m", 5),
    ("attn", 5),
    ("recompute", 17),
    ("zero", 4),
    ("mem first", 10),
    ("mem last", 9),
    ("step s", 8),
    ("tokens/s", 10),
    ("MFU", 6),
    ("HFU", 6),
)
SCHEDULE_COLUMN = ("schedule", 9)  # last, only in a table that shows a schedule other than 1f1b
LAYOUT_COLUMN = ("layout", 6)  # last, only in a table that shows an uneven pipeline layout ("8/9/9/6")
CP_COLUMN = ("cp", 7)  # after tp, only in a table that shows a cp > 1 candidate ("4 ring", "2 a2a")
EP_COLUMN = ("ep", 3)  # after dp, only in a table of a routed family (its ep is searched; a dense one has none)
ETP_COLUMN = ("etp", 3)  # expert_tp after ep, only where a shown candidate splits its experts over TP at ep > 1
# Under the table of a routed family: what its MFU and HFU count.
ACTIVE_NOTE = "MFU and HFU count the active parameters (k of the E experts per token), as model cards do"
TEXT_COLUMNS = {"attn", "recompute", "status", "source", "cp", "schedule", "layout"}  # left-aligned in every table
MAX_REJECTIONS_SHOWN = 8
NEAR_TIE = 0.01  # candidates this close to the winner's step time are within the time model's error of it
SETTINGS = (  # (label, cell) compared between two candidates
    ("tp", "tp"),
    ("cp", "cp"),
    ("pp", "pp"),
    ("dp", "dp"),
    ("ep", "ep"),
    ("expert_tp", "etp"),  # compared only where either candidate splits its experts over TP at ep > 1 (why_ahead)
    ("SP", "sp"),
    ("micro-batch", "b"),
    ("recompute", "recompute"),
    ("attention", "attn"),
    ("ZeRO", "zero"),
    ("schedule", "schedule"),
    ("layout", "layout"),
)
TIME_PARTS = (
    ("compute", "compute_s"),
    ("eager score passes", "attention_s"),
    ("recomputed elementwise passes", "recompute_passes_s"),
    ("routed MLP passes", "routed_passes_s"),
    ("TP comm", "tp_comm_s"),
    ("pipeline p2p", "p2p_s"),
    ("CP comm not hidden", "cp_comm_s"),
    ("EP all-to-all", "ep_comm_s"),
    ("DP comm", "dp_comm_s"),
    ("bubble (part of the above)", "bubble_s"),
)
PART_SHOWN = 0.001  # time parts that differ by less than this fraction of the step are left out of the comparison


def cells(c: Candidate) -> dict[str, str]:
    """A candidate's settings as the tables and lines show them, by column name."""
    numbers = {"tp": c.tp, "pp": c.pp, "dp": c.dp, "b": c.micro_batch_size, "m": c.num_micro_batches, "zero": c.zero}
    text = {"sp": "on" if c.sequence_parallel else "off", "attn": c.attention, "recompute": c.recompute_label()}
    text["cp"] = "1" if c.cp == 1 else f"{c.cp} {c.cp_comm}"
    text["ep"] = "-" if c.ep is None else str(c.ep)
    text["etp"] = "-" if c.ep is None else str(c.expert_tp_size)
    text["schedule"] = c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages is not None else "")
    text["layout"] = "even" if c.pipeline_layout is None else "/".join(map(str, c.pipeline_layout))
    return {**{name: str(n) for name, n in numbers.items()}, **text}


def layout_cells(c: Candidate, with_cp: bool = False, with_ep: bool = False, with_etp: bool = False) -> list[str]:
    """The tp, (cp,) pp, dp, (ep, etp,) sp, b, m, attn and recompute cells of a table row."""
    x = cells(c)
    names = ("tp", "cp", "pp", "dp", "ep", "etp", "sp", "b", "m", "attn", "recompute")
    shown = {"cp": with_cp, "ep": with_ep, "etp": with_etp}
    return [x[name] for name in names if shown.get(name, True)]


def shows_ep(shown: list[Evaluation]) -> bool:
    """Whether a table of ``shown`` needs the ep column: a routed family's (a dense table stays as it was)."""
    return any(e.candidate.ep is not None for e in shown)


def with_ep_column(columns: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """``columns`` with the ep column after dp."""
    i = [name for name, _ in columns].index("dp") + 1
    return (*columns[:i], EP_COLUMN, *columns[i:])


def shows_etp(shown: list[Evaluation]) -> bool:
    """Whether a table of ``shown`` needs the etp column (expert_tp, after ep): some candidate splits its experts
    over TP at ep > 1 (a table of the default splits stays as it was before the tuner knew expert_tp)."""
    return any(e.candidate.expert_tp is not None for e in shown)


def with_etp_column(columns: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """``columns`` with the etp column after ep."""
    i = [name for name, _ in columns].index("ep") + 1
    return (*columns[:i], ETP_COLUMN, *columns[i:])


def shows_cp(shown: list[Evaluation]) -> bool:
    """Whether a table of ``shown`` needs the cp column (a cp 1 table stays as it was before the tuner knew cp)."""
    return any(e.candidate.cp > 1 for e in shown)


def with_cp_column(columns: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """``columns`` with the cp column after tp."""
    i = [name for name, _ in columns].index("tp") + 1
    return (*columns[:i], CP_COLUMN, *columns[i:])


def shows_schedule(shown: list[Evaluation]) -> bool:
    """Whether a table of ``shown`` needs the schedule column (a 1f1b table stays as it was before schedules)."""
    return any(e.candidate.schedule != DEFAULT_SCHEDULE.name for e in shown)


def shows_layout(shown: list[Evaluation]) -> bool:
    """Whether a table of ``shown`` needs the layout column (an even-split table stays as it was before layouts)."""
    return any(e.candidate.pipeline_layout is not None for e in shown)


def _row(
    rank: int, e: Evaluation, with_cp: bool = False, with_schedule: bool = False, with_layout: bool = False,
    with_ep: bool = False, with_etp: bool = False,
) -> list[str]:  # fmt: skip
    t = e.time
    memory = [f"{stage.required_bytes / GIB:.1f} GiB" for stage in (e.first, e.last)]
    speed = [seconds_text(t.step_s), f"{t.tokens_per_s:,.0f}", f"{t.mfu:.1%}", f"{t.hfu:.1%}"]
    x = cells(e.candidate)
    extra = ([x["schedule"]] if with_schedule else []) + ([x["layout"]] if with_layout else [])
    layout = layout_cells(e.candidate, with_cp, with_ep, with_etp)
    return [str(rank), *layout, str(e.candidate.zero), *memory, *speed, *extra]


def widened(columns: tuple[tuple[str, int], ...], shown: list[Evaluation]) -> tuple[tuple[str, int], ...]:
    """``columns`` with the recompute column as wide as the ``shown`` candidates' longest label."""
    labels = [len(e.candidate.recompute_label()) for e in shown]
    return tuple((name, max([w, *labels]) if name == "recompute" else w) for name, w in columns)


def table(rows: list[list[str]], columns: tuple[tuple[str, int], ...]) -> list[str]:
    """The header line and one line per row: the text columns left-aligned, the numbers right-aligned."""
    return [
        "  ".join(c.ljust(w) if name in TEXT_COLUMNS else c.rjust(w) for c, (name, w) in zip(row, columns)).rstrip()
        for row in [[name for name, _ in columns], *rows]
    ]


def settings_text(c: Candidate) -> str:
    """``tp 8, pp 16, dp 8, SP on, micro-batch 1 x 192, recompute selective, attention sdpa, ZeRO-1`` (with
    ``cp 4 ring`` after tp when cp > 1, ``ep 8`` after dp for a routed family (``ep 8, expert_tp 2`` where its
    experts are split over TP at ep > 1), ``schedule interleaved-1f1b v4``
    off 1f1b, ``layout 8/9/9/6`` when uneven)."""
    return (
        "tp {tp}, "
        + ("cp {cp}, " if c.cp > 1 else "")
        + "pp {pp}, dp {dp}, "
        + ("ep {ep}, " if c.ep else "")
        + ("expert_tp {etp}, " if c.expert_tp is not None else "")
        + "SP {sp}, micro-batch {b} x {m}, "
        "recompute {recompute}, attention {attn}, ZeRO-{zero}"
    ).format(**cells(c)) + (
        (f", schedule {cells(c)['schedule']}" if c.schedule != DEFAULT_SCHEDULE.name else "")
        + (f", layout {cells(c)['layout']}" if c.pipeline_layout is not None else "")
    )


def describe(e: Evaluation) -> str:
    """One line: the settings and the prediction."""
    t = e.time
    return (
        f"{settings_text(e.candidate)}: {seconds_text(t.step_s)} s/step, "
        f"{t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}, HFU {t.hfu:.1%}"
    )


def format_report(result: SearchResult, top: int = 10) -> str:
    """The console report: problem, ranked table, winner and its time breakdown, common configuration, rejections."""
    m, cl = result.model, result.cluster
    nodes = max(1, cl.num_gpus // cl.gpus_per_node)
    params = total_param_count(m)
    count = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    lines = [
        f"model: {m.size or 'custom'} ({_shape_text(m)}, V {m.vocab_size}, "
        f"s {m.seq_length}; {count} parameters), global batch {result.global_batch_size}",
        f"cluster: {cl.num_gpus} {'x ' + cl.gpu if cl.gpu else 'GPUs'} "
        f"({nodes} node(s) x {min(cl.gpus_per_node, cl.num_gpus)}), "
        f"{cl.gpu_memory_gb:g} GiB, {cl.peak_tflops:g} TFLOP/s peak, HBM {cl.memory_gbps:g} GB/s, "
        f"matmul ceiling {efficiency_text(cl.efficiency)}"
        f"{f', overhead {seconds_text(cl.step_overhead_s)} s/step' if cl.step_overhead_s else ''}, "
        f"intra-node {cl.intra_node_gbps:g} GB/s, inter-node {cl.inter_node_gbps:g} GB/s per GPU{_latencies(cl)}",
        f"searched {len(result.evaluations)} candidates in {result.elapsed_s:.2f} s: {len(result.ranked)} fit, "
        f"{len(result.rejections)} families rejected",
        "",
    ]
    winner = result.winner
    if winner is None:
        lines += _no_fit_lines(result)
    else:
        shown = result.ranked[:top]
        cp_column = shows_cp(shown)
        schedule_column = shows_schedule(shown)
        ep_column, etp_column = shows_ep(shown), shows_etp(shown)
        columns = with_cp_column(COLUMNS) if cp_column else COLUMNS
        columns = with_ep_column(columns) if ep_column else columns
        columns = widened(with_etp_column(columns) if etp_column else columns, shown)
        layout_column = shows_layout(shown)
        columns += ((SCHEDULE_COLUMN,) if schedule_column else ()) + ((LAYOUT_COLUMN,) if layout_column else ())
        rows = [
            _row(i + 1, e, cp_column, schedule_column, layout_column, ep_column, etp_column)
            for i, e in enumerate(shown)
        ]
        lines += table(rows, columns)
        if m.num_experts:
            lines.append(ACTIVE_NOTE)
        t = winner.time
        lines += [
            "",
            f"winner: {describe(winner)}",
            f"  step {seconds_text(t.step_s)} s = compute {seconds_text(t.compute_s)} "
            f"(matmuls at {t.matmul_efficiency:.0%} of peak) + "
            + (f"eager score passes {seconds_text(t.attention_s)} + " if t.attention_s else "")
            + (f"recomputed elementwise passes {seconds_text(t.recompute_passes_s)} + " if t.recompute_passes_s else "")
            + (f"routed MLP passes {seconds_text(t.routed_passes_s)} + " if t.routed_passes_s else "")
            + f"TP comm {seconds_text(t.tp_comm_s)} + "
            + (f"CP comm not hidden {seconds_text(t.cp_comm_s)} + " if t.cp_comm_s else "")
            + (f"EP all-to-all {seconds_text(t.ep_comm_s)} + " if t.ep_comm_s else "")
            + f"pipeline p2p {seconds_text(t.p2p_s)} (bubble {seconds_text(t.bubble_s)} of these) + DP comm "
            f"{seconds_text(t.dp_comm_s)}"
            + (f" + fixed overhead {seconds_text(t.overhead_s)}" if t.overhead_s else ""),
            f"  memory per GPU: first stage {_memory(winner.first)}; last stage {_memory(winner.last)}",
        ]
        if len(result.ranked) > 1:
            lines += why_ahead(winner, result.ranked[1], 1, 2)
        lines += _kernel_note(result)
        lines += _recompute_note(result)
        close = [e for e in result.ranked if e.time.step_s <= winner.time.step_s * (1 + NEAR_TIE)]
        leanest = min(close, key=lambda e: e.required_bytes)
        if leanest is not winner and leanest.required_bytes < 0.8 * winner.required_bytes:
            lines.append(
                f"  within {NEAR_TIE:.0%} of the winner with the least memory "
                f"({leanest.required_bytes / GIB:.1f} GiB instead of {winner.required_bytes / GIB:.1f}): "
                f"rank {result.ranked.index(leanest) + 1}, {describe(leanest)}"
            )
    if result.common is not None:
        lines.append(f"common configuration ({result.common_note}):\n  {describe(result.common)}")
    else:
        lines.append(f"common configuration: {result.common_note}")
    if result.speedup is not None:
        lines.append(f"predicted speed-up of the winner over the common configuration: {result.speedup:.2f}x")
    lines.append("")
    lines += _rejection_lines(result, nothing_fits=winner is None)
    return "\n".join(lines)


def _shape_text(m: ModelShape) -> str:
    """``L 96, h 12288, a 96`` for a GPT; a Llama adds its KV heads, SwiGLU width and output layer."""
    text = f"L {m.num_layers}, h {m.hidden_size}, a {m.num_heads}"
    if family_of(m).fixed_kv_and_width:
        return text
    tied = "tied" if m.tie_word_embeddings else "untied"
    return f"{m.family}: {text}, KV heads {m.num_kv_heads}, F {m.intermediate_size}, {tied} output layer"


def why_ahead(a: Evaluation, b: Evaluation, rank_a: int, rank_b: int) -> list[str]:
    """Why ``a`` ranks ahead of ``b``: the settings that differ, then the time parts and memory they change."""
    ca, cb = cells(a.candidate), cells(b.candidate)
    if a.candidate.expert_tp is None and b.candidate.expert_tp is None:  # both the default split: ep says it
        ca["etp"] = cb["etp"]
    differs = [f"{label} {ca[key]} instead of {cb[key]}" for label, key in SETTINGS if ca[key] != cb[key]]
    ta, tb = a.time, b.time
    gap = tb.step_s - ta.step_s
    parts = [
        f"{name} {seconds_text(getattr(ta, field))} vs {seconds_text(getattr(tb, field))}"
        for name, field in TIME_PARTS
        if abs(getattr(ta, field) - getattr(tb, field)) > PART_SHOWN * tb.step_s
    ]
    tie_break = "smaller cp" if a.candidate.cp < b.candidate.cp else "memory"  # search._rank_key's order
    ahead = ranked_step(tb.step_s) > ranked_step(ta.step_s)
    verdict = f"{gap / tb.step_s:.1%} faster" if ahead else f"as fast (ranked ahead on {tie_break})"
    return [
        f"why rank {rank_a} is ahead of rank {rank_b} (which differs in: {'; '.join(differs) or 'nothing'}):",
        f"  time: {seconds_text(ta.step_s)} vs {seconds_text(tb.step_s)} s/step, {verdict}"
        + (f"; {', '.join(parts)}" if parts else ""),
        f"  memory per GPU: first stage {a.first.required_bytes / GIB:.1f} vs {b.first.required_bytes / GIB:.1f} GiB "
        f"(activations {a.first.activation_bytes / GIB:.1f} vs {b.first.activation_bytes / GIB:.1f}), last stage "
        f"{a.last.required_bytes / GIB:.1f} vs {b.last.required_bytes / GIB:.1f} GiB",
    ]


def _kernel_note(result: SearchResult) -> list[str]:
    """What the kernel is worth: with an sdpa winner, the best eager candidate; else why the winner is not sdpa."""
    winner = result.winner
    if winner.candidate.attention == "sdpa":
        eager = next((e for e in result.ranked if e.candidate.attention == "eager"), None)
        if eager is None:
            return []
        t = eager.time
        return [
            f"best eager-attention candidate: rank {result.ranked.index(eager) + 1}, {seconds_text(t.step_s)} s/step "
            f"({t.step_s / winner.time.step_s - 1:.1%} slower; its score passes {seconds_text(t.attention_s)} s), "
            f"{eager.required_bytes / GIB:.1f} GiB on the first stage (activations "
            f"{eager.first.activation_bytes / GIB:.1f} GiB against the winner's "
            f"{winner.first.activation_bytes / GIB:.1f})"
        ]
    if result.pins.attention == "eager":
        return ["  the winner uses eager attention because attention was pinned to eager"]
    if "core_attn" in (result.pins.recompute_modules or ()):
        return [
            "  the winner uses eager attention because --recompute-modules includes core_attn (sdpa stores no core)"
        ]
    sdpa = next((e for e in result.ranked if e.candidate.attention == "sdpa"), None)
    if sdpa is None:
        return ["  the winner uses eager attention because no sdpa candidate fits"]
    versus = why_ahead(winner, sdpa, 1, result.ranked.index(sdpa) + 1)
    return ["  the winner uses eager attention; against the best sdpa candidate:", *("  " + line for line in versus)]


def _recompute_note(result: SearchResult) -> list[str]:
    """With a selective winner, what recomputing its modules buys: the best candidate without recompute (or what the
    closest one needs when none fits) and the best with full recompute, unless the runner-up line compared it."""
    winner = result.winner
    if winner.candidate.recompute != "selective":
        return []
    lines = []
    for policy, what in (("none", "without recompute"), ("full", "with full recompute")):
        best = next((e for e in result.ranked if e.candidate.recompute == policy), None)
        tried = [e for e in result.evaluations if e.candidate.recompute == policy]
        if best is not None and result.ranked.index(best) != 1:
            t = best.time
            lines.append(
                f"best candidate {what}: rank {result.ranked.index(best) + 1}, {seconds_text(t.step_s)} s/step "
                f"({t.step_s / winner.time.step_s - 1:.1%} slower), {best.required_bytes / GIB:.1f} GiB "
                f"(activations {best.first.activation_bytes / GIB:.1f} GiB on the first stage against the winner's "
                f"{winner.first.activation_bytes / GIB:.1f})"
            )
        elif best is None and tried:
            closest = min(tried, key=lambda e: e.required_bytes)
            c = closest.candidate
            lines.append(
                f"no candidate {what} fits: the closest, tp {c.tp}, pp {c.pp}, dp {c.dp}, b {c.micro_batch_size}, "
                f"{c.attention} attention, needs {closest.required_bytes / GIB:.1f} GiB > "
                f"{result.cluster.gpu_memory_gb:g} GiB"
            )
    return lines


def _latencies(cl: Cluster) -> str:
    """The collective latencies, when they are not the defaults (e.g. fitted by --empirical)."""
    intra, inter = cl.intra_node_latency_s, cl.inter_node_latency_s
    if math.isclose(intra, INTRA_NODE_LATENCY_S) and math.isclose(inter, INTER_NODE_LATENCY_S):
        return ""  # isclose: the command line's microseconds do not round-trip exactly
    return f", latency {intra * 1e6:,.0f} us intra-node / {inter * 1e6:,.0f} us inter"


def seconds_text(x: float) -> str:
    return f"{x:.2f}" if x >= 10 else f"{x:.3f}" if x >= 0.1 else f"{x:.4f}"


def _no_fit_lines(result: SearchResult) -> list[str]:
    """Why nothing fits, in two lines: the closest candidate and the floor set by the model states."""
    lines = ["no configuration fits: every candidate was rejected (the reasons below; all of them in --json)."]
    if not result.evaluations:
        return lines + ["  no candidate is left once the families below are removed: relax the pins"]
    capacity = result.cluster.gpu_memory_gb
    closest = min(result.evaluations, key=lambda e: e.required_bytes)
    c, need = closest.candidate, closest.required_bytes / GIB
    lines.append(
        f"  closest: tp {c.tp}, pp {c.pp}, dp {c.dp}, {f'ep {c.ep}, ' if c.ep else ''}"
        f"{f'expert_tp {c.expert_tp}, ' if c.expert_tp is not None else ''}{c.recompute_label()} needs "
        f"{need:.1f} GiB per GPU, "
        f"{need / capacity:.1f}x the {capacity:g} GiB available"
    )
    floor = (memory_model.WEIGHT_BYTES + memory_model.GRAD_BYTES) * total_param_count(result.model)
    lines.append(
        f"  weights and gradients alone need {floor / result.cluster.num_gpus / GIB:.1f} GiB per GPU on "
        f"{result.cluster.num_gpus} GPUs (8 bytes per parameter, not sharded by ZeRO-1): add GPUs or memory"
    )
    return lines


def _memory(mem: StageMemory) -> str:
    return (
        f"{mem.required_bytes / GIB:.1f} GiB (weights {mem.params_bytes / GIB:.1f}, grads {mem.grads_bytes / GIB:.1f}, "
        f"optimizer {mem.optimizer_bytes / GIB:.1f}, activations {mem.activation_bytes / GIB:.1f}, + margin)"
    )


def _rejection_lines(result: SearchResult, nothing_fits: bool) -> list[str]:
    """The families closest to fitting first; all of them (up to a cap) when nothing fits."""
    memory = sorted((r for r in result.rejections if r.required_bytes is not None), key=lambda r: r.required_bytes)
    other = [r for r in result.rejections if r.required_bytes is None]
    cap = MAX_REJECTIONS_SHOWN * 4 if nothing_fits else MAX_REJECTIONS_SHOWN
    shown = (memory[: cap // 2] + other)[:cap] if not nothing_fits else (memory + other)[:cap]
    lines = [f"rejected families ({len(result.rejections)}; every one with its reason in --json):"]
    for r in shown:
        family = " ".join(f"{k}={v}" for k, v in r.family.items())
        lines.append(f"  {family}: {r.reason}")
    if len(result.rejections) > len(shown):
        lines.append(f"  ... and {len(result.rejections) - len(shown)} more")
    return lines
