"""Fast tier: how DeepSpeed's BF16 and ZeRO optimizers cut a flat parameter group over the data axis
(``checkpoint.masters.flat_partitions`` and its ZeRO options), which an expert-parallel save uses to write every
rank's optimizer file as the ep 1 run's (``checkpoint/ep_state.py``)."""

from __future__ import annotations

import pytest
import torch

from ds_megatron.checkpoint.masters import (
    flat_partitions,
    param_paddings,
    rank_padding,
    round_robin_order,
    zero_flat_layout,
)


def _flat(numels: list[int], data: int, order: list[int], paddings: list[int]) -> torch.Tensor:
    """The flat buffer built as DeepSpeed builds it, parameter i filled with i + 1 and every padding with 0: the
    parameters in ``order`` with ``paddings`` after each, then zeros up to a multiple of 2 x data."""
    parts = []
    for i, pad in zip(order, paddings):
        parts += [torch.full((numels[i],), float(i + 1)), torch.zeros(pad)]
    flat = torch.cat(parts)
    return torch.cat([flat, torch.zeros(-flat.numel() % (2 * data))])


@pytest.mark.parametrize("round_robin", [False, True])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("data", [1, 2, 3])
def test_fragments_address_each_parameter_in_the_flat_buffer(data, alignment, round_robin):
    """Every parameter's fragments, read from the data ranks' partitions of the buffer DeepSpeed builds, give the
    parameter back whole (in group order whatever the buffer order); the tail padding and each rank's share of it
    are the zeros after the last parameter."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    numels = [5, 1, 8, 3, 6]
    order = round_robin_order(len(numels), data) if round_robin else list(range(len(numels)))
    if round_robin:  # DeepSpeed's own reordering (it reads nothing of the instance)
        _, positions = DeepSpeedZeroOptimizer._round_robin_reorder(None, list(range(len(numels))), data)
        assert sorted(range(len(numels)), key=positions.__getitem__) == order
    paddings = param_paddings([numels[i] for i in order], alignment)
    assert paddings[-1] == 0 and (alignment > 1 or not any(paddings))
    size, padding, fragments = flat_partitions(numels, data, order, alignment)
    flat = _flat(numels, data, order, paddings)
    assert flat.numel() == size * data and not flat[flat.numel() - padding :].any()
    partitions = flat.split(size)
    for i, pieces in enumerate(fragments):
        whole = torch.zeros(numels[i])
        for d, at, start, n in pieces:
            whole[at : at + n] = partitions[d][start : start + n]
        assert torch.equal(whole, torch.full((numels[i],), float(i + 1))), (i, pieces)
    assert sum(rank_padding(size, padding, data, d) for d in range(data)) == padding
    assert all(rank_padding(size, padding, data, d) == 0 for d in range(data - 1)) or padding > size


def test_the_zero_optimizers_options():
    """Without reordering or parameter alignment the ZeRO optimizer's layout is the BF16 optimizer's; with
    ``parameter_alignment`` each parameter starts on 16 bytes (4 fp32 or 8 bf16 elements), with
    ``round_robin_gradients`` the buffer takes every data-th parameter in turn."""
    for data in (1, 2, 4):
        order, *cut, zeros = zero_flat_layout([7, 2, 9], data, False, False, 4)
        assert (order, tuple(cut), zeros) == ([0, 1, 2], flat_partitions([7, 2, 9], data), [0, 0, 0])
    assert zero_flat_layout([7, 2, 9], 2, False, True, 4)[-1] == [1, 2, 0]
    assert zero_flat_layout([7, 2, 9], 2, False, True, 2)[-1] == [1, 6, 0]
    order, _, _, fragments, zeros = zero_flat_layout([7, 2, 9], 2, True, True, 4)
    assert order == [0, 2, 1] and zeros == [1, 3, 0] and fragments[1] == [(1, 0, 8, 2)]  # at 8 + 12 = 20: 12 + 8


def test_a_group_shorter_than_its_padding_pads_more_than_the_last_rank():
    """One element over 4 ranks: a buffer of 8, partitions of 2, 7 zeros: rank 0 holds 1 of them, the others 2
    (DeepSpeed's ZeRO optimizer records each rank's, ``groups_padding``)."""
    size, padding, fragments = flat_partitions([1], 4)
    assert (size, padding, fragments) == (2, 7, [[(0, 0, 0, 1)]])
    assert [rank_padding(size, padding, 4, d) for d in range(4)] == [1, 2, 2, 2]
