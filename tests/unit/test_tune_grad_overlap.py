"""The time model's overlapped data-parallel reduction (``parallel.overlap_grad_reduce``): the bucket queue against
hand-computed cases and an explicit simulation, the benchmark it is held to, and when a candidate overlaps."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest

from ds_megatron.config.rules import GRAD_REDUCE_BUCKET_ELEMENTS
from ds_megatron.tune import Candidate, build_cluster, build_model_shape
from ds_megatron.tune.core.links import link, ring_s
from ds_megatron.tune.core.memory_model import WEIGHT_BYTES, padded_vocab_size, rank_param_counts, stage_param_counts
from ds_megatron.tune.training.time_model import (
    GRAD_REDUCE_BYTES,
    dp_comm_s,
    grad_reduce_overlapped,
    overlapped_reduce_s,
    reduced_ranks,
    stage_times,
)
from ds_megatron.tune.training.written import ds_config


def _linear(n: int) -> float:
    return float(n)  # one second per element: the hand-computed cases' bucket time


def _queue(params: int, trailing: int, window: float, bucket_s, bucket: int) -> float:
    """The same queue run bucket by bucket: a bucket is ready when its last element is (the early ones at an even
    rate over the window, the trailing ones at its end) and starts when the one before it is done."""
    early, done, start = params - trailing, 0.0, 0
    while start < params:
        end = min(start + bucket, params)
        ready = window * end / early if end <= early and early else window
        done = max(done, ready) + bucket_s(end - start)
        start = end
    return max(done, window) - window


def test_hand_computed_cases():
    # 3 buckets of 4, a bucket's worth of backward (a = 4) as long as its reduction (d = 4): the last one shows
    assert overlapped_reduce_s(12, 0, 12.0, _linear, bucket=4) == 4.0
    # the reduction slower than the backward (a = 2, d = 4): 12 s of reduction less the 2 x 2 s it ran under
    assert overlapped_reduce_s(12, 0, 6.0, _linear, bucket=4) == 8.0
    # 7 early elements (one whole bucket, ready at 4 s of a 7 s backward, done at 8 s), then 6 at the end: 4 + 2
    assert overlapped_reduce_s(10, 3, 7.0, _linear, bucket=4) == 1.0 + 4.0 + 2.0
    # no backward to hide behind: every bucket in turn, each with its latency (1 s here)
    assert overlapped_reduce_s(10, 0, 0.0, lambda n: 1.0 + n, bucket=4) == 5.0 + 5.0 + 3.0
    # everything trailing: the same, after the window
    assert overlapped_reduce_s(10, 10, 50.0, lambda n: 1.0 + n, bucket=4) == 13.0
    # one partial bucket of early gradients is ready only when its last gradient is, at the window's end
    assert overlapped_reduce_s(3, 0, 100.0, _linear, bucket=4) == 3.0


def test_closed_form_is_the_queue():
    rng = random.Random(0)
    for _ in range(500):
        bucket = rng.randint(1, 50)
        params = rng.randint(1, 400)
        trailing = rng.randint(0, params)
        window = rng.choice([0.0, rng.uniform(0, 500)])
        latency, per = rng.uniform(0, 3), rng.uniform(0.01, 2)

        def bucket_s(n, latency=latency, per=per):
            return latency + per * n

        got = overlapped_reduce_s(params, trailing, window, bucket_s, bucket=bucket)
        assert got == pytest.approx(_queue(params, trailing, window, bucket_s, bucket), rel=1e-12, abs=1e-9)


def test_held_to_the_cpu_measurement():
    """benchmarks/results/dp_overlap.md (quiet machine, dp 2, gloo): DeepSpeed's whole reduction 74.8 ms exposed, the
    overlap's 24.5 ms at accumulation 2 and 20.7 ms at 8.  The benchmark's GPT-2 (4 blocks, h 512, s 128, V 1001,
    tied) has the 13,200,384 parameters it printed: 3 whole buckets of block gradients, then 617,472 elements (the
    last block's first 27,648, the 589,824 of the embedding and the position table) ready at the backward's end.
    With the bucket time from the measured whole (74.8 ms x elements / 13,200,384: d = 23.8 ms a bucket, 3.5 ms
    the rest; gloo's latency left out) and the backward 2/3 of a micro-batch's (931 - 75) / 2 ms (W = 285.5 ms,
    a bucket's share a = 95.0 ms > d), the third bucket is ready 0.6 ms before the backward ends and the model
    leaves 23.1 + 3.5 = 26.6 ms exposed, against 20.7-24.5 measured.  On CPU gloo sums on the cores the backward
    runs on; the benchmark's CPU seconds per step are the same with and without the overlap (0.918, 0.911), so what
    it hides there is the transfer and the wait for the peer, as on a GPU."""
    model = build_model_shape(None, 4, 512, 8, 1001, 128)
    params = stage_param_counts(model, 1, 1)[0]
    assert params == 13_200_384
    trailing = padded_vocab_size(1001, 1) * 512 + 128 * 512
    assert trailing == 589_824
    whole_s, window = 74.8e-3, 2 / 3 * (931.2e-3 - 74.8e-3) / 2
    bucket_s = lambda n: whole_s * n / params  # noqa: E731
    exposed = overlapped_reduce_s(params, trailing, window, bucket_s)
    rest = params - 3 * GRAD_REDUCE_BUCKET_ELEMENTS
    assert rest == 617_472
    a, d = GRAD_REDUCE_BUCKET_ELEMENTS / (params - trailing) * window, bucket_s(GRAD_REDUCE_BUCKET_ELEMENTS)
    assert a > d and 3 * a < window
    assert exposed == pytest.approx(3 * a + d - window + bucket_s(rest))
    assert exposed == pytest.approx(26.6e-3, abs=0.05e-3) and 20.7e-3 < exposed < 1.1 * 24.5e-3


def _llama8b():
    return build_model_shape("llama3-8b", None, None, None, None, None)


def _cand(**kw) -> Candidate:
    base = dict(tp=2, pp=1, dp=4, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8)
    return Candidate(**{**base, "recompute": "none", "attention": "sdpa", **kw})


def test_dp_comm_with_and_without_the_overlap():
    model, cluster = _llama8b(), build_cluster("h100-sxm", 8, 8)
    cand = _cand()
    off = dataclasses.replace(cand, overlap_grad_reduce=False)
    params = max(rank_param_counts(model, cand))
    gbps, latency = link(cluster, False)
    whole = ring_s(GRAD_REDUCE_BYTES * params, 4, gbps, latency)
    gather = ring_s(WEIGHT_BYTES * params, 4, gbps, latency, passes=1)  # ZeRO-1's, after the optimizer: never hidden
    assert not grad_reduce_overlapped(off) and grad_reduce_overlapped(cand)
    assert dp_comm_s(model, cluster, off) == pytest.approx(whole + gather)
    # the backward (2/3 of the micro-batch's compute without recompute) outlasts the reduction
    [(p, trailing, window)] = reduced_ranks(model, cluster, cand)
    assert (p, trailing) == (params, padded_vocab_size(model.vocab_size, 2) * model.hidden_size // 2)
    assert window == pytest.approx(2 / 3 * stage_times(model, cluster, cand)[1].compute_s)

    def bucket_s(n):
        return ring_s(GRAD_REDUCE_BYTES * n, 4, gbps, latency)

    whole_buckets = (p - trailing) // GRAD_REDUCE_BUCKET_ELEMENTS
    a, d = GRAD_REDUCE_BUCKET_ELEMENTS / (p - trailing) * window, bucket_s(GRAD_REDUCE_BUCKET_ELEMENTS)
    # each bucket is done before the next is ready, the last whole one before the backward ends (the 894 whole
    # buckets end 0.1 ms short of it); what shows is the bucket the embedding's start shares and the embedding's
    assert d < a and whole_buckets * a + d < window
    full, part = divmod(p - whole_buckets * GRAD_REDUCE_BUCKET_ELEMENTS, GRAD_REDUCE_BUCKET_ELEMENTS)
    assert dp_comm_s(model, cluster, cand) == pytest.approx(full * d + bucket_s(part) + gather)
    assert dp_comm_s(model, cluster, cand) < 0.3 * dp_comm_s(model, cluster, off)
    # nothing to reduce at dp x cp 1; the data axis counts the CP ranks
    single = _cand(dp=1)
    assert not grad_reduce_overlapped(single) and dp_comm_s(model, cluster, single) == 0.0
    assert grad_reduce_overlapped(_cand(dp=1, cp=2))


def test_each_end_rank_and_its_window():
    model, cluster = _llama8b(), build_cluster("h100-sxm", 16, 8)
    cand = _cand(pp=2, dp=4, num_micro_batches=16)
    first, last = stage_times(model, cluster, cand)
    embedding = padded_vocab_size(model.vocab_size, 2) * model.hidden_size // 2
    (p0, t0, w0), (p1, t1, w1) = reduced_ranks(model, cluster, cand)
    assert (p0, p1) == rank_param_counts(model, cand)
    assert (t0, t1) == (embedding, 0)  # an untied output layer is computed in backward; the embedding is its last op
    assert w0 == pytest.approx(2 / 3 * first.compute_s) and w1 == pytest.approx(2 / 3 * last.compute_s)
    tied = dataclasses.replace(model, tie_word_embeddings=True)
    assert [t for _, t, _ in reduced_ranks(tied, cluster, cand)] == [embedding, embedding]  # reduced after its sum
    # deferred weight gradients are final in the W pass: the window is its GEMMs
    zb = dataclasses.replace(cand, schedule="zb-h1")
    assert [w for _, _, w in reduced_ranks(model, cluster, zb)] == [
        s.weight_grad_s for s in stage_times(model, cluster, zb)
    ]
    # DualPipeV: rank 0 holds the embedding and the output layer, the last rank middle blocks only
    v = dataclasses.replace(cand, schedule="dualpipev")
    (q0, u0, _), (q1, u1, _) = reduced_ranks(model, cluster, v)
    assert (q0, q1) == rank_param_counts(model, v) and (u0, u1) == (embedding, 0)


def test_the_setting_is_written_only_when_off():
    cand = _cand()
    result = types.SimpleNamespace(model=_llama8b(), global_batch_size=64)
    assert "overlap_grad_reduce" not in cand.settings()
    assert (
        "overlap_grad_reduce" not in ds_config(result, types.SimpleNamespace(candidate=cand))["ds_megatron"]["parallel"]
    )
    off = dataclasses.replace(cand, overlap_grad_reduce=False)
    assert off.settings()["overlap_grad_reduce"] is False
    assert (
        ds_config(result, types.SimpleNamespace(candidate=off))["ds_megatron"]["parallel"]["overlap_grad_reduce"]
        is False
    )
