"""Interleaved 1F1B with its weight gradients deferred into its waits: ``interleaved_1f1b``'s module, placement,
stage count and refusals; each backward runs B only and the W passes fill the waits of a greedy list schedule
(``interleaved_order.deferred_w_timeline``, built at T_F = T_B = T_W), run by ``pipeline_parallel.interleaved``'s
``InterleavedZeroBubbleEngine`` on ``zero_bubble.DeferredWeightGradSteps``.  In that model the bubble falls to a third
of interleaved-1F1B's at m >= 2p (two thirds at m = p); the bubble here is that fixed order's makespan under the one
simulator at any costs.  The W passes held are counted off the same order, so they depend on m.  Searched by the
tuner only when ``--schedule`` asks, at every v, as interleaved 1F1B."""

from __future__ import annotations

from ds_megatron.pipeline_parallel.schedules.interleaved_1f1b import DEFAULT_V, build

NAME = "interleaved-zb"

SCHEDULE = build(
    NAME, DEFAULT_V, "ds_megatron.pipeline_parallel.interleaved:InterleavedZeroBubbleEngine", deferred_w=True
)
