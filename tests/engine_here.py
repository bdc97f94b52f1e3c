"""A one-process DeepSpeed engine built by ``engine.build_engine`` inside the test process (gloo, world size 1), for
unit tests of what only the real engine shows; the process group and the environment are restored afterwards."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def one_process_engine(run, monkeypatch) -> Iterator:
    """``build_engine(run)`` for a world of one process; yields its ``Built``."""
    import deepspeed.comm.comm as ds_comm

    from ds_megatron.engine import build_engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # DeepSpeed's CPU backend compiles its shared-memory all-reduce kernel (used by init_inference's all-reduce, never
    # by one process) with the JIT build cache of torch extensions: that took 44 s instead of 5 whenever the cache
    # was last built with other flags or another process held its lock.  Without it the backend is plain gloo.
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    monkeypatch.setattr(ds_comm, "cdb", ds_comm.cdb)  # DeepSpeed's backend, set by build_engine: restored after
    environ = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    try:
        yield build_engine(run)
    finally:  # the test process goes on with other tests: no process group, the environment as it was
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
