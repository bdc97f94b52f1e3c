"""Every RNG stream of a run has its own seed: no (kind, tp, pp, dp) pair of streams coincides, even at 1,024 ranks."""

from __future__ import annotations

from ds_megatron.random import TENSOR_PARALLEL, stream_seed


def test_no_two_streams_of_a_large_run_share_a_seed():
    tp, pp, dp = 8, 8, 16
    seeds = [stream_seed(1234, "default", pp=p, dp=d) for p in range(pp) for d in range(dp)]
    seeds += [
        stream_seed(1234, TENSOR_PARALLEL, pp=p, dp=d, tp=t) for p in range(pp) for d in range(dp) for t in range(tp)
    ]
    assert len(set(seeds)) == len(seeds) == pp * dp * (1 + tp)
    assert all(0 <= s < 2**63 for s in seeds)
    # the collision the additive offsets had: tensor-parallel (tp 0, pp 0, dp 0) vs default (pp 7, dp 2)
    assert stream_seed(1234, TENSOR_PARALLEL, pp=0, dp=0, tp=0) != stream_seed(1234, "default", pp=7, dp=2)


def test_seeds_depend_on_the_base_seed_and_are_stable():
    assert stream_seed(1, "default", pp=0, dp=0) != stream_seed(2, "default", pp=0, dp=0)
    assert stream_seed(1, "default", pp=0, dp=0) == stream_seed(1, "default", dp=0, pp=0)
