"""CPU ranks share the machine's cores when OMP_NUM_THREADS is unset, and keep the user's setting when it is set."""

from __future__ import annotations

import os

import torch

from ds_megatron.engine import default_cpu_threads


def test_ranks_share_the_cores_unless_told(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "4")
        expected = max(1, len(os.sched_getaffinity(0)) // 4)
        assert default_cpu_threads() == expected and torch.get_num_threads() == expected
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert default_cpu_threads() is None
    finally:
        torch.set_num_threads(before)
