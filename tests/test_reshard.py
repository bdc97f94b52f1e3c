"""A checkpoint saved at tp 2 x pp 2 resumes at tp 1 x pp 4, whose checkpoint resumes at
tp 4 x pp 1 (weights and AdamW state resharded); the loss curve continues as without resharding (fp32, 1e-5)."""

from __future__ import annotations

import pytest
from launch import RECIPE, TINY_CONFIG, deepspeed_launch, quiet_run_flags, read_losses

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher


def _run(tmp_path, name: str, tp: int, pp: int, iters: int, extra: list[str]) -> dict[int, float]:
    flags = quiet_run_flags(tmp_path, name, tp, pp)
    deepspeed_launch(RECIPE, 4, ["--deepspeed_config", TINY_CONFIG, "--train-iters", str(iters), *flags, *extra])
    return read_losses(tmp_path / name)


def test_reshard_2x2_to_1x4_to_4x1_continues_the_loss_curve(tmp_path):
    reference = _run(tmp_path, "straight", 2, 2, 9, [])
    first = _run(tmp_path, "a", 2, 2, 3, ["--save", str(tmp_path / "ck_a")])
    second = _run(tmp_path, "b", 1, 4, 6, ["--load", str(tmp_path / "ck_a"), "--save", str(tmp_path / "ck_b")])
    third = _run(tmp_path, "c", 4, 1, 9, ["--load", str(tmp_path / "ck_b")])
    got = {**first, **second, **third}
    assert sorted(got) == list(range(1, 10))
    for step in range(1, 10):
        assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got, reference)
