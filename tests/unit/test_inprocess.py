"""Fast tier: the harness of the spawned checks (``tests/inprocess.py``) fails a test whose rank raises or never
answers, with that rank's message, and replaces its pool of ranks instead of hanging the session."""

from __future__ import annotations

import time

import inprocess
import pytest
import torch


def _rank1_raises_rank0_hangs(group, rank: int, world: int) -> dict[str, str]:
    if rank == 1:
        raise ValueError("rank one's own message")
    time.sleep(3600)  # stuck outside any collective: only the harness's timeout ends it
    return {"never": "ok"}


def _summed(group, rank: int, world: int) -> dict[str, str]:
    def check(ctx):
        x = torch.ones(2) * (rank + 1)
        torch.distributed.all_reduce(x, group=group)
        return [("sum", x, torch.full((2,), 3.0))]

    return inprocess.run_checks({"summed": check}, None)


PRELOADED = ("torch", "torch.fx.experimental.symbolic_shapes", "deepspeed", "ds_megatron.pipeline_parallel.module")


def _what_a_fresh_rank_holds(group, rank: int, world: int) -> dict[str, str]:
    """What a rank has before any job imported anything: the fork server's preloaded modules, and assert_close's
    DTensor import switched off (every rank would otherwise import those itself, seconds of CPU each)."""
    import sys

    import torch.testing._comparison as comparison

    missing = [m for m in PRELOADED if m not in sys.modules]
    return {"preloaded": f"missing {missing}" if missing else "ok", "dtensor": str(comparison._HAS_DTENSOR)}


def test_a_rank_that_raises_or_hangs_fails_the_test_with_its_message(monkeypatch):
    # A warm pool that has imported this module: rank 1's answer then comes in milliseconds, well inside 2 s.
    assert inprocess.spawn_reports(_summed, 2) == [{"summed": "ok"}] * 2
    monkeypatch.setattr(inprocess, "JOB_TIMEOUT_S", 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        inprocess.spawn_reports(_rank1_raises_rank0_hangs, 2)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert "rank 0 lost:\nno answer within 2 s" in message, message
    assert "rank 1 raised:\n" in message and "ValueError: rank one's own message" in message, message
    assert 2 not in inprocess._POOLS  # the stuck rank was killed with its pool
    monkeypatch.undo()
    assert inprocess.spawn_reports(_summed, 2) == [{"summed": "ok"}] * 2  # a fresh pool serves the next job
    assert 2 in inprocess._POOLS  # and is kept
    # its ranks, fresh, were forked with what every rank imports already loaded
    assert inprocess.spawn_reports(_what_a_fresh_rank_holds, 2) == [{"preloaded": "ok", "dtensor": "False"}] * 2


def test_a_failed_check_marks_the_rank_so_that_its_pool_is_replaced(monkeypatch):
    """A rank may be left behind in a collective by a check that failed on another rank; ``run_checks`` marks the
    rank, and its answer (``"failed"``) makes ``spawn_reports`` replace the pool.  Shown in this process: replacing
    the session's pool here would cost the next test a new one."""
    monkeypatch.setattr(inprocess, "_failed", False)
    assert inprocess.run_checks({"ranks": lambda ctx: [("one", torch.tensor(1), torch.tensor(1))]}, None) == {
        "ranks": "ok"
    }
    assert not inprocess._failed
    report = inprocess.run_checks({"ranks": lambda ctx: [("rank", torch.tensor(1), torch.tensor(0))]}, None)
    assert report["ranks"].startswith("rank: "), report
    assert inprocess._failed
    assert "failed" in inprocess.KEPT  # its report still reaches the test, with the failure's message
