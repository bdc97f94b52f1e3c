"""The uneven pipeline layout (``ds_megatron.parallel.pipeline_layout``, blocks per stage in model-chunk order): the
vocabulary's layers are stages' work the even split does not see.  The last stage runs the output layer and the loss
(the logits matmul, ``tune.core.matmuls.logits_matmul``: for Llama 3 8B's 128,256-token vocabulary about 2.4 blocks'
matmuls), the first the embedding (a gather: no matmul time, but its weights and the most micro-batches in flight
under 1F1B).  Moving blocks off the last stage onto the others lowers the slowest stage's time where the output
layer costs more than what the extra block adds elsewhere; the first stage keeps the smallest share of the rest.
Pure Python."""

from __future__ import annotations

import dataclasses

from ds_megatron.config import ModelShape
from ds_megatron.config.shape import layers_per_stage
from ds_megatron.pipeline_parallel.schedules import schedule_named
from ds_megatron.pipeline_parallel.schedules.record import LOOP
from ds_megatron.tune.core.matmuls import core_attention_matmuls, logits_matmul, matmul_s
from ds_megatron.tune.core.memory_model import block_param_count, expert_split, stage_param_counts
from ds_megatron.tune.core.spec import Candidate, Cluster
from ds_megatron.tune.training.time_model import expert_matmuls, ranked_step, stage_time


def balances(cand: Candidate) -> bool:
    """Whether the tuner chooses a layout for ``cand``'s schedule: one stage per rank in a loop, every backward
    whole (1F1B), so that a rank's activations are its in-flight micro-batches times its own blocks and the record's
    first- and last-rank peaks (``Schedule.activation_peaks``) hold at each end's block count.  The interleaved and
    deferred-W schedules keep the even split (an uneven chunk's in-flight and queued-W counts are not modelled)."""
    record = schedule_named(cand.schedule).for_settings(cand)
    return cand.pp > 1 and record.placement == LOOP and record.per_rank() == 1 and not record.deferred_weight_grads


def candidate_layouts(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    """The uneven layouts tried, the last stage's share falling from ceil(L/p) - 1 to 1: the rest spread over the
    other stages as evenly as possible, the extra blocks on the stages just before the last, so that the first (the
    embedding's, with the most micro-batches in flight) keeps the smallest share."""
    layouts = []
    for n_last in range(layers_per_stage(num_layers, pp) - 1, 0, -1):
        q, r = divmod(num_layers - n_last, pp - 1)
        layouts.append((q,) * (pp - 1 - r) + (q + 1,) * r + (n_last,))
    return layouts


def middle_ranks_bounded(model: ModelShape, cand: Candidate, layout: tuple[int, ...]) -> bool:
    """Whether every middle rank holds no more than the first, so that the memory model's first- and last-rank
    figures stay the layout's peaks: its activations (micro-batches in flight, ``Schedule.in_flight``, times its
    blocks) and its parameters (its blocks against the first's blocks and embedding)."""
    record = schedule_named(cand.schedule)
    p, m = cand.pp, cand.num_micro_batches
    ep, etp = cand.ep_size, expert_split(cand)
    block = block_param_count(model, cand.tp, ep, etp)
    first_params = (
        stage_param_counts(model, cand.tp, p, ep=ep, expert_tp=etp)[0]
        + (layout[0] - layers_per_stage(model.num_layers, p)) * block
    )
    for rank in range(1, p - 1):
        if record.in_flight(p, rank, m) * layout[rank] > record.in_flight(p, 0, m) * layout[0]:
            return False
        if layout[rank] * block > first_params:
            return False
    return True


def block_outweighs_output(model: ModelShape, cluster: Cluster, cand: Candidate) -> bool:
    """Whether a block's matmuls take at least the output layer's: then, with the layers split evenly, any block
    moved off the last stage makes another stage slower than the last was (a block adds its three matmul passes and
    four TP collectives, the output layer three matmul passes and one collective), so no layout helps.  A cheap
    test that spares the search the stage times of most GPT-sized vocabularies."""
    block = expert_matmuls(model, cand) + core_attention_matmuls(model, cand)
    return matmul_s(block, cluster) >= matmul_s((logits_matmul(model, cand),), cluster)


def balanced(model: ModelShape, cluster: Cluster, cand: Candidate) -> Candidate:
    """``cand`` with the uneven layout (``candidate_layouts``) whose slowest stage is fastest, where that is faster
    than the even split's (each stage ceil(L/p) blocks, the time model's even assumption) and the middle ranks stay
    within the first's memory; else ``cand`` itself (written configs then name no layout)."""
    if not balances(cand):
        return cand
    even = layers_per_stage(model.num_layers, cand.pp)
    if even * cand.pp == model.num_layers and block_outweighs_output(model, cluster, cand):
        return cand
    memo: dict[tuple[int, str], float] = {}

    def seconds(n: int, where: str) -> float:  # one stage's micro-batch, each (n, where) timed once
        if (n, where) not in memo:
            memo[n, where] = stage_time(model, cluster, cand, n, where).total_s
        return memo[n, where]

    best = seconds(even, "last")  # the first stage runs the same minus the output layer
    chosen = None
    for layout in candidate_layouts(model.num_layers, cand.pp):
        if layout[0] < 1:
            break
        middle = max(layout[:-1])
        middle_s = seconds(middle, "middle")
        if ranked_step(middle_s) >= ranked_step(best):
            break  # fewer blocks on the last stage only add to the others
        slowest = max(seconds(layout[0], "first"), seconds(layout[-1], "last"), middle_s)
        if ranked_step(slowest) < ranked_step(best) and middle_ranks_bounded(model, cand, layout):
            best, chosen = slowest, layout
    return cand if chosen is None else dataclasses.replace(cand, pipeline_layout=chosen)
