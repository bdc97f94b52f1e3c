"""CPU ranks share the machine's cores when OMP_NUM_THREADS is unset, and keep the user's setting when it is set."""

from __future__ import annotations

import os

import pytest
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


@pytest.mark.parametrize("inference", [False, True])
def test_training_starts_deepspeeds_cpu_backend_without_its_shm_all_reduce(monkeypatch, inference):
    # Only init_inference's layers use DeepSpeed's shared-memory all-reduce: a training process must not build (a JIT
    # C++ extension, 40-150 s when its cache is stale) or map it; an inference one keeps it.
    import importlib

    import deepspeed

    from ds_megatron import engine

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    real = comm_torch.build_shm_op
    built = []
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(engine, "device_type", lambda: "cpu")
    monkeypatch.setattr(engine, "release_shm_buffer_name", lambda: None)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: built.append(comm_torch.build_shm_op))
    engine.init_distributed(inference_all_reduce=inference)
    assert len(built) == 1 and (built[0] is real) == inference
    if not inference:
        assert built[0]() is None  # DeepSpeed's backend then reduces through plain torch.distributed
    assert comm_torch.build_shm_op is real  # restored
